"""The notebooks' explorer: a miniature in proportion to the transfer (block size and tokens
change what every map draws, up to a cap it names), legends naming exactly the colours
drawn, text readable at 100 % zoom, estimates that say whose machine and which copy method
they come from, a widget that redraws in place, and the view that static copies keep."""

import base64
import io
import json
import subprocess
import sys

import matplotlib.colors
import matplotlib.image
import numpy as np
import pandas as pd
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.text import Text

from kvlab.cache.allocation import address_labels
from kvlab.cache.geometry import preset
from kvlab.cache.fits import compatible_layouts
from kvlab.plotting.atlas import COLOUR_BY
from kvlab.plotting.common import BLACK, legend_labels, plural
from kvlab.plotting.explorer import (BLOCK_SIZES, DPI, MAX_HEADS, PANEL_H, PANEL_W, TOKENS, Scales, map_figure,
                                     map_png, numbers)
from kvlab.plotting.explorer_numbers import measured_fits, this_machine
from kvlab.results import fingerprint

DEFAULT = ("llama-3.1-8b", ["LBHNC", "BLHNC"], 16, 256)
XEON, EPYC = "cpu: Intel(R) Xeon(R) Processor (2 cores)", "cpu: AMD EPYC (2 cores)"


def test_the_miniature_is_in_proportion_to_the_transfer_up_to_a_cap():
    small = Scales.of("llama-3.1-8b", 16, 48)
    assert (small.small.block_size, len(small.spans), small.real_blocks) == (1, 3, 3)
    assert small.small.num_kv_heads == MAX_HEADS < small.real.num_kv_heads
    # a drawn token is 16 tokens: the block size sets a drawn block's length, the tokens how many move
    assert [Scales.of("llama-3.1-8b", size, 16384).small.block_size for size in BLOCK_SIZES] == [1, 2, 4, 8, 16]
    assert [len(Scales.of("llama-3.1-8b", 16, tokens).spans) for tokens in TOKENS] == [1, 2, 4, 8, 16, 32] + [64] * 5
    capped = Scales.of("llama-3.1-8b", 16, 16384)
    assert capped.drawn() == "the first 64 of 1,024 blocks drawn … 960 more not drawn"
    ids = sorted(block for block, _, _ in capped.spans)
    assert 0 < ids[0] and ids[-1] < capped.num_blocks - 1 and all(b - a > 1 for a, b in zip(ids, ids[1:]))
    partial = Scales.of("deepseek-v2-lite", 64, 16)  # a quarter of a block: one of its four drawn tokens
    assert [(first, end) for _, first, end in partial.spans] == [(0, 1)]
    assert partial.drawn() == "its one block drawn, of the last only 1 of 4 drawn tokens (a partial block)"
    assert Scales.of("deepseek-v2-lite", 16, 256).small.num_kv_heads == 1  # one MLA latent
    with pytest.raises(ValueError, match="tokens must be a positive integer"):
        Scales.of("llama-3.1-8b", 16, 0)


