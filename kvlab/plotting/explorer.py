"""An interactive layout explorer for JupyterLab (ipywidgets), and a static gallery that
saved and exported notebooks keep (nbconvert drops live widget views).

Pick a model, two layouts, a block size and a token count. The same transfer is shown at
two scales: a miniature drawn cell by cell, whose heads, tokens per block and moved blocks
follow the controls up to caps that keep it readable, and the real transfer's numbers, with
its estimated time on every machine whose transfer timings are committed (the fitted cost
model of kvlab.experiments.costmodel; nothing here imports vLLM).
"""

from __future__ import annotations

import functools
import html
import io
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import matplotlib.pyplot as plt

from kvlab.cache.allocation import address_labels
from kvlab.cache.geometry import PRESETS, ModelGeometry, preset
from kvlab.cache.layouts import compatible_layouts
from kvlab.cache.segments import block_segments, scattered_block_ids, transfer_cost
from kvlab.experiments.costmodel import CostFit, fit
from kvlab.plotting.atlas import draw_memory_map, memory_map, miniature
from kvlab.plotting.common import human_bytes, plural
from kvlab.results import committed_results_dir, load_results

# The miniature follows the controls up to these caps: beyond them the map is a blur.
MAX_LAYERS, MAX_HEADS, MAX_BLOCK_TOKENS, MAX_MOVED_BLOCKS = 4, 4, 8, 6
BLOCK_SCALE = 4  # a miniature block holds a quarter of a real block's tokens (at most MAX_BLOCK_TOKENS)
ESTIMATE = ("offload", "segments")  # the timings the estimate is fitted on: one copy call per segment
BLOCK_SIZES = (16, 32, 64, 128, 256)
TOKENS = tuple(2**k for k in range(4, 15))
GALLERY = (("llama-3.1-8b", 16), ("llama-3.1-8b", 64), ("deepseek-v2-lite", 16), ("deepseek-v2-lite", 64))
GALLERY_LAYOUTS, GALLERY_TOKENS = ("LBHNC", "BLHNC"), 256
TWO_SCALES = "The same transfer at two scales: the map draws a miniature, the numbers are the real transfer."
ABOUT = """<div style="font-size: 12px; line-height: 1.35">
<p><b>Segment</b>: one contiguous run of memory, moved by one copy call (one DMA descriptor on a
device), and each costs a fixed overhead on top of its bytes.</p>
<p><b>Equal bytes, different copy counts</b>: a per-layer layout stores a block as one run per layer
(per K/V or head in some), a cross-layer layout as one run, so the same bytes can take many times
more copies, each paying the overhead.</p>
<p><b>Break-even</b>: the segment size from which a per-layer layout costs within 10 % of a
cross-layer one; below it, the fixed cost per copy is what counts.</p>
<p><b>Map</b>: one cell = one head vector, in address order: read a row left to right
(address &rarr;), then wrap to the next. Solid cells are the moved blocks; black lines part tensors.</p>
</div>"""


