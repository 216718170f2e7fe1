"""An interactive layout explorer for JupyterLab (ipywidgets), with a static fallback.

Pick a model, two layouts, a block size and a token count: the memory map of a miniature
of the model and the transfer cost of the real model update in place. Headless
(``interactive=False``), the same view is drawn once into the cell's output.
"""

from __future__ import annotations

from typing import Any, Sequence

import matplotlib.pyplot as plt

from kvlab.geometry import PRESETS, preset
from kvlab.layouts import LAYOUTS, check_compatible, get_layout
from kvlab.plotting import human_bytes, memory_map, miniature
from kvlab.segments import scattered_block_ids, transfer_cost


def compatible_layouts(model: str) -> list[str]:
    geometry = preset(model)
    names = []
    for name, layout in LAYOUTS.items():
        try:
            check_compatible(layout, geometry)
        except ValueError:
            continue
        if not layout.is_chunk_format:
            names.append(name)
    return names


def show_layouts(model: str, layouts: Sequence[str], block_size: int, tokens: int) -> None:
    """Print the transfer cost of ``tokens`` tokens for each layout and draw their memory maps."""
    geometry = preset(model, block_size=block_size)
    for name in layouts:
        cost = transfer_cost(name, geometry, tokens)
        sizes = ", ".join(f"{n} x {human_bytes(int(s))}" for s, n in cost["segment_sizes"].items())
        print(f"{name:>28}: {human_bytes(cost['bytes_moved'])} in {cost['segments']} segments ({sizes})")
    small = miniature(geometry)
    fig = memory_map([get_layout(n) for n in layouts], small, num_blocks=6, moved_blocks=scattered_block_ids(2, 6, 0))
    plt.show()
    plt.close(fig)


def explore(
    model: str = "llama-3.1-8b",
    layouts: Sequence[str] = ("LBHNC", "BLHNC"),
    block_size: int = 16,
    tokens: int = 256,
    interactive: bool = True,
) -> Any:
    """The explorer widget; with ``interactive=False`` draw the same view once and return None."""
    if not interactive:
        show_layouts(model, layouts, block_size, tokens)
        return None
    import ipywidgets as widgets

    model_w = widgets.Dropdown(options=sorted(PRESETS), value=model, description="model")
    first = widgets.Dropdown(options=compatible_layouts(model), value=layouts[0], description="layout A")
    second = widgets.Dropdown(options=compatible_layouts(model), value=layouts[1], description="layout B")
    block_w = widgets.Dropdown(options=[16, 32, 64, 128, 256], value=block_size, description="block size")
    tokens_w = widgets.SelectionSlider(
        options=[2**k for k in range(4, 15)], value=tokens, description="tokens", continuous_update=False
    )
    out = widgets.Output()

    def redraw(*_: Any) -> None:
        with out:
            out.clear_output(wait=True)
            try:
                show_layouts(model_w.value, [first.value, second.value], block_w.value, tokens_w.value)
            except ValueError as exc:
                print(f"error: {exc}")

    def on_model(change: dict) -> None:
        options = compatible_layouts(change["new"])
        for dropdown, fallback in ((first, options[0]), (second, "BLHNC")):
            keep = dropdown.value if dropdown.value in options else fallback
            dropdown.options = options
            dropdown.value = keep
        redraw()

    model_w.observe(on_model, names="value")
    for widget in (first, second, block_w, tokens_w):
        widget.observe(redraw, names="value")
    redraw()
    return widgets.VBox([widgets.HBox([model_w, block_w, tokens_w]), widgets.HBox([first, second]), out])