@pytest.mark.parametrize("model", ["llama-3.1-8b", "deepseek-v2-lite", "smollm2-135m"])
def test_every_map_is_readable_and_its_tensors_start_rows(model):
    """At least 2 px a cell at 100 % zoom, whatever the controls; the lines parting tensors
    run along rows."""
    for block_size in BLOCK_SIZES:
        for tokens in (16, 256, 16384):
            scales = Scales.of(model, block_size, tokens)
            for layout in compatible_layouts(preset(model), chunk_formats=False):
                tensors = np.bincount(address_labels(layout, scales.small, scales.num_blocks)["tensor"].numpy())
                width = scales.row_cells(layout)
                assert not (tensors % width).any()
                assert width <= PANEL_W * DPI / 2 and tensors.sum() / width <= PANEL_H * DPI / 2, \
                    (layout, block_size, tokens, width, tensors.sum() // width)


def map_images(fig) -> list[np.ndarray]:
    return [np.asarray(ax.images[0].get_array()) for ax in fig.axes if ax.images]


def panel_pixels(*view) -> list[np.ndarray]:
    """Each map's pixels in the PNG the explorer shows (its title and legend lie outside)."""
    image = matplotlib.image.imread(io.BytesIO(map_png(*view)), format="png")
    height, width = image.shape[:2]
    boxes = [ax.get_position() for ax in map_figure(*view).axes if ax.images]
    return [image[round((1 - b.y1) * height):round((1 - b.y0) * height), round(b.x0 * width):round(b.x1 * width)]
            for b in boxes]


@pytest.mark.parametrize("model", ["llama-3.1-8b", "deepseek-v2-lite"])
@pytest.mark.parametrize("before, after", [((16, 512), (16, 16384)), ((16, 256), (64, 256))],
                         ids=["tokens", "block size"])
def test_every_map_changes_with_tokens_and_block_size(model, before, after):
    views = [(model, ["LBHNC", "BLHNC"], size, tokens) for size, tokens in (before, after)]
    for old, new in zip(*(map_images(map_figure(*view)) for view in views)):
        assert old.shape != new.shape or (old != new).any()
    old, new = (panel_pixels(*view) for view in views)
    assert len(old) == len(new) == 4
    for panel, (a, b) in enumerate(zip(old, new)):
        assert a.shape == b.shape and (a != b).any(), f"map {panel} looks the same"


def test_the_pixel_comparison_sees_the_maps_not_their_titles():
    """Past the cap the maps stay as they are while the titles count more blocks: the
    comparison above would not pass on a title's change."""
    views = [("llama-3.1-8b", ["LBHNC", "BLHNC"], 16, tokens) for tokens in (2048, 4096)]
    assert map_png(*views[0]) != map_png(*views[1])
    for a, b in zip(*(panel_pixels(*view) for view in views)):
        assert (a == b).all()


def colours(cells: np.ndarray) -> set[tuple]:
    return {tuple(c) for c in np.asarray(cells).reshape(-1, 3).round(6)}


@pytest.mark.parametrize("model", ["llama-3.1-8b", "deepseek-v2-lite"])
@pytest.mark.parametrize("by", COLOUR_BY)
def test_legends_name_exactly_the_colours_drawn(model, by):
    fig = map_figure(model, ["LBHNC", "BLHNC"], 16, 16384, colour_by=[by])  # 64 blocks: colours repeat
    (legend,) = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    named = colours([handle.get_facecolor()[:3] for handle in legend.legend_handles])
    assert len(named) == len(legend.legend_handles)  # one entry per colour
    for cells in map_images(fig):
        assert colours(cells) == named
        assert tuple(matplotlib.colors.to_rgb(BLACK)) not in named  # black parts tensors


def test_mla_maps_are_labelled_as_mla():
    packed = map_figure("deepseek-v2-lite", ["LBHNC", "BLHNC"], 16, 256)
    split = map_figure("deepseek-v2-lite", ["ascend_mla_tuple", "ascend_mla_tuple"], 16, 256)
    mixed = map_figure("deepseek-v2-lite", ["mla_v0.12", "ascend_mla_tuple"], 16, 256)
    llama = map_figure(*DEFAULT)
    row_labels = {name: [ax.get_ylabel() for ax in fig.axes if ax.get_ylabel()]
                  for name, fig in (("packed", packed), ("split", split), ("mixed", mixed), ("llama", llama))}
    assert row_labels == {"packed": ["by layer", "by block"], "split": ["by layer", "by MLA part"],
                          "mixed": ["by layer", "by block"], "llama": ["by layer", "by K/V"]}
    for fig in (packed, split, mixed):
        text = " ".join(t.get_text() for t in fig.findobj(Text))
        assert "MLA latent" in fig.get_suptitle() and "K/V" not in text and "K or V" not in text
    assert {"latent", "rope"} <= set(legend_labels(split)) and "rope" not in " ".join(legend_labels(packed))
    assert "latent + rope" in legend_labels(map_figure("deepseek-v2-lite", ["LBHNC", "BLHNC"], 16, 256, ["part"]))


@pytest.mark.parametrize("view", [DEFAULT, ("deepseek-v2-lite", ["mla_v0.12", "ascend_mla_tuple"], 16, 16384),
                                  ("smollm2-135m", ["flash_attn_v0.12_hnd", "BLHNC"], 256, 16)])
def test_text_is_readable_at_100_percent(view):
    """Every text at least 10 px at the figure's own resolution, the one it is shown at,
    inside the figure and clear of every other text."""
    fig = map_figure(*view)
    FigureCanvasAgg(fig).draw()
    for text in fig.findobj(Text):
        assert text.get_fontsize() * fig.dpi / 72 >= 10, text.get_text()
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    assert len(texts) > 10
    boxes = [text.get_window_extent() for text in texts]
    frame = fig.bbox
    for text, box in zip(texts, boxes):
        assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1, text.get_text()
    for i, a in enumerate(boxes):
        for j in range(i):
            assert not a.overlaps(boxes[j]), (texts[i].get_text(), texts[j].get_text())
    image = matplotlib.image.imread(io.BytesIO(map_png(*view)), format="png")
    assert image.shape[:2] == (round(fig.get_figheight() * DPI), round(fig.get_figwidth() * DPI))  # shown as drawn


def test_numbers_at_both_scales():
    notes, table = numbers(*DEFAULT, fits=(), here=XEON)
    assert notes == ["BLHNC needs 32x fewer copies than LBHNC for the same 32 MiB",
                     "estimated offload time: no measured results"]
    assert table.to_dict("records")[0] == {
        "layout": "LBHNC", "segments": 512, "mean segment": "64 KiB", "bytes": "32 MiB",
        "estimated offload time": "no measured results", "measured on": "", "copy method": ""}
    notes, table = numbers("deepseek-v2-lite", ["BLHNC", "BLHNC"], 64, 16, fits=(), here=XEON)
    assert notes[0] == "BLHNC and BLHNC need as many copies (27) for the same 486 KiB"
    assert list(table["segments"]) == [27, 27]  # a partial block: a run per layer
    assert plural(1, "segment") == "1 segment" and plural(1024, "segment") == "1,024 segments"
    with pytest.raises(ValueError, match="two layouts"):
        numbers("llama-3.1-8b", ["LBHNC"], 16, 48)


def write_results(folder, stem: str, hardware: str, methods) -> None:
    """A results file of one run: exact timings of each (method, s a copy, bytes a second)."""
    records = [{"record": "run", "run_id": stem, "hardware": hardware, "date": "2026-01-01T00:00:00+00:00"}]
    for method, per_copy, bandwidth in methods:
        for segments, nbytes in ((64, 2**20), (4096, 2**22), (1024, 2**26)):  # not in proportion
            records.append({"record": "row", "run_id": stem, "status": "ok", "direction": "offload", "method": method,
                            "segments": segments, "bytes": nbytes, "seconds": segments * per_copy + nbytes / bandwidth})
    (folder / f"{stem}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_estimates_say_whose_machine_and_which_copy_method(tmp_path):
    write_results(tmp_path, "02_transfer-xeon", XEON, [("segments", 4e-6, 1e10), ("gather", 1e-7, 1e10),
                                                       ("memcpy", 1e-8, 2e10)])
    write_results(tmp_path, "02_ceiling-epyc", EPYC, [("segments", 4e-6, 1e10), ("gather", 2e-7, 8e9)])
    fits = measured_fits(tmp_path)
    assert sorted((f.hardware, f.method) for f in fits) == [(EPYC, "gather"), (XEON, "memcpy")]  # fastest batched

    notes, table = numbers(*DEFAULT, fits=fits, here=XEON)  # this machine was measured: its own estimate
    assert notes[1] == ("estimate measured on this machine (cpu: Intel Xeon (2 cores)): memcpy (batched), 10 ns a "
                        "copy + 20 GB/s, break-even 1.9 KiB")  # 10 ns x 20 GB/s x (1 - 1.1 / 32) / 0.1
    # LBHNC: 512 x 10 ns + 32 MiB / 20 GB/s = 1.68 ms
    assert table[["layout", "estimated offload time", "measured on", "copy method"]].values.tolist() == [
        ["LBHNC", "1.68 ms", "this machine (cpu: Intel Xeon (2 cores))", "memcpy"],
        ["BLHNC", "1.68 ms", "this machine (cpu: Intel Xeon (2 cores))", "memcpy"]]

    notes, table = numbers(*DEFAULT, fits=fits, here="cpu: Another CPU (8 cores)")  # not measured: said plainly
    assert [note.split(" (batched)")[0] for note in notes[1:]] == [
        "estimate measured on cpu: AMD EPYC (2 cores), not this machine: gather",
        "estimate measured on cpu: Intel Xeon (2 cores), not this machine: memcpy"]
    assert set(table["measured on"]) == {"cpu: AMD EPYC (2 cores), not this machine",
                                         "cpu: Intel Xeon (2 cores), not this machine"}
    assert len(table) == 4 and "segments" not in set(table["copy method"])
    assert measured_fits(tmp_path / "nothing") == ()


def test_committed_estimates_use_each_machines_fastest_batched_method():
    fits = measured_fits()
    assert fits and measured_fits() is fits  # fitted once per process
    assert all(f.method in ("memcpy", "gather") for f in fits)
    assert this_machine() == fingerprint()["hardware"]
    notes, table = numbers(*DEFAULT)
    ours = this_machine() in {f.hardware for f in fits}
    assert all(("this machine (" in place) == ours for place in table["measured on"])
    assert all(("not this machine" in place) != ours for place in table["measured on"])


def test_explorer_core_does_not_import_vllm():
    code = ("import sys; from kvlab.plotting.explorer import numbers, map_png;"
            "numbers('llama-3.1-8b', ['LBHNC', 'BLHNC'], 16, 256); map_png('llama-3.1-8b', ['LBHNC', 'BLHNC'], 16, 256);"
            "assert 'vllm' not in sys.modules, 'vllm imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def roles(box) -> dict:
    """The explorer's widgets by their CSS handle (kvlab-explorer-<role>)."""
    found, stack = {}, [box]
    while stack:
        widget = stack.pop()
        stack += getattr(widget, "children", ())
        found.update({c.removeprefix("kvlab-explorer-"): widget for c in widget._dom_classes})
    return found


def test_explorer_widget_redraws_the_map_with_every_control():
    pytest.importorskip("ipywidgets")
    from kvlab.plotting.explorer import explorer_widget

    w = roles(explorer_widget())
    assert "BLHNC needs 32x fewer copies than LBHNC for the same 32 MiB" in w["numbers"].value
    assert "<table" in w["numbers"].value and w["map"].value == map_png(*DEFAULT)
    maps = [w["map"].value]
    for role, value in (("model", "deepseek-v2-lite"), ("layout-a", "mla_v0.12"), ("layout-b", "ascend_mla_tuple"),
                        ("block-size", 64), ("tokens", 512)):
        w[role].value = value
        assert w["map"].value not in maps, f"the map did not change with {role}"
        maps.append(w["map"].value)
    assert "flash_attn_v0.12" not in w["layout-a"].options
    assert w["map"].value == map_png("deepseek-v2-lite", ["mla_v0.12", "ascend_mla_tuple"], 64, 512)
    assert "<td>ascend_mla_tuple</td>\n      <td>432</td>" in w["numbers"].value


def shown(monkeypatch, **kwargs) -> list:
    """What explore() displays: (object, display's keywords) each."""
    from kvlab.plotting.explorer import explore

    outputs = []
    monkeypatch.setattr("IPython.display.display", lambda obj, **kw: outputs.append((obj, kw)))
    explore(**kwargs)
    return outputs


def test_static_copies_keep_a_picture_and_a_table(monkeypatch):
    """Headless (papermill, interactive=False): the first view as a PNG, its notes and a
    DataFrame of its numbers, with the estimate's machine and copy method."""
    from IPython.display import HTML, Image

    (picture, _), (notes, _), (table, _) = shown(monkeypatch, interactive=False)
    assert isinstance(picture, Image) and picture.format == "png" and picture.data == map_png(*DEFAULT)
    assert isinstance(notes, HTML) and "fewer copies" in notes.data
    # a row per layout and measured machine: this one's own, else each committed one (any machine runs this)
    assert isinstance(table, pd.DataFrame) and list(dict.fromkeys(table.index)) == ["LBHNC", "BLHNC"]
    machines = table["measured on"].tolist()
    assert machines[: len(machines) // 2] == machines[len(machines) // 2:], "both layouts on the same machines"
    assert {"segments", "bytes", "estimated offload time", "measured on", "copy method"} <= set(table.columns)


def test_the_live_widget_falls_back_to_its_first_picture(monkeypatch):
    pytest.importorskip("ipywidgets")
    outputs = shown(monkeypatch, interactive=True)
    (bundle, raw), *static = outputs
    assert raw == {"raw": True} and "application/vnd.jupyter.widget-view+json" in bundle
    assert base64.b64decode(bundle["image/png"]) == map_png(*DEFAULT)
    assert len(static) == 4 and isinstance(static[-1][0], pd.DataFrame)  # a note, then the static copy


@pytest.mark.slow
def test_an_executed_notebook_exported_to_html_keeps_picture_and_table(tmp_path):
    """`jupyter nbconvert --to html --execute`: the widget needs a network to be drawn from
    its saved state, the picture and table after it do not; a copy saved without widget
    state (JupyterLab's default) shows the widget's own fallback picture too."""
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient
    from nbconvert import HTMLExporter

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "from kvlab.plotting.explorer import explore\nexplore()")])
    NotebookClient(notebook, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(tmp_path)}}).execute()
    html, _ = HTMLExporter().from_notebook_node(notebook)
    assert html.count("src=\"data:image/png;base64,") == 1 and "class=\"dataframe" in html
    assert "fewer copies than LBHNC" in html
    del notebook.metadata["widgets"]
    html, _ = HTMLExporter().from_notebook_node(notebook)
    assert html.count("src=\"data:image/png;base64,") == 2