def _time(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale or unit == "µs":
            return f"{seconds / scale:.3g} {unit}"
    raise AssertionError


@dataclass(frozen=True)
class Scales:
    """One transfer at two scales: the ``real`` model moves ``tokens`` tokens; its miniature
    ``small`` moves blocks ``moved`` of ``num_blocks`` (scattered, as the real ones)."""

    real: ModelGeometry
    tokens: int
    small: ModelGeometry
    moved: tuple[int, ...]
    num_blocks: int

    @classmethod
    def of(cls, model: str, block_size: int, tokens: int) -> Scales:
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
            raise ValueError(f"tokens must be a positive integer, got {tokens!r}")
        real = preset(model, block_size=block_size)
        small = miniature(real, MAX_LAYERS, MAX_HEADS, min(max(block_size // BLOCK_SCALE, 1), MAX_BLOCK_TOKENS))
        moved = min(-(-tokens // block_size), MAX_MOVED_BLOCKS)
        num_blocks = 2 * moved + 2  # room to scatter them, no two adjacent, none at either end
        moved_ids = tuple(1 + b for b in scattered_block_ids(moved, num_blocks - 2, 0))
        return cls(real, tokens, small, moved_ids, num_blocks)

    @property
    def real_blocks(self) -> int:
        return -(-self.tokens // self.real.block_size)

    def describe(self) -> str:
        """'miniature: 4 of 32 layers, 2 of 8 heads, blocks of 4 of 16 tokens, 3 of 16 blocks moved'."""
        real, small = self.real, self.small
        heads = "one MLA latent" if real.is_mla else f"{small.num_kv_heads} of {plural(real.num_kv_heads, 'head')}"
        return (f"miniature: {small.num_layers} of {plural(real.num_layers, 'layer')}, {heads}, blocks of "
                f"{small.block_size} of {plural(real.block_size, 'token')}, {len(self.moved)} of "
                f"{plural(self.real_blocks, 'block')} moved")

    def segments(self, layout: str) -> int:
        """Segments of the miniature's move: what the map shows."""
        return block_segments(layout, self.small, self.num_blocks, self.moved).count


@functools.lru_cache(maxsize=None)
def measured_fits(results_dir: Path | None = None) -> tuple[CostFit, ...]:
    """The cost model of each machine with committed transfer timings (02_transfer-*.jsonl,
    default data/results), fitted once per process; none when nothing was measured."""
    files = sorted(Path(results_dir or committed_results_dir()).glob("02_transfer-*.jsonl"))
    return tuple(f for f in fit(load_results(files)) if (f.direction, f.method) == ESTIMATE)


def readout(model: str, layouts: Sequence[str], block_size: int, tokens: int,
            fits: Sequence[CostFit] | None = None) -> list[str]:
    """The explorer's numbers: the transfer at both scales, how many times fewer copies one
    layout needs, and the estimated time on each machine of ``fits`` (default: committed)."""
    if len(layouts) != 2:
        raise ValueError(f"the explorer compares two layouts, got {list(layouts)}")
    scales = Scales.of(model, block_size, tokens)
    costs = [(name, transfer_cost(name, scales.real, tokens)) for name in layouts]
    width = max(len(name) for name in layouts)
    lines = [scales.describe()]
    for name, cost in costs:
        lines.append(f"  {name:>{width}}: miniature {plural(scales.segments(name), 'segment')}; the real transfer "
                     f"{human_bytes(cost['bytes_moved'])} in {plural(cost['segments'], 'segment')} "
                     f"of {human_bytes(cost['mean_segment_bytes'])} on average")
    return lines + [fewer_copies(costs)] + estimates(costs, scales.real, measured_fits() if fits is None else fits)


def fewer_copies(costs: Sequence[tuple[str, dict]]) -> str:
    """'BLHNC needs 32x fewer copies than LBHNC for the same 32 MiB'."""
    (few, low), (many, high) = sorted(costs, key=lambda item: item[1]["segments"])
    same = f"the same {human_bytes(low['bytes_moved'])}"
    if low["segments"] == high["segments"]:
        return f"{few} and {many} need as many copies ({low['segments']:,}) for {same}"
    return f"{few} needs {high['segments'] / low['segments']:.3g}x fewer copies than {many} for {same}"


def estimates(costs: Sequence[tuple[str, dict]], geometry: ModelGeometry, fits: Sequence[CostFit]) -> list[str]:
    """Estimated time of each layout's transfer and the break-even segment size, per machine."""
    if not fits:
        return [f"estimated {ESTIMATE[0]} time: no measured results"]
    lines = [f"estimated {ESTIMATE[0]} time (fitted cost model: a fixed cost per copy + bytes / bandwidth):"]
    for f in fits:
        times = ", ".join(f"{name} {_time(f.predict(c['segments'], c['bytes_moved']))}" for name, c in costs)
        lines.append(f"  {f.hardware}, {f.per_segment_s * 1e6:.2g} µs a copy + {f.bandwidth / 1e9:.3g} GB/s: {times}")
        even = f.break_even_segment_bytes(geometry.num_layers)
        means = ", ".join(f"{name} {human_bytes(c['mean_segment_bytes'])} "
                          f"{'below' if c['mean_segment_bytes'] < even else 'above'}" for name, c in costs)
        lines.append(f"    break-even segment {human_bytes(even)}; mean: {means}")
    return lines


def map_figure(model: str, layouts: Sequence[str], block_size: int, tokens: int) -> plt.Figure:
    """The miniature's memory maps, coloured by layer and by K/V (by block when no layout
    splits an MLA latent from its rope: a one-entry colouring says nothing)."""
    scales = Scales.of(model, block_size, tokens)
    split = any(address_labels(name, scales.small, scales.num_blocks)["part"].unique().numel() > 1 for name in layouts)
    fig = memory_map(layouts, scales.small, scales.num_blocks, scales.moved,
                     colour_by=("layer", "part" if split else "block"))
    for ax, name in zip(fig.axes, layouts):
        ax.set_title(f"{name}\nminiature: {plural(scales.segments(name), 'segment')}", fontsize=9)
    fig.suptitle(f"{scales.real.name}, {textwrap.fill(scales.describe(), 60)} (solid)", fontsize=9)
    return fig


def gallery(fits: Sequence[CostFit] | None = None) -> plt.Figure:
    """The explorer's main combinations in one static figure, for saved and exported notebooks:
    per-layer against cross-layer, for Llama and an MLA model, at two block sizes."""
    fig, axes = plt.subplots(len(GALLERY), 3, figsize=(13, 2.4 * len(GALLERY)), squeeze=False, layout="constrained",
                             gridspec_kw={"width_ratios": [1, 1, 2.6]})
    for row, (model, block_size) in zip(axes, GALLERY):
        scales = Scales.of(model, block_size, GALLERY_TOKENS)
        for ax, name in zip(row, GALLERY_LAYOUTS):
            draw_memory_map(ax, name, scales.small, scales.num_blocks, "layer", scales.moved)
            ax.set_title(f"{name}: miniature {plural(scales.segments(name), 'segment')}", fontsize=8)
        row[0].set_ylabel(f"{model}\nblock size {block_size}\n(address →, wraps)", fontsize=8)
        row[2].axis("off")
        lines = readout(model, GALLERY_LAYOUTS, block_size, GALLERY_TOKENS, fits)
        row[2].text(0, 1, "\n".join(textwrap.fill(line, 112, subsequent_indent="      ") for line in lines),
                    family="monospace", fontsize=7.5, va="top", transform=row[2].transAxes)
    fig.suptitle(f"The explorer's main views: moving {GALLERY_TOKENS} tokens from scattered blocks.\n{TWO_SCALES}\n"
                 "One cell = one head vector, coloured by layer; solid = the moved blocks.", fontsize=10)
    return fig


def _png(fig: plt.Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


def explorer_widget(model: str = "llama-3.1-8b", layouts: Sequence[str] = ("LBHNC", "BLHNC"), block_size: int = 16,
                    tokens: int = 256) -> Any:
    """The live explorer: controls in a column beside the map, the numbers below."""
    import ipywidgets as widgets

    options = compatible_layouts(preset(model), chunk_formats=False)
    model_w = widgets.Dropdown(options=sorted(PRESETS), value=model, description="model")
    first = widgets.Dropdown(options=options, value=layouts[0], description="layout A")
    second = widgets.Dropdown(options=options, value=layouts[1], description="layout B")
    block_w = widgets.Dropdown(options=BLOCK_SIZES, value=block_size, description="block size")
    tokens_w = widgets.SelectionSlider(options=TOKENS, value=tokens, description="tokens", continuous_update=False)
    # The numbers and the map are widget values, replaced in place on every change.
    numbers = widgets.HTML()
    picture = widgets.Image(format="png")
    controls = {"model": model_w, "layout-a": first, "layout-b": second, "block-size": block_w, "tokens": tokens_w,
                "numbers": numbers, "map": picture}
    for role, widget in controls.items():
        widget.add_class(f"kvlab-explorer-{role}")  # CSS handles for the tests (tests/runtime/test_lab.py)

    updating = False  # set while the model change swaps the layout lists: draw once, after

    def redraw(*_: Any) -> None:
        if updating:
            return
        chosen = [first.value, second.value]
        try:
            lines = readout(model_w.value, chosen, block_w.value, tokens_w.value)
            fig = map_figure(model_w.value, chosen, block_w.value, tokens_w.value)
        except ValueError as exc:
            numbers.value = f"<pre>error: {html.escape(str(exc))}</pre>"
            return
        numbers.value = f"<b>{TWO_SCALES}</b><pre>" + html.escape("\n".join(lines)) + "</pre>"
        picture.value = _png(fig)

    def on_model(change: dict) -> None:
        nonlocal updating
        options = compatible_layouts(preset(change["new"]), chunk_formats=False)
        updating = True
        for dropdown, fallback in ((first, options[0]), (second, "BLHNC")):
            keep = dropdown.value if dropdown.value in options else fallback
            dropdown.options = options
            dropdown.value = keep
        updating = False
        redraw()

    model_w.observe(on_model, names="value")
    for widget in (first, second, block_w, tokens_w):
        widget.observe(redraw, names="value")
    redraw()
    column = widgets.VBox([model_w, first, second, block_w, tokens_w, widgets.HTML(ABOUT)],
                          layout=widgets.Layout(width="380px", min_width="380px"))
    return widgets.VBox([widgets.HBox([column, picture]), numbers])


def explore(model: str = "llama-3.1-8b", layouts: Sequence[str] = ("LBHNC", "BLHNC"), block_size: int = 16,
            tokens: int = 256, interactive: bool = True) -> None:
    """The live explorer (``interactive=False``: the same view drawn once), then the static
    gallery, which saved and exported notebooks keep when live widget views are gone."""
    from IPython.display import HTML, Image, display

    if interactive:
        display(explorer_widget(model, layouts, block_size, tokens))
    else:
        display(HTML(f"<b>{TWO_SCALES}</b><pre>"
                     + html.escape("\n".join(readout(model, layouts, block_size, tokens))) + "</pre>"))
        display(Image(_png(map_figure(model, layouts, block_size, tokens))))
    fig = gallery()
    display(fig)
    plt.close(fig)
