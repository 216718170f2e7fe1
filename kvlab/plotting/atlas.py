"""Figures of notebook 01: the memory map of a small cache, the atlas page, segment scaling
and segments per layout. Drawn from kvlab's data (layouts and segment rows), never from a
notebook's private state, so every one can be regenerated with the same call."""

from __future__ import annotations

from typing import Iterable, Sequence

import matplotlib
import matplotlib.colors
import matplotlib.patches
import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np

from kvlab.cache.allocation import address_labels, axis_sizes
from kvlab.cache.geometry import ModelGeometry
from kvlab.cache.layouts import Layout, get_layout
from kvlab.cache.segments import block_segments
from kvlab.plotting.common import (BLUE, CYCLE, DEFAULT_WIDTH, MEDIUM, ORANGE, SMALL, figure_width, human_bytes,
                                   panels, paper_figure, plural, room_for_numbers, unique_legend, wrap)
from kvlab.plotting.common import title as figure_title

COLOUR_BY = ("layer", "block", "part", "token")
_OKABE_ITO = matplotlib.colors.ListedColormap(CYCLE, name="okabe_ito")
_CMAPS = {"layer": _OKABE_ITO, "block": _OKABE_ITO, "part": None, "token": "viridis"}
_PART_COLOURS = np.array([matplotlib.colors.to_rgb(BLUE), matplotlib.colors.to_rgb(ORANGE)])
LEGEND_INCHES = 0.9  # the colour legend right of a map


def miniature(geometry: ModelGeometry, layers: int = 4, heads: int = 2, block_size: int = 4) -> ModelGeometry:
    """A few layers, heads and tokens of ``geometry``: small enough to draw every vector.

    ``layers``, ``heads`` and ``block_size`` are caps (an MLA latent stays one head)."""
    if min(layers, heads, block_size) < 1:
        raise ValueError(f"a miniature needs at least one layer, head and token, got {layers}, {heads}, {block_size}")
    return geometry.with_(
        name=f"{geometry.name} (miniature)",
        num_layers=min(geometry.num_layers, layers),
        num_kv_heads=min(geometry.num_kv_heads, heads),
        block_size=min(geometry.block_size, block_size),
    )


def _colours(values: np.ndarray, by: str, count: int) -> np.ndarray:
    if by == "part":
        return _PART_COLOURS[values % 2]
    cmap = plt.get_cmap(_CMAPS[by])
    scale = values / max(count - 1, 1) if by == "token" else values % cmap.N
    return np.asarray(cmap(scale if by == "token" else scale.astype(int)))[:, :3]


