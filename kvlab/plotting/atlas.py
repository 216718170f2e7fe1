"""Figures of notebook 01's maps: the memory map of a small cache and the atlas page (the
segment counts' figures are in kvlab.plotting.segment_figures). Drawn from kvlab's layouts,
never from a notebook's private state, so every one can be regenerated with the same call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import matplotlib
import matplotlib.colors
import matplotlib.legend_handler
import matplotlib.patches
import matplotlib.pyplot as plt
import numpy as np

from kvlab.cache.allocation import axis_sizes
from kvlab.cache.cells import cell_labels, cells_per_page
from kvlab.cache.geometry import ModelGeometry
from kvlab.cache.layouts import Layout, get_layout
from kvlab.cache.quant import KINDS
from kvlab.cache.segments import span_segments
from kvlab.plotting.common import (BLUE, DEFAULT_WIDTH, GREEN, LIGHT_GREY, MEDIUM, ORANGE, PURPLE, SKY_BLUE, SMALL,
                                   VERMILLION, WIDTHS, YELLOW, figure_width, footnote, model_name, paper_figure, plural,
                                   text_inches, wrap)
from kvlab.plotting.common import title as figure_title

COLOUR_BY = ("layer", "block", "part", "token")
QUANT_COLOUR_BY = COLOUR_BY + ("kind",)  # a quantized cache's maps may show its bytes by kind
# Okabe-Ito's colours but black (it parts tensors: the lines across a map), sky blue last: faded
# beside blue it is hard to tell apart (FADED), and six blocks or layers need only the first six
_OKABE_ITO = matplotlib.colors.ListedColormap([BLUE, ORANGE, GREEN, VERMILLION, PURPLE, YELLOW, SKY_BLUE],
                                              name="okabe_ito")
FADED = 0.6  # the share of white in a colour drawn faded (what did not move)
_CMAPS = {"layer": _OKABE_ITO, "block": _OKABE_ITO, "part": None, "token": "viridis"}
_PART_COLOURS = np.array([matplotlib.colors.to_rgb(BLUE), matplotlib.colors.to_rgb(ORANGE)])
KIND_COLOURS = np.array([matplotlib.colors.to_rgb(c) for c in (BLUE, ORANGE, LIGHT_GREY, "white")])  # payload, scale,
# padding, and (hybrid maps) bytes a block's owner leaves unused
MAX_HEIGHT = 6.0  # inches of a double-column figure: with its caption, it fits a page
KEY_ROW = 0.15  # inches per entry of a colour key (SMALL type, tight spacing)


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
    if by == "kind":
        return KIND_COLOURS[values]
    if by == "part":
        return _PART_COLOURS[values % 2]
    cmap = plt.get_cmap(_CMAPS[by])
    scale = values / max(count - 1, 1) if by == "token" else values % cmap.N
    return np.asarray(cmap(scale if by == "token" else scale.astype(int)))[:, :3]


def _faded(rgb: np.ndarray) -> np.ndarray:
    return (1 - FADED) * rgb + FADED


def _counts(geometry: ModelGeometry, num_blocks: int) -> dict[str, int]:
    return {"layer": geometry.num_layers, "block": num_blocks, "part": 2, "token": geometry.block_size, "kind": 3}


# --- colour keys: one entry per colour a row of maps draws ---------------------------------


class _Strip(matplotlib.patches.Patch):
    """A key entry for a colour scale: its colours side by side, dark to light."""

    def __init__(self, colours: np.ndarray, label: str):
        super().__init__(color=colours[0], label=label)
        self.colours = colours


class _StripHandler(matplotlib.legend_handler.HandlerBase):
    def create_artists(self, legend, orig_handle, xdescent, ydescent, width, height, fontsize, trans):
        n = len(orig_handle.colours)
        return [matplotlib.patches.Rectangle((-xdescent + width * i / n, -ydescent), width / n, height,
                                             facecolor=colour, edgecolor="none", transform=trans)
                for i, colour in enumerate(orig_handle.colours)]


_HANDLERS = {_Strip: _StripHandler()}


def _packed(layout: Layout, geometry: ModelGeometry) -> bool:
    """An MLA layout keeping the latent and its rope in one vector (no part axis)."""
    return geometry.is_mla and axis_sizes(layout, geometry, 1)["S"] == 1


def _key_title(by: str, geometry: ModelGeometry) -> str:
    return {"part": "MLA part" if geometry.is_mla else "K/V", "kind": "byte kind"}.get(by, by)


def _values_text(by: str, values: Sequence[int]) -> str:
    """'layer 3', 'blocks 0, 7', 'layers 0, 7, …' (the values one colour stands for)."""
    shown = ", ".join(map(str, values)) if len(values) <= 2 else f"{values[0]}, {values[1]}, …"
    return f"{by}{'s' * (len(values) > 1)} {shown}"


def _key(by: str, geometry: ModelGeometry, num_blocks: int, layouts: Sequence[Layout],
         moved_blocks: Sequence[int] = ()) -> list:
    """Key entries naming exactly the colours ``layouts``' maps draw coloured by ``by``: one per
    value while each has its own colour, one per colour naming the values that share it when
    the palette repeats (more than 7 layers or blocks), a dark-to-light strip for more than
    8 tokens; a block that did not move (where some did) in the faded colour it is drawn in."""
    values = sorted({int(v) for layout in layouts for v in cell_labels(layout, geometry, num_blocks)[by].numpy()})
    colours = _colours(np.array(values), by, _counts(geometry, num_blocks)[by])
    if by == "kind":
        return [matplotlib.patches.Patch(color=c, label=KINDS[v]) for v, c in zip(values, colours)]
    if by == "block" and moved_blocks:
        still = ~np.isin(values, list(moved_blocks))
        colours[still] = _faded(colours[still])
    if by == "part":
        names = list(geometry.part_names)
        packed = [_packed(layout, geometry) for layout in layouts]
        if all(packed):
            names[0] = " + ".join(geometry.part_names)
        elif any(packed):
            names[0] = f"{names[0]} (+ {names[1]} where packed)"
        return [matplotlib.patches.Patch(color=c, label=names[v]) for v, c in zip(values, colours)]
    if by == "token" and len(values) > 8:
        return [_Strip(colours, f"tokens {values[0]}–{values[-1]}, dark to light")]
    shared: dict[tuple, list[int]] = {}
    for value, colour in zip(values, colours):
        shared.setdefault(tuple(colour), []).append(value)
    return [matplotlib.patches.Patch(color=colour, label=_values_text(by, v)) for colour, v in shared.items()]


def _row_label(by: str, geometry: ModelGeometry) -> str:
    return f"by {_key_title(by, geometry)}"


# --- text that fits ---------------------------------------------------------------------------



def _name(name: str, inches: float) -> str:
    """A layout's name on one line where it fits ``inches``, else broken after the "_" that
    leaves the narrower lines."""
    parts = name.split("_")
    if text_inches(name) <= inches or len(parts) == 1:
        return name
    return min(("_".join(parts[:i]) + "_\n" + "_".join(parts[i:]) for i in range(1, len(parts))), key=text_inches)


def _segments_texts(counts: Sequence[int | None], blocks: int, inches: float) -> list[str | None]:
    """The segments moving ``blocks`` blocks in each map, in the longest wording in which every
    count fits ``inches`` (None where nothing moves)."""
    wordings = (lambda n: f"{plural(n, 'segment')} for {plural(blocks, 'block')}", lambda n: plural(n, "segment"),
                lambda n: f"{n:,} seg.")
    shown = [n for n in counts if n is not None]
    words = next((w for w in wordings if all(text_inches(w(n)) <= inches for n in shown)), wordings[-1])
    return [None if n is None else words(n) for n in counts]


def _axes_inches(fig: plt.Figure, ax: plt.Axes) -> float:
    return ax.get_position().width * fig.get_figwidth()


def _listing(values: Sequence[int]) -> str:
    values = [str(v) for v in values]
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} and {values[-1]}"


def _model(geometry: ModelGeometry) -> str:
    """'Llama-3.1-8B-Instruct (miniature)' for 'meta-llama/Llama-3.1-8B-Instruct (miniature)'."""
    suffix = " (miniature)"
    plain = geometry.name.removesuffix(suffix)
    return model_name(plain) + (suffix if plain != geometry.name else "")


def _how_to_read(num_blocks: int, moved_blocks: Sequence[int], widths: Sequence[int],
                 geometry: ModelGeometry | None = None) -> str:
    """The footnote under a page of maps: how to read one (what a cell is, what a row holds:
    the maps of ``widths`` cells a row), and what moved."""
    moved = sorted(set(moved_blocks))
    if not moved:
        what = "Nothing moved"
    elif len(moved) == num_blocks:
        what = f"All {plural(num_blocks, 'block')} moved"
    else:
        what = f"Block{'s' * (len(moved) > 1)} {_listing(moved)} moved (solid), the rest faded"
    row = " or ".join(map(str, sorted(set(widths))))
    quant = geometry.quant if geometry is not None else None
    cell = ("one head vector" if quant is None else
            f"{plural(quant.unit(geometry.head_size), 'byte')} of a {quant.name} row")
    return (f"One cell = {cell}, in address order: left to right, then down, {row} to a row (as many as "
            f"one layer holds of one block). {what}; black lines part tensors.")


# --- the maps ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MapPicture:
    """A memory map as drawn: its cells' colours (rows of ``width`` cells), the rows where a
    tensor starts, and the segments moving what moved (None when nothing moves)."""
    image: np.ndarray
    tensor_starts: tuple[float, ...]
    segments: int | None
    blocks: int

    def same_as(self, other: MapPicture) -> bool:
        return (self.image.shape == other.image.shape and np.array_equal(self.image, other.image)
                and (self.tensor_starts, self.segments) == (other.tensor_starts, other.segments))


def map_picture(layout: str | Layout, geometry: ModelGeometry, num_blocks: int, by: str = "layer",
                moved_blocks: Sequence[int] = (), width: int | None = None,
                spans: Sequence[tuple[int, int, int]] = (), rest: str | None = None) -> MapPicture:
    """The cache's address space, one cell per head vector, coloured by ``by``.

    Rows wrap every ``width`` cells (default: as many as one layer holds of one block). Blocks
    in ``moved_blocks`` and the tokens of ``spans`` (block, first, end: part of a block, as
    span_segments takes them) are solid, the rest faded, or in the colour ``rest``.
    """
    layout = get_layout(layout)
    if by not in QUANT_COLOUR_BY:
        raise ValueError(f"colour by one of {QUANT_COLOUR_BY}, not {by!r}")
    labels = {k: v.numpy() for k, v in cell_labels(layout, geometry, num_blocks).items()}
    rgb = _colours(labels[by], by, _counts(geometry, num_blocks)[by])
    moved = [(block, 0, geometry.block_size) for block in moved_blocks] + list(spans)
    if moved:
        still = np.ones(len(rgb), dtype=bool)
        for block, first, end in moved:
            still &= ~((labels["block"] == block) & (labels["token"] >= first) & (labels["token"] < end))
        rgb[still] = matplotlib.colors.to_rgb(rest) if rest else _faded(rgb[still])
    if geometry.quant is not None:  # a cell is a few bytes of a row: a page is many more cells
        width = width or cells_per_page(layout, geometry)
    width = width or geometry.block_size * geometry.num_kv_heads * axis_sizes(layout, geometry, num_blocks)["S"]
    rows = -(-len(rgb) // width)
    image = np.ones((rows * width, 3))
    image[: len(rgb)] = rgb
    starts = tuple(float(start / width - 0.5) for start in np.flatnonzero(np.diff(labels["tensor"])) + 1)
    segments = span_segments(layout, geometry, num_blocks, moved).count if moved else None
    return MapPicture(image.reshape(rows, width, 3), starts, segments, len({b for b, _, _ in moved}))


def _show(ax: plt.Axes, picture: MapPicture) -> None:
    ax.imshow(picture.image, aspect="auto", interpolation="nearest")
    for start in picture.tensor_starts:
        ax.axhline(start, color="black", lw=0.8)
    ax.set_xticks([])
    ax.set_yticks([])


def draw_memory_map(
    ax: plt.Axes,
    layout: str | Layout,
    geometry: ModelGeometry,
    num_blocks: int,
    by: str = "layer",
    moved_blocks: Sequence[int] = (),
    width: int | None = None,
    spans: Sequence[tuple[int, int, int]] = (),
    rest: str | None = None,
) -> int | None:
    """Draw :func:`map_picture`'s map on ``ax``, titled with the layout's name and the
    segments moving what moved, which is returned (None when nothing moves)."""
    layout = get_layout(layout)
    picture = map_picture(layout, geometry, num_blocks, by, moved_blocks, width, spans, rest)
    _show(ax, picture)
    title = layout.name
    if picture.segments is not None:
        title += f"\n{plural(picture.segments, 'segment')} for {plural(picture.blocks, 'block')}"
    ax.set_title(title, fontsize=MEDIUM)
    return picture.segments


def _key_columns(entries: int, inches: float) -> int:
    """Columns for a key of ``entries`` entries to stay within ``inches`` of height."""
    return -(-entries // max(int(inches // KEY_ROW), 1))


KEY_STYLE = dict(handlelength=1.2, handleheight=1.0, handletextpad=0.4, columnspacing=0.8, labelspacing=0.3,
                 borderaxespad=0.3, handler_map=_HANDLERS)


@paper_figure
def memory_map(
    layouts: Sequence[str | Layout],
    geometry: ModelGeometry,
    num_blocks: int = 6,
    moved_blocks: Sequence[int] = (1, 4),
    colour_by: Sequence[str] = COLOUR_BY,
    width: str | float = DEFAULT_WIDTH,
) -> plt.Figure:
    """Layouts side by side (columns), coloured by layer, block, K/V and token (rows), each
    row's colour key right of it; the moved blocks' segments under each layout's name, how
    to read a map in a footnote."""
    layouts = [get_layout(layout) for layout in layouts]
    for by in colour_by:
        if by not in QUANT_COLOUR_BY:
            raise ValueError(f"colour by one of {QUANT_COLOUR_BY}, not {by!r}")
    inches = figure_width(width)
    keys = [_key(by, geometry, num_blocks, layouts, moved_blocks) for by in colour_by]
    # a map about as tall as wide and as its key's column, within a page at double width
    panel = (inches - 0.3 - 0.7) / len(layouts)
    fixed = 1.2 if inches >= WIDTHS["double"] else 1.6  # the titles, the footnote and the space between rows
    height = min(max(0.8 * panel, 0.8, KEY_ROW * max(map(len, keys)) + 0.05), 1.3)
    if inches >= WIDTHS["double"]:
        height = min(height, (MAX_HEIGHT - fixed) / len(colour_by) - 0.08)
    fig, axes = plt.subplots(len(colour_by), len(layouts), figsize=(inches, (height + 0.08) * len(colour_by) + fixed),
                             squeeze=False, layout="constrained")
    segments, widths = [], set()
    for row, by in enumerate(colour_by):
        for col, layout in enumerate(layouts):
            picture = map_picture(layout, geometry, num_blocks, by, moved_blocks)
            _show(axes[row, col], picture)
            widths.add(picture.image.shape[1])
            if row == 0:
                segments.append(picture.segments)
        axes[row, 0].set_ylabel(_row_label(by, geometry))
        axes[row, -1].legend(handles=keys[row], loc="center left",
                             bbox_to_anchor=(1.0, 0.5), ncols=_key_columns(len(keys[row]), height), **KEY_STYLE)
    heads = "one MLA latent" if geometry.is_mla else plural(geometry.num_kv_heads, "kv head")
    if geometry.quant is not None:
        heads += f" of {geometry.head_size} in {geometry.quant.name}"
    figure_title(fig, f"{_model(geometry)}: {plural(geometry.num_layers, 'layer')}, {heads}, "
                      f"{plural(num_blocks, 'block')} of {plural(geometry.block_size, 'token')}")
    footnote(fig, _how_to_read(num_blocks, moved_blocks, sorted(widths), geometry))
    fig.get_layout_engine().execute(fig)  # the maps' widths, for titles that fit them
    fits = min(_axes_inches(fig, ax) for ax in axes[0]) + 0.04
    for ax, layout, counted in zip(axes[0], layouts, _segments_texts(segments, len(set(moved_blocks)), fits)):
        ax.set_title(_name(layout.name, fits) + (f"\n{counted}" if counted else ""), fontsize=SMALL)
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
    """Every layout on one page, coloured by one property: a grid of maps (``columns`` a row,
    default as many as leave each map 1.5 inches), layouts drawing the same map sharing one,
    named under it; over each, the segments moving the moved blocks; one colour key, and how
    to read a map in a footnote."""
    layouts = [get_layout(layout) for layout in layouts]
    pictures: list[tuple[MapPicture, list[str]]] = []
    for layout in layouts:
        picture = map_picture(layout, geometry, num_blocks, by, moved_blocks)
        same = next((names for drawn, names in pictures if drawn.same_as(picture)), None)
        if same is None:
            pictures.append((picture, [layout.name]))
        else:
            same.append(layout.name)
    inches = figure_width(width)
    columns = min(columns or max(1, int(inches // 1.5)), len(pictures))
    rows = -(-len(pictures) // columns)
    panel = inches / columns
    names = [wrap(", ".join(group), panel - 0.1, SMALL) for _, group in pictures]
    lines = [max((names[i].count("\n") + 1 for i in range(row * columns, min((row + 1) * columns, len(names)))))
             for row in range(rows)]
    fixed = 0.75 if inches >= WIDTHS["double"] else 1.1  # the figure's title and footnote
    height = min(max(0.5 * panel, 0.55), 0.85)
    fig, axes = plt.subplots(rows, columns, figsize=(inches, sum(height + 0.35 + 0.12 * n for n in lines) + fixed),
                             squeeze=False, layout="constrained")
    for ax, (picture, _), name in zip(axes.flat, pictures, names):
        _show(ax, picture)
        ax.set_xlabel(name, fontsize=SMALL, labelpad=2)
    empty = list(axes.flat)[len(pictures):]
    for ax in empty:
        ax.axis("off")
    key = _key(by, geometry, num_blocks, layouts, moved_blocks)
    stacked = _key_columns(len(key), height + 0.3)
    entry = (KEY_STYLE["handlelength"] + KEY_STYLE["handletextpad"] + KEY_STYLE["columnspacing"]) * SMALL / 72
    if stacked * (entry + max(text_inches(e.get_label()) for e in key)) <= len(empty) * panel:  # the grid's empty corner
        corner = empty[0].legend(handles=key, loc="center", bbox_to_anchor=(0, 0, len(empty), 1), ncols=stacked,
                                 **KEY_STYLE)
        corner.set_in_layout(False)  # it lies over the empty maps' places, leaving the grid as it is
    else:  # right of the grid, clear of the footnote under it
        fig.legend(handles=key, loc="outside right upper", **KEY_STYLE)
    figure_title(fig, f"{_model(geometry)}: every layout, coloured by {_key_title(by, geometry)}; layouts drawing "
                      f"the same map share it")
    footnote(fig, _how_to_read(num_blocks, moved_blocks, [p.image.shape[1] for p, _ in pictures], geometry)
             + (" Over each map: the segments that move them; under it: the layouts it draws." if moved_blocks
                else " Under each map: the layouts it draws."))
    fig.get_layout_engine().execute(fig)
    fits = min(_axes_inches(fig, ax) for ax in axes.flat) + 0.04
    counts = _segments_texts([p.segments for p, _ in pictures], len(set(moved_blocks)), fits)
    for ax, counted in zip(axes.flat, counts):
        if counted:
            ax.set_title(counted, fontsize=SMALL)
    return fig
