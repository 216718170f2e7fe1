"""Figures of notebook 01's segment arithmetic: segments and their size against tokens
moved, a panel per block size (segment_scaling), and for every layout at once
(segments_by_layout). Drawn from kvlab.cache.segments.sweep rows."""

from __future__ import annotations

from typing import Sequence

import matplotlib.lines
import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np

from kvlab.plotting.common import (CYCLE, DEFAULT_WIDTH, SMALL, dots, figure_width, human_bytes, paper_figure,
                                   room_for_numbers, text_inches, wrap)
from kvlab.plotting.common import title as figure_title


@paper_figure
def segment_scaling(rows: Sequence[dict], title: str = "", width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """Segments (top row) and mean segment size (bottom row) against tokens moved, a column of
    panels per block size and a line per layout, in a colour and marker of its own; layouts
    moving the same, to the two digits a log axis shows, share a line and a name in the key
    ("A, B" where exactly the same, "A ≈ B" where not), so none hides under another.

    ``rows`` are kvlab.cache.segments.sweep rows.
    """
    sizes = sorted({r["block_size"] for r in rows})
    inches = figure_width(width)
    columns = min(len(sizes), max(1, int(inches // 1.5)))
    bands = -(-len(sizes) // columns)  # rows of block sizes, each a segments and a size row of panels
    fig, axes = plt.subplots(2 * bands, columns, figsize=(inches, 1.35 * 2 * bands + 0.9), squeeze=False,
                             sharex=True, layout="constrained")
    series: dict[tuple, dict[str, list]] = {}  # what layouts move, to 2 digits (a log axis's eye): theirs
    for layout in dict.fromkeys(r["layout"] for r in rows):
        moved = [(r["block_size"], r["tokens"], r["segments"], r["mean_segment_bytes"])
                 for r in sorted(rows, key=lambda r: (r["block_size"], r["tokens"])) if r["layout"] == layout]
        seen = tuple((bs, tokens, float(f"{segments:.2g}"), float(f"{size:.2g}")) for bs, tokens, segments, size in moved)
        series.setdefault(seen, {}).setdefault(layout, moved)
    names = {seen: (", " if len({tuple(m) for m in same.values()}) == 1 else " ≈ ").join(same)
             for seen, same in series.items()}
    marks = {seen: dict(color=CYCLE[i % len(CYCLE)], marker="os^vDP*X"[i % 8], ms=3.5, mfc="none", lw=1)
             for i, seen in enumerate(series)}
    for k, block_size in enumerate(sizes):
        top, bottom = axes[2 * (k // columns), k % columns], axes[2 * (k // columns) + 1, k % columns]
        for seen, same in series.items():
            tokens, segments, size = zip(*[(n, count, size) for bs, n, count, size in next(iter(same.values()))
                                           if bs == block_size])
            top.plot(tokens, segments, label=names[seen], **marks[seen])
            bottom.plot(tokens, size, label=names[seen], **marks[seen])
        top.set_title(f"block size {block_size}", fontsize=SMALL)
        for ax, ylabel in ((top, "segments"), (bottom, "mean segment")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log", base=2)
            ax.grid(True, which="major", alpha=0.3)
            ax.set_ylabel(ylabel if k % columns == 0 else "")
        bottom.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: human_bytes(v)))
        bottom.set_xlabel("tokens moved")
    for ax in list(axes.flat)[2 * len(sizes):]:
        ax.axis("off")
    for row in axes:  # one y range a row of panels, so block sizes compare at a glance
        shown = [ax for ax in row if ax.lines]
        low, high = min(ax.get_ylim()[0] for ax in shown), max(ax.get_ylim()[1] for ax in shown)
        for ax in shown:
            ax.set_ylim(low, high)
    key = [matplotlib.lines.Line2D([], [], label=names[seen], **marks[seen]) for seen in series]
    style = dict(handlelength=2.4, handletextpad=0.5, columnspacing=1.2)
    fig.legend(handles=key, loc="outside lower center", ncols=_key_columns_across(key, inches, **style), **style)
    figure_title(fig, title)
    return fig


def _key_columns_across(key: Sequence, inches: float, handlelength: float, handletextpad: float,
                        columnspacing: float) -> int:
    """The most columns a key's entries (filled column by column, as matplotlib does) take
    within ``inches`` of width."""
    em = SMALL / 72
    widths = [(handlelength + handletextpad) * em + text_inches(entry.get_label()) for entry in key]
    fitting = [1]
    for columns in range(2, len(widths) + 1):
        rows, longer = divmod(len(widths), columns)
        starts = np.cumsum([0] + [rows + 1] * longer + [rows] * (columns - longer))
        across = sum(max(widths[a:b]) for a, b in zip(starts[:-1], starts[1:])) + (columns - 1) * columnspacing * em
        if across <= inches - 0.2:
            fitting.append(columns)
    return max(fitting)


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