def _legend(by: str, geometry: ModelGeometry, num_blocks: int) -> list[matplotlib.patches.Patch]:
    count = {"layer": geometry.num_layers, "block": num_blocks, "part": 2, "token": geometry.block_size}[by]
    shown = list(range(count)) if count <= 8 else [0, count // 2, count - 1]
    colours = _colours(np.array(shown), by, count)
    names = {"layer": "layer {}", "block": "block {}", "token": "token {}"}
    return [
        matplotlib.patches.Patch(
            color=c, label=geometry.part_names[v] if by == "part" else names[by].format(v)
        )
        for v, c in zip(shown, colours)
    ]


def draw_memory_map(
    ax: plt.Axes,
    layout: str | Layout,
    geometry: ModelGeometry,
    num_blocks: int,
    by: str = "layer",
    moved_blocks: Sequence[int] = (),
    width: int | None = None,
) -> None:
    """Draw the cache's address space, one cell per head vector, coloured by ``by``.

    Rows wrap every ``width`` cells (default: one layer's page of one block). Blocks in
    ``moved_blocks`` are drawn solid, the rest faded; the title gives their segment count.
    """
    layout = get_layout(layout)
    if by not in COLOUR_BY:
        raise ValueError(f"colour by one of {COLOUR_BY}, not {by!r}")
    labels = {k: v.numpy() for k, v in address_labels(layout, geometry, num_blocks).items()}
    counts = {"layer": geometry.num_layers, "block": num_blocks, "part": 2, "token": geometry.block_size}
    rgb = _colours(labels[by], by, counts[by])
    if moved_blocks:
        faded = ~np.isin(labels["block"], list(moved_blocks))
        rgb[faded] = 0.25 * rgb[faded] + 0.75
    width = width or geometry.block_size * geometry.num_kv_heads * axis_sizes(layout, geometry, num_blocks)["S"]
    rows = -(-len(rgb) // width)
    image = np.ones((rows * width, 3))
    image[: len(rgb)] = rgb
    ax.imshow(image.reshape(rows, width, 3), aspect="auto", interpolation="nearest")
    starts = np.flatnonzero(np.diff(labels["tensor"])) + 1
    for start in starts:
        ax.axhline(start / width - 0.5, color="black", lw=0.8)
    ax.set_xticks([])
    ax.set_yticks([])
    title = layout.name
    if moved_blocks:
        seg = block_segments(layout, geometry, num_blocks, moved_blocks)
        title += f"\n{plural(seg.count, 'segment')} for {plural(len(moved_blocks), 'block')}"
    ax.set_title(title, fontsize=MEDIUM)


def _fit_titles(axes: Iterable[plt.Axes], inches: float) -> None:
    """Map titles in small type, wrapped to their panel's width."""
    for ax in axes:
        ax.set_title(wrap(ax.get_title(), inches, SMALL), fontsize=SMALL)


@paper_figure
def memory_map(
    layouts: Iterable[str | Layout],
    geometry: ModelGeometry,
    num_blocks: int = 6,
    moved_blocks: Sequence[int] = (1, 4),
    colour_by: Sequence[str] = COLOUR_BY,
    width: str | float = DEFAULT_WIDTH,
) -> plt.Figure:
    """Layouts side by side (columns), coloured by layer, block, K/V and token (rows)."""
    layouts = [get_layout(layout) for layout in layouts]
    inches = figure_width(width)
    panel = (inches - LEGEND_INCHES - 0.3) / len(layouts)
    fig, axes = plt.subplots(len(colour_by), len(layouts), figsize=(inches, (min(panel, 1.6) + 0.4) * len(colour_by)),
                             squeeze=False, layout="constrained")
    for row, by in enumerate(colour_by):
        for col, layout in enumerate(layouts):
            draw_memory_map(axes[row, col], layout, geometry, num_blocks, by, moved_blocks)
            if row:
                axes[row, col].set_title("")
        axes[row, 0].set_ylabel(f"by {by if by != 'part' else 'K/V'}")
        axes[row, -1].legend(handles=_legend(by, geometry, num_blocks), loc="center left", bbox_to_anchor=(1.02, 0.5))
    _fit_titles(axes[0], panel)
    figure_title(fig, f"{geometry.name}: {geometry.num_layers} layers, {num_blocks} blocks of {geometry.block_size} "
                      f"tokens, {'one MLA latent' if geometry.is_mla else f'{geometry.num_kv_heads} kv heads'}; "
                      f"one cell = one head vector, addresses left to right, wrapping; "
                      f"blocks {list(moved_blocks)} moved")
    return fig


@paper_figure
def segment_scaling(rows: Sequence[dict], title: str = "", width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """Segments and mean segment size against tokens moved, a line per layout and block size.

    ``rows`` are kvlab.cache.segments.sweep rows.
    """
    fig, (left, right) = panels(2, width, 2.4)
    series: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        series.setdefault((row["layout"], row["block_size"]), []).append(row)
    layouts = list(dict.fromkeys(k[0] for k in series))
    sizes = sorted({k[1] for k in series})
    styles = ["-", "--", ":", "-."]
    for (layout, block_size), points in series.items():
        points = sorted(points, key=lambda r: r["tokens"])
        tokens = [p["tokens"] for p in points]
        index = layouts.index(layout)
        style = dict(color=CYCLE[index % len(CYCLE)], ls=styles[sizes.index(block_size) % 4],
                     marker="os^vDP*X"[index % 8], ms=4.5 - 0.5 * (index % 3), mfc="none", lw=1)
        label = f"{layout}, BS={block_size}"
        left.plot(tokens, [p["segments"] for p in points], label=label, **style)
        right.plot(tokens, [p["mean_segment_bytes"] for p in points], label=label, **style)
    for ax, ylabel in ((left, "contiguous segments"), (right, "mean segment size (bytes)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("tokens moved")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="major", alpha=0.3)
    right.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: human_bytes(v)))
    unique_legend(fig, [left], loc="outside lower center", ncols=max(1, int(figure_width(width) // 1.6)))
    figure_title(fig, title)
    return fig


@paper_figure
def segments_by_layout(rows: Sequence[dict], title: str = "", width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """Segments (bars, log scale) and segment size (label) for every layout in ``rows``,
    one bar per block size. ``rows`` are kvlab.cache.segments.sweep rows for one token count."""
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    sizes = sorted({r["block_size"] for r in rows})
    by_key = {(r["layout"], r["block_size"]): r for r in rows}
    height = 0.8 / len(sizes)
    fig, ax = plt.subplots(figsize=(figure_width(width), 0.18 * len(layouts) * len(sizes) + 1.2), layout="constrained")
    for i, block_size in enumerate(sizes):
        ys = np.arange(len(layouts)) + i * height
        values = [by_key[(name, block_size)]["segments"] for name in layouts]
        bars = ax.barh(ys, values, height=height, label=f"block size {block_size}")
        for bar, name in zip(bars, layouts):
            row = by_key[(name, block_size)]
            ax.annotate(f" {row['segments']} x {human_bytes(row['mean_segment_bytes'])}",
                        (bar.get_width(), bar.get_y() + bar.get_height() / 2), va="center", fontsize=SMALL)
    ax.set_yticks(np.arange(len(layouts)) + height * (len(sizes) - 1) / 2, layouts)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(0.8, 1.2 * max(r["segments"] for r in rows))
    ax.set_xlabel("contiguous segments (log)")
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=len(sizes))
    figure_title(fig, title)
    room_for_numbers(fig, ax, 16)
    return fig


@paper_figure
def atlas(
    layouts: Sequence[str | Layout],
    geometry: ModelGeometry,
    by: str = "layer",
    num_blocks: int = 6,
    moved_blocks: Sequence[int] = (1, 4),
    columns: int | None = None,
    width: str | float = DEFAULT_WIDTH,
) -> plt.Figure:
    """Every layout on one page, coloured by one property: the whole atlas at a glance
    (``columns``: maps per row, default as many as the width holds)."""
    layouts = [get_layout(layout) for layout in layouts]
    inches = figure_width(width)
    columns = columns or max(1, int((inches - LEGEND_INCHES) // 1.15))
    panel = (inches - LEGEND_INCHES) / columns
    rows = -(-len(layouts) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(inches, (min(panel, 1.6) + 0.35) * rows), squeeze=False,
                             layout="constrained")
    for ax, layout in zip(axes.flat, layouts):
        draw_memory_map(ax, layout, geometry, num_blocks, by, moved_blocks)
    _fit_titles(axes.flat, panel)
    for ax in list(axes.flat)[len(layouts):]:
        ax.axis("off")
    axes[0, -1].legend(handles=_legend(by, geometry, num_blocks), loc="upper left", bbox_to_anchor=(1.02, 1.0))
    figure_title(fig, f"{geometry.name}: every layout, coloured by {by}; blocks {list(moved_blocks)} moved")
    return fig
