"""An interactive layout explorer for JupyterLab (ipywidgets), and its first view as a
picture and a table, which saved, exported and headless copies of a notebook keep (they
drop live widget views, or need a network to draw them).

Pick a model, its KV format (unquantized, or a quantized one of kvlab.cache.quant), two
layouts, a block size and a token count. The same transfer is shown at
two scales: a miniature map drawn cell by cell in proportion to the real transfer (one
drawn token for every TOKEN_SCALE tokens, so the block size sets how long a drawn block is
and the token count how many blocks move, up to a readable cap), and the real transfer's
numbers, with its estimated time (kvlab.plotting.explorer_numbers). Nothing here imports
vLLM.
"""

from __future__ import annotations

import base64
import html
import io
import math
from dataclasses import dataclass
from typing import Any, Sequence

import matplotlib.colors
import matplotlib.patches
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from kvlab.cache.allocation import axis_sizes
from kvlab.cache.cells import cell_labels, cells_per_page
from kvlab.cache.fits import compatible_layouts
from kvlab.cache.geometry import PRESETS, ModelGeometry
from kvlab.cache.layouts import get_layout
from kvlab.cache.quant import KINDS
from kvlab.cache.segments import scattered_block_ids
from kvlab.plotting.atlas import draw_memory_map, miniature
from kvlab.plotting.common import LIGHT_GREY, plural, wrap
from kvlab.plotting.explorer_numbers import KV_FORMATS, kv_geometry, numbers

# The miniature: a few layers and heads, one drawn token for every TOKEN_SCALE tokens (blocks
# of 16 to 256 tokens are drawn 1 to 16 tokens long), at most MAX_DRAWN_TOKENS drawn tokens
# (the first 1,024 tokens; beyond, the map says how many more blocks it leaves out).
MAX_LAYERS, MAX_HEADS, TOKEN_SCALE, MAX_DRAWN_TOKENS = 4, 2, 16, 64
BLOCK_SIZES = (16, 32, 64, 128, 256)
TOKENS = tuple(2**k for k in range(4, 15))
# The picture, shown at DPI (100 % zoom): text at FONT points is 12.5 px, readable on a projector.
DPI, FONT = 100, 9
# It fits beside the controls in a notebook beside JupyterLab's file browser (about 970 px).
PANEL_W, PANEL_H, LEGEND_W = 2.4, 1.3, 1.55  # inches of one map, and of the legends' column
LEFT, GAP, TOP, BOTTOM = 0.4, 0.12, 1.1, 0.06  # inches: row labels, between maps, titles above
ASPECT = PANEL_H / PANEL_W
NOT_MOVED = LIGHT_GREY
ABOUT = """<div style="font-size: 12px; line-height: 1.35">
<p><b>Segment</b>: one contiguous run of memory, copied in one call; each call costs a fixed
overhead. Batched methods (memcpy, gather) copy them all in one or a few calls.</p>
<p>Per-layer layouts store a block as a run per layer, cross-layer ones as one run: the same bytes,
many times the segments. <b>Break-even</b>: the segment size from which per-layer costs under 10 % more.</p>
<p><b>Map</b>: cells in address order, row after row; coloured cells move, grey ones stay, black
lines part tensors.</p>
</div>"""


