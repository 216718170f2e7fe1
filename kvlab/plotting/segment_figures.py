"""Figures of notebook 01's segment arithmetic: segments and their size against tokens
moved (segment_scaling) and for every layout at once (segments_by_layout). Drawn from
kvlab.cache.segments.sweep rows."""

from __future__ import annotations

from typing import Sequence

import matplotlib.lines
import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np

from kvlab.plotting.common import (CYCLE, DEFAULT_WIDTH, SMALL, dots, figure_width, human_bytes, panels, paper_figure,
                                   room_for_numbers, text_inches, wrap)
from kvlab.plotting.common import title as figure_title


@paper_figure
def segment_scaling(rows: Sequence[dict], title: str = "", width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """Segments and mean segment size against tokens moved, a line per layout and block size:
    a colour and marker per layout, a line style per block size, each named once in the key
    under the panels.

    ``rows`` are kvlab.cache.segments.sweep rows.
    """
    fig, (left, right) = panels(2, width, 2.4)
    series: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        series.setdefault((row["layout"], row["block_size"]), []).append(row)
    layouts = list(dict.fromkeys(k[0] for k in series))
    sizes = sorted({k[1] for k in series})
    marks = {layout: dict(color=CYCLE[i % len(CYCLE)], marker="os^vDP*X"[i % 8], ms=4.5 - 0.5 * (i % 3), mfc="none")
             for i, layout in enumerate(layouts)}
    styles = {size: ["-", "--", ":", "-."][k % 4] for k, size in enumerate(sizes)}
    for (layout, block_size), points in series.items():
        points = sorted(points, key=lambda r: r["tokens"])
        tokens = [p["tokens"] for p in points]
        style = dict(ls=styles[block_size], lw=1, **marks[layout])
        left.plot(tokens, [p["segments"] for p in points], **style)
        right.plot(tokens, [p["mean_segment_bytes"] for p in points], **style)
    for ax, ylabel in ((left, "contiguous segments"), (right, "mean segment size")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("tokens moved")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="major", alpha=0.3)
    right.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: human_bytes(v)))
    key = ([matplotlib.lines.Line2D([], [], lw=1, label=layout, **marks[layout]) for layout in layouts]
           + [matplotlib.lines.Line2D([], [], color="0.3", lw=1, ls=styles[size], label=f"BS={size}")
              for size in sizes])
    style = dict(handlelength=2.4, handletextpad=0.5, columnspacing=1.2)
    fig.legend(handles=key, loc="outside lower center", ncols=_key_columns_across(key, figure_width(width), split=len(layouts), **style),
               **style)
    figure_title(fig, title)
    return fig


def _key_columns_across(key: Sequence, inches: float, handlelength: float, handletextpad: float,
                        columnspacing: float, split: int = 0) -> int:
    """The most columns a key's entries (filled column by column, as matplotlib does) take
    within ``inches`` of width, preferring those where the first ``split`` entries (one kind
    of entry, the rest another) fill whole columns of their own."""
    em = SMALL / 72
    widths = [(handlelength + handletextpad) * em + text_inches(entry.get_label()) for entry in key]
    fitting, clean = [1], [1] if split in (0, len(widths)) else []
    for columns in range(2, len(widths) + 1):
        rows, longer = divmod(len(widths), columns)
        starts = np.cumsum([0] + [rows + 1] * longer + [rows] * (columns - longer))
        across = sum(max(widths[a:b]) for a, b in zip(starts[:-1], starts[1:])) + (columns - 1) * columnspacing * em
        if across <= inches - 0.2:
            fitting.append(columns)
            if split in (0, *starts):
                clean.append(columns)
    return max(clean or fitting)


@paper_figure
def segments_by_layout(rows: Sequence[dict], title: str = "", width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """Segments (dots, log scale) and their size (label) for every layout in ``rows``, one dot
    per block size; layouts that move exactly the same share a row, so every paged layout
    fits on a page. ``rows`` are kvlab.cache.segments.sweep rows for one token count."""
    sizes = sorted({r["block_size"] for r in rows})
    groups = _same_segments(rows, sizes)
    inches = figure_width(width)
    labels = [wrap(", ".join(layouts), inches / 3, SMALL) for layouts in groups.values()]
    spans = [max(DOT_ROW * len(sizes), LINE * (label.count("\n") + 1)) + DOT_ROW for label in labels]
    centres = np.cumsum(spans) - np.array(spans) / 2  # in inches, down the page
    fig, ax = plt.subplots(figsize=(inches, sum(spans) + 1.0), layout="constrained")
    for k, block_size in enumerate(sizes):
        moved = [segments[k] for segments in groups]
        dots(ax, centres + (k - (len(sizes) - 1) / 2) * DOT_ROW, [count for count, _ in moved],
             [CYCLE[k % len(CYCLE)]] * len(moved), [f"{count:,.0f} × {human_bytes(size)}" for count, size in moved])
    counts = [r["segments"] for r in rows]
    ax.set_xlim(min(counts) / 2, max(counts) * 2)
    ax.set_yticks(centres, labels)
    ax.set_ylim(sum(spans), 0)
    ax.set_xlabel("contiguous segments (log)")
    ax.legend(handles=[matplotlib.lines.Line2D([], [], ls="", marker="o", color=CYCLE[k % len(CYCLE)],
                                               label=f"block size {block_size}") for k, block_size in enumerate(sizes)],
              loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=len(sizes))
    figure_title(fig, title)
    room_for_numbers(fig, ax, 16)
    return fig


DOT_ROW = 0.16  # inches between a row's dots (one per block size)
LINE = 0.12  # inches per line of a row's label


def _same_segments(rows: Sequence[dict], sizes: Sequence[int]) -> dict[tuple, list[str]]:
    """Layouts grouped by what they move: (segments, mean segment bytes) per block size."""
    by_key = {(r["layout"], r["block_size"]): r for r in rows}
    groups: dict[tuple, list[str]] = {}
    for layout in dict.fromkeys(r["layout"] for r in rows):
        moved = tuple((by_key[layout, size]["segments"], by_key[layout, size]["mean_segment_bytes"]) for size in sizes)
        groups.setdefault(moved, []).append(layout)
    return groups
