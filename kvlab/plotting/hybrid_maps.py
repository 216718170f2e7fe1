"""Notebook 01's maps of a hybrid model's buffer: every KV cache group laid over the same
bytes, each block holding the pages of the group that owns it (kvlab.cache.hybrid)."""

from __future__ import annotations

from typing import Sequence

import matplotlib.colors
import matplotlib.patches
import matplotlib.pyplot as plt
import numpy as np

from kvlab.cache.hybrid import HybridGeometry, allocate_hybrid, group_segments, hybrid_cells
from kvlab.cache.quant import KINDS
from kvlab.plotting.atlas import KEY_STYLE, KIND_COLOURS
from kvlab.plotting.common import CYCLE, DEFAULT_WIDTH, SMALL, WIDTHS, figure_width, paper_figure, plural, wrap
from kvlab.plotting.common import title as figure_title

HYBRID_COLOUR_BY = ("group", "layer", "kind")
_UNUSED = np.array(matplotlib.colors.to_rgb("white"))


def _cell_colours(cells: dict[str, np.ndarray], by: str) -> np.ndarray:
    values = cells[by]
    if by == "kind":
        return KIND_COLOURS[values]
    palette = np.array([matplotlib.colors.to_rgb(c) for c in CYCLE])
    return np.where((values >= 0)[:, None], palette[values % len(palette)], _UNUSED)


def _key(hybrid: HybridGeometry, by: str, cells: dict[str, np.ndarray]) -> list:
    """One entry per colour the row draws."""
    values = sorted({int(v) for v in cells[by] if v >= 0})
    if by == "kind":
        names = [*KINDS, "unused"]
        return [matplotlib.patches.Patch(facecolor=KIND_COLOURS[v], edgecolor="0.6", lw=0.5, label=names[v])
                for v in values]
    palette = [CYCLE[v % len(CYCLE)] for v in values]
    names = [hybrid.groups[v].kind.replace("_", " ") if by == "group" else f"layer {v}" for v in values]
    return [matplotlib.patches.Patch(color=c, label=n) for c, n in zip(palette, names)]


def _moved_text(moved: tuple[int, Sequence[int]] | None) -> str:
    if moved is None:
        return ""
    blocks = ", ".join(map(str, moved[1]))
    return (f"; group {moved[0]}'s blocks {blocks} moved (solid), the rest faded: under each layout's name, the "
            f"segments that move them")


@paper_figure
def hybrid_map(hybrid: HybridGeometry, layouts: Sequence[str], owners: Sequence[int], unit: int,
               moved: tuple[int, Sequence[int]] | None = None, colour_by: Sequence[str] = HYBRID_COLOUR_BY,
               width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """The buffer in each layout (columns), coloured by group, layer and byte kind (rows), one
    cell of ``unit`` bytes, rows of one block; block b holds group ``owners[b]``'s pages.
    ``moved`` (group, blocks): the segments that moving those blocks of that group touches,
    under each layout's name."""
    inches = figure_width(width)
    caches = [allocate_hybrid(hybrid, layout, len(owners), "meta") for layout in layouts]
    cells = [{k: v.numpy() for k, v in hybrid_cells(cache, owners, unit).items()} for cache in caches]
    fig, axes = plt.subplots(len(colour_by), len(layouts), squeeze=False, layout="constrained",
                             figsize=(inches, (1.2 if inches >= WIDTHS["double"] else 1.8) * len(colour_by) + 1.0))
    for col, (cache, cell) in enumerate(zip(caches, cells)):
        row_cells = cache.placements[0].block_stride // unit
        for row, by in enumerate(colour_by):
            ax = axes[row, col]
            ax.imshow(_cell_colours(cell, by).reshape(-1, row_cells, 3), aspect="auto", interpolation="nearest")
            if moved is not None:  # the moved blocks solid, the rest under a white veil, as in the atlas's maps
                veil = np.zeros((len(cell["block"]), 4))
                veil[~np.isin(cell["block"], list(moved[1]))] = (1.0, 1.0, 1.0, 0.75)
                ax.imshow(veil.reshape(-1, row_cells, 4), aspect="auto", interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
        title = cache.layout
        if moved is not None:
            count = group_segments(cache, moved[0], moved[1]).count
            title += f"\n{plural(count, 'segment') if inches >= WIDTHS['double'] else f'{count} seg.'}"
        axes[0, col].set_title(title, fontsize=SMALL)
    for row, by in enumerate(colour_by):  # each row's key, titled with what its colours tell
        key = _key(hybrid, by, cells[0])
        title = f"by {'byte kind' if by == 'kind' else by}"
        if inches >= WIDTHS["double"]:
            axes[row, -1].legend(handles=key, title=title, loc="center left", bbox_to_anchor=(1.0, 0.5), **KEY_STYLE)
        else:  # a narrow figure keeps its width for the maps: the key under them
            axes[row, 0].legend(handles=key, title=title, loc="upper left", bbox_to_anchor=(0.0, -0.02),
                                ncols=min(len(key), 4), **KEY_STYLE)
    figure_title(fig, f"{hybrid.name}: {plural(len(hybrid.groups), 'KV cache group')} over one buffer of "
                      f"{plural(len(owners), 'block')}")
    groups = "; ".join(f"group {i}: {group.describe()}" for i, group in enumerate(hybrid.groups))
    owned = ", ".join(f"block {b}: group {g}" for b, g in enumerate(owners))
    fig.supxlabel(wrap(f"{groups}. One cell = {plural(unit, 'byte')}, in address order, left to right, then down (a "
                       f"row: one page in a layer-outer layout, one block in a block-outer one). Which group owns a "
                       f"block is the scheduler's choice ({owned}); white: bytes of a block its owner leaves unused"
                       f"{_moved_text(moved)}.", inches, SMALL),
                  fontsize=SMALL, color="0.25")
    return fig
