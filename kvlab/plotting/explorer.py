"""An interactive layout explorer for JupyterLab (ipywidgets), with a static fallback.

Pick a model, two layouts, a block size and a token count: the memory map of a miniature
of the model and the transfer cost of the real model update in place. Headless
(``interactive=False``), the same view is drawn once into the cell's output.
"""

from __future__ import annotations

import html
import io
from typing import Any, Sequence

import matplotlib.pyplot as plt

from kvlab.cache.geometry import PRESETS, preset
from kvlab.cache.layouts import compatible_layouts, get_layout
from kvlab.cache.segments import scattered_block_ids, transfer_cost
from kvlab.plotting.atlas import memory_map, miniature
from kvlab.plotting.common import human_bytes


def cost_lines(model: str, layouts: Sequence[str], block_size: int, tokens: int) -> list[str]:
    """One line per layout: the bytes and segments of moving ``tokens`` tokens."""
    geometry = preset(model, block_size=block_size)
    lines = []
    for name in layouts:
        cost = transfer_cost(name, geometry, tokens)
        sizes = ", ".join(f"{n} x {human_bytes(int(s))}" for s, n in cost["segment_sizes"].items())
        lines.append(f"{name:>28}: {human_bytes(cost['bytes_moved'])} in {cost['segments']} segments ({sizes})")
    return lines


def layouts_figure(model: str, layouts: Sequence[str], block_size: int) -> plt.Figure:
    """Memory maps of the layouts for a miniature of the model."""
    small = miniature(preset(model, block_size=block_size))
    return memory_map([get_layout(n) for n in layouts], small, num_blocks=6, moved_blocks=scattered_block_ids(2, 6, 0))


def explore(
    model: str = "llama-3.1-8b",
    layouts: Sequence[str] = ("LBHNC", "BLHNC"),
    block_size: int = 16,
    tokens: int = 256,
    interactive: bool = True,
) -> Any:
    """The explorer widget; with ``interactive=False`` draw the same view once and return None."""
    if not interactive:
        from IPython.display import display

        print("\n".join(cost_lines(model, layouts, block_size, tokens)))
        fig = layouts_figure(model, layouts, block_size)
        display(fig)
        plt.close(fig)
        return None
    import ipywidgets as widgets

    model_w = widgets.Dropdown(options=sorted(PRESETS), value=model, description="model")
    first = widgets.Dropdown(options=compatible_layouts(preset(model), chunk_formats=False), value=layouts[0], description="layout A")
    second = widgets.Dropdown(options=compatible_layouts(preset(model), chunk_formats=False), value=layouts[1], description="layout B")
    block_w = widgets.Dropdown(options=[16, 32, 64, 128, 256], value=block_size, description="block size")
    tokens_w = widgets.SelectionSlider(
        options=[2**k for k in range(4, 15)], value=tokens, description="tokens", continuous_update=False
    )
    # The numbers and the map are widget values, replaced in place on every change.
    numbers = widgets.HTML()
    picture = widgets.Image(format="png")
    controls = {"model": model_w, "layout-a": first, "layout-b": second, "block-size": block_w, "tokens": tokens_w,
                "numbers": numbers, "map": picture}
    for role, widget in controls.items():
        widget.add_class(f"kvlab-explorer-{role}")  # CSS handles for the browser test (tests/runtime/test_lab.py)

    updating = False  # set while the model change swaps the layout lists: draw once, after

    def redraw(*_: Any) -> None:
        if updating:
            return
        chosen = [first.value, second.value]
        try:
            lines = cost_lines(model_w.value, chosen, block_w.value, tokens_w.value)
            fig = layouts_figure(model_w.value, chosen, block_w.value)
        except ValueError as exc:
            numbers.value = f"<pre>error: {html.escape(str(exc))}</pre>"
            return
        numbers.value = "<pre>" + html.escape("\n".join(lines)) + "</pre>"
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
        plt.close(fig)
        picture.value = buffer.getvalue()

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
    return widgets.VBox([widgets.HBox([model_w, block_w, tokens_w]), widgets.HBox([first, second]), numbers, picture])