@dataclass(frozen=True)
class Scales:
    """One transfer at two scales: the ``real`` model moves ``tokens`` tokens; its miniature
    ``small`` moves the drawn token ``spans`` (block, first, end) of ``num_blocks`` blocks,
    scattered as the real ones are, the last one partly when the transfer ends inside it."""

    real: ModelGeometry
    tokens: int
    small: ModelGeometry
    spans: tuple[tuple[int, int, int], ...]
    num_blocks: int

    @classmethod
    def of(cls, model: str, block_size: int, tokens: int, kv_format: str = "unquantized") -> Scales:
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
            raise ValueError(f"tokens must be a positive integer, got {tokens!r}")
        real = kv_geometry(model, kv_format, block_size)
        small = miniature(real, MAX_LAYERS, MAX_HEADS, max(block_size // TOKEN_SCALE, 1))
        drawn = min(-(-tokens // TOKEN_SCALE), MAX_DRAWN_TOKENS)
        moved = -(-drawn // small.block_size)
        num_blocks = _cache_blocks(small, moved)
        ids = [1 + b for b in scattered_block_ids(moved, num_blocks - 2, 0)]  # none at either end
        last = drawn - (moved - 1) * small.block_size
        return cls(real, tokens, small, tuple((b, 0, small.block_size) for b in ids[:-1]) + ((ids[-1], 0, last),),
                   num_blocks)

    @property
    def real_blocks(self) -> int:
        return -(-self.tokens // self.real.block_size)

    def transfer(self) -> str:
        """'meta-llama/Llama-3.1-8B-Instruct: 256 tokens in 16 blocks of 16 tokens (scattered)'."""
        return (f"{self.real.name}: {self.tokens:,} tokens in {plural(self.real_blocks, 'block')} of "
                f"{self.real.block_size} tokens (scattered)")

    def drawn(self) -> str:
        """Which blocks the map draws: all, or the first ones and how many it leaves out; a
        last block the transfer ends inside drawn partly."""
        drawn, blocks = len(self.spans), self.real_blocks
        if blocks == 1:
            text = "its one block drawn"
        elif drawn == blocks:
            text = f"all {drawn} blocks drawn"
        else:
            text = f"the first {drawn} of {blocks:,} blocks drawn … {blocks - drawn:,} more not drawn"
        first, end = self.spans[-1][1:]
        if end - first < self.small.block_size:
            text += f", of the last only {end - first} of {self.small.block_size} drawn tokens (a partial block)"
        return text

    def scale(self) -> str:
        """How the map scales the transfer down, and what one of its cells is."""
        real, small = self.real, self.small
        heads = "one MLA latent" if real.is_mla else f"{small.num_kv_heads} of {plural(real.num_kv_heads, 'kv head')}"
        cell = "one token's MLA latent" if real.is_mla else "one head's K or V of one token"
        if real.quant is not None:
            cell = f"{plural(real.quant.unit(real.head_size), 'byte')} of one head's {real.quant.name} row of one token"
        return (f"miniature: a drawn token = {TOKEN_SCALE} tokens, {small.num_layers} of "
                f"{plural(real.num_layers, 'layer')}, {heads}; a cell = {cell} in one layer")

    def row_cells(self, layout: str) -> int:
        """Cells per map row: whole pages of a block in one layer (or an even share of one,
        for long blocks), as many as make the map about the panel's shape; every tensor
        starts a row, so the lines parting them run along rows."""
        tensors = np.bincount(cell_labels(layout, self.small, self.num_blocks)["tensor"].numpy())
        page = self.small.block_size * self.small.num_kv_heads * _parts(layout, self.small)
        if self.small.quant is not None:  # a cell is a few bytes of a row
            page = cells_per_page(layout, self.small)
        square = math.sqrt(tensors.sum() / ASPECT)
        widths = [page * 2**k for k in range(10)] + [page // 2**k for k in range(1, 8) if page % 2**k == 0]
        return min((w for w in widths if not (tensors % w).any()), key=lambda w: abs(math.log(w / square)))


def _cache_blocks(small: ModelGeometry, moved: int) -> int:
    """Blocks of the miniature's cache: room to scatter ``moved`` blocks, no two adjacent,
    rounded up to whole map rows of a power of two blocks of one layer (and pairs of rows,
    for layouts with a tensor per K/V), as many as make the map about the panel's shape."""
    page = small.block_size * small.num_kv_heads * (1 if small.is_mla else 2)  # cells of a block in a layer
    if small.quant is not None:
        page *= small.row_size // small.quant.unit(small.head_size)
    per_row = 2 ** max(0, round(math.log2(math.sqrt(small.num_layers * (2 * moved + 1) / page / ASPECT))))
    return -(-(2 * moved + 1) // (2 * per_row)) * 2 * per_row


def map_figure(model: str, layouts: Sequence[str], block_size: int, tokens: int,
               colour_by: Sequence[str] | None = None, kv_format: str = "unquantized") -> Figure:
    """The miniature's memory maps: a column per layout, a row per colouring (default by
    layer, then by K/V or MLA part where every layout splits them, else by block), moved
    cells in colour and the rest grey, each row's legend naming exactly the colours drawn.
    The maps sit at fixed places, so only what they draw changes with the controls."""
    scales = Scales.of(model, block_size, tokens, kv_format)
    colour_by = colour_by or ("layer", "part" if all(_parts(name, scales.small) == 2 for name in layouts) else "block")
    if scales.small.quant is not None:
        colour_by = (colour_by[0], "kind")
    width = LEFT + len(layouts) * (PANEL_W + GAP) + LEGEND_W
    height = TOP + len(colour_by) * (PANEL_H + GAP) + BOTTOM
    fig = Figure(figsize=(width, height), dpi=DPI, facecolor="white")  # not the inline backend's transparent
    grid = fig.add_gridspec(len(colour_by), len(layouts) + 1, width_ratios=[PANEL_W] * len(layouts) + [LEGEND_W],
                            left=LEFT / width, right=1, top=1 - TOP / height, bottom=BOTTOM / height,
                            wspace=GAP / PANEL_W, hspace=GAP / PANEL_H)
    for row, by in enumerate(colour_by):
        maps = [fig.add_subplot(grid[row, column]) for column in range(len(layouts))]
        for ax, name in zip(maps, layouts):
            drawn = draw_memory_map(ax, name, scales.small, scales.num_blocks, by, width=scales.row_cells(name),
                                    spans=scales.spans, rest=NOT_MOVED)
            # the miniature's own count, named as such: the real transfer's is in the table beside it
            counted = f"\n{plural(drawn, 'segment')} drawn in miniature" if drawn else ""
            ax.set_title(ax.get_title().split("\n")[0] + counted if row == 0 else "", fontsize=FONT)
        maps[0].set_ylabel(_row_label(by, scales.small), fontsize=FONT)
        key = fig.add_subplot(grid[row, -1])
        key.axis("off")
        handles = legend_handles(maps, layouts, scales, by)
        key.legend(handles=handles, loc="center left", fontsize=FONT, frameon=False, borderaxespad=0.3,
                   ncols=-(-len(handles) // 8), handlelength=1.2, columnspacing=0.8, labelspacing=0.25)
    fig.suptitle(wrap(f"{scales.transfer()}; {scales.drawn()}\n{scales.scale()}", width, FONT),
                 fontsize=FONT, y=1 - 0.05 / height, va="top")
    return fig


def _parts(layout: str, geometry: ModelGeometry) -> int:
    """Vectors a token has per head and layer: K and V, or an MLA latent and its rope (2), or one."""
    return axis_sizes(get_layout(layout), geometry, 1)["S"]


def _row_label(by: str, small: ModelGeometry) -> str:
    if by == "part":
        return "by MLA part" if small.is_mla else "by K/V"
    return f"by {'drawn token' if by == 'token' else 'byte kind' if by == 'kind' else by}"


def legend_handles(maps: Sequence[Any], layouts: Sequence[str], scales: Scales, by: str) -> list[Any]:
    """One entry per colour the row's maps draw, naming the moved cells' values of ``by``
    that share it, and one for the cells that stay: read back from the drawn images."""
    values: dict[tuple[float, ...], set[int]] = {}
    for ax, name in zip(maps, layouts):
        labels = cell_labels(name, scales.small, scales.num_blocks)[by].numpy()
        cells = np.asarray(ax.images[0].get_array()).reshape(-1, 3)[: len(labels)]
        for colour, value in zip(map(tuple, cells.round(6)), labels):
            values.setdefault(colour, set()).add(int(value))
    grey = tuple(np.round(matplotlib.colors.to_rgb(NOT_MOVED), 6))
    named = sorted((min(v), colour, _value_label(by, sorted(v), scales, layouts))
                   for colour, v in values.items() if colour != grey)
    handles = [matplotlib.patches.Patch(color=colour, label=label) for _, colour, label in named]
    return handles + ([matplotlib.patches.Patch(color=grey, label="not moved")] if grey in values else [])


def _value_label(by: str, values: list[int], scales: Scales, layouts: Sequence[str]) -> str:
    """'layer 0', 'blocks 3, 10, …', 'K', 'tokens 32-47' (a drawn token is TOKEN_SCALE tokens)."""
    if by == "part":
        packed = scales.small.is_mla and all(_parts(name, scales.small) == 1 for name in layouts)
        return "latent + rope" if packed else scales.small.part_names[values[0]]
    if by == "token":
        return ", ".join(f"tokens {v * TOKEN_SCALE}-{(v + 1) * TOKEN_SCALE - 1}" for v in values)
    if by == "kind":
        return ", ".join(KINDS[v] for v in values)
    shown = ", ".join(map(str, values[:2])) + (", …" if len(values) > 2 else "")
    return f"{by}{'s' * (len(values) > 1)} {shown}"


def map_png(model: str, layouts: Sequence[str], block_size: int, tokens: int, kv_format: str = "unquantized") -> bytes:
    """The map as PNG at the figure's own resolution (100 % zoom: text at its stated size)."""
    buffer = io.BytesIO()
    map_figure(model, layouts, block_size, tokens, kv_format=kv_format).savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def notes_html(notes: Sequence[str]) -> str:
    """The notes as paragraphs, in the notebook's normal font."""
    return "".join(f"<p style='margin: 2px 0'>{html.escape(note)}</p>" for note in notes)


def numbers_html(notes: Sequence[str], table: pd.DataFrame) -> str:
    """The widget's numbers: the notes and the table, lines as close as text's (a widget's
    HTML keeps them a control's height apart), table cells unbroken and headers wrapped."""
    style = ".kvlab-explorer-numbers td {white-space: nowrap} .kvlab-explorer-numbers :is(td, th) {padding: 1px 8px}"
    return (f"<style>{style}</style><div style='line-height: 1.4; font-size: 13px'>{notes_html(notes)}"
            f"{table.to_html(index=False, border=0)}</div>")


def _options(model: str, kv_format: str) -> list[str]:
    """The paged layouts that hold ``model``'s KV in ``kv_format``."""
    return compatible_layouts(kv_geometry(model, kv_format), chunk_formats=False)


def explorer_widget(model: str = "llama-3.1-8b", layouts: Sequence[str] = ("LBHNC", "BLHNC"), block_size: int = 16,
                    tokens: int = 256, kv_format: str = "unquantized") -> Any:
    """The live explorer: controls in a column beside the map, the numbers below both."""
    import ipywidgets as widgets

    options = _options(model, kv_format)
    narrow = {"style": {"description_width": "70px"}, "layout": widgets.Layout(width="250px")}
    model_w = widgets.Dropdown(options=sorted(PRESETS), value=model, description="model", **narrow)
    format_w = widgets.Dropdown(options=KV_FORMATS, value=kv_format, description="KV format", **narrow)
    first = widgets.Dropdown(options=options, value=layouts[0], description="layout A", **narrow)
    second = widgets.Dropdown(options=options, value=layouts[1], description="layout B", **narrow)
    block_w = widgets.Dropdown(options=BLOCK_SIZES, value=block_size, description="block size", **narrow)
    tokens_w = widgets.SelectionSlider(options=TOKENS, value=tokens, description="tokens", continuous_update=False,
                                       **narrow)
    # The numbers and the map are widget values, replaced in place on every change.
    numbers_w = widgets.HTML()
    picture = widgets.Image(format="png")
    controls = {"model": model_w, "kv-format": format_w, "layout-a": first, "layout-b": second,
                "block-size": block_w, "tokens": tokens_w, "numbers": numbers_w, "map": picture}
    for role, widget in controls.items():
        widget.add_class(f"kvlab-explorer-{role}")  # CSS handles for the tests (tests/runtime/test_lab.py)

    updating = False  # set while the model change swaps the layout lists: draw once, after

    def redraw(*_: Any) -> None:
        if updating:
            return
        chosen = [first.value, second.value]
        try:
            notes, table = numbers(model_w.value, chosen, block_w.value, tokens_w.value, kv_format=format_w.value)
            png = map_png(model_w.value, chosen, block_w.value, tokens_w.value, format_w.value)
        except ValueError as exc:
            numbers_w.value = f"<p>error: {html.escape(str(exc))}</p>"
            return
        numbers_w.value = numbers_html(notes, table)
        picture.value = png

    def on_model(change: dict) -> None:
        nonlocal updating
        try:
            options = _options(model_w.value, format_w.value)
        except ValueError as exc:  # a head size the format cannot pack
            numbers_w.value = f"<p>error: {html.escape(str(exc))}</p>"
            return
        cross = next((name for name in options if get_layout(name).is_cross_layer), options[-1])
        updating = True
        for dropdown, fallback in ((first, options[0]), (second, cross)):
            keep = dropdown.value if dropdown.value in options else fallback
            dropdown.options = options
            dropdown.value = keep
        updating = False
        redraw()

    model_w.observe(on_model, names="value")
    format_w.observe(on_model, names="value")
    for widget in (first, second, block_w, tokens_w):
        widget.observe(redraw, names="value")
    redraw()
    column = widgets.VBox([model_w, format_w, first, second, block_w, tokens_w, widgets.HTML(ABOUT)],
                          layout=widgets.Layout(width="260px", min_width="260px"))
    return widgets.VBox([widgets.HBox([column, picture]), numbers_w])


def explore(model: str = "llama-3.1-8b", layouts: Sequence[str] = ("LBHNC", "BLHNC"), block_size: int = 16,
            tokens: int = 256, interactive: bool = True, kv_format: str = "unquantized") -> None:
    """The live explorer (``interactive``; its first view as a plain picture for copies
    saved without widget state), then that view as a picture, notes and a table: what saved,
    exported and headless (``interactive=False``) copies of the notebook keep."""
    from IPython.display import HTML, Image, display

    picture = map_png(model, layouts, block_size, tokens, kv_format)
    notes, table = numbers(model, layouts, block_size, tokens, kv_format=kv_format)
    if interactive:
        bundle = explorer_widget(model, layouts, block_size, tokens, kv_format)._repr_mimebundle_()
        display({**bundle, "image/png": base64.b64encode(picture).decode()}, raw=True)
        display(HTML("<p>The explorer's first view, kept by saved and exported copies of this notebook:</p>"))
    kv = "" if kv_format == "unquantized" else f" in {kv_format}"
    display(Image(picture, alt=f"memory maps of {' and '.join(layouts)} moving {tokens} tokens of {model}{kv}, "
                               f"block size {block_size}"))
    display(HTML(notes_html(notes)))
    display(table.set_index("layout"))
