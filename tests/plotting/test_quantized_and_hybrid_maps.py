"""The maps of quantized caches and hybrid buffers, in notebook 01 and the explorer: every byte
drawn in proportion, keyed by what it holds, and the explorer's KV format control."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from kvlab.cache import preset  # noqa: E402
from kvlab.cache.hybrid import hybrid_miniature  # noqa: E402
from kvlab.plotting import hybrid_map, memory_map, miniature  # noqa: E402
from kvlab.plotting.atlas import KIND_COLOURS  # noqa: E402
from kvlab.plotting.atlas_notes import hybrid_points, hybrid_rows, quantized_costs, quantized_points  # noqa: E402
from kvlab.plotting.common import legend_labels  # noqa: E402
from kvlab.plotting.explorer import map_figure, numbers  # noqa: E402

SMALL = miniature(preset("llama-3.1-8b")).with_(head_size=32)


def test_a_slot16_row_is_drawn_as_values_scale_and_padding():
    fig = memory_map(["LBHNC"], SMALL.quantized("fp8_inline_slot16"), moved_blocks=(), colour_by=("kind",))
    try:
        drawn = fig.axes[0].images[0].get_array()
        assert drawn.shape[1] == 4 * 2 * 2 * 12  # a map row is one page: tokens x heads x K/V x a row's cells
        image = drawn.reshape(-1, 3)
        row = [int(np.argmin(np.abs(KIND_COLOURS[:3] - cell).sum(1))) for cell in image[:12]]
        assert row == [0] * 8 + [1] + [2] * 3  # 32 value bytes, the scale, 12 bytes of slot: 4-byte cells
        assert legend_labels(fig) == ["payload", "scale", "padding"]
        assert "One cell = 4 bytes of a fp8_inline_slot16 row" in " ".join(fig.get_supxlabel().split())
    finally:
        plt.close(fig)


def test_the_explorer_draws_and_counts_a_quantized_format():
    fig = map_figure("llama-3.1-8b", ["nvfp4_LBHNC", "nvfp4_BLHNC"], 16, 256, kv_format="nvfp4")
    try:
        assert "scale" in legend_labels(fig) and "of one head's nvfp4 row" in " ".join(fig._suptitle.get_text().split())
    finally:
        plt.close(fig)
    _, table = numbers("llama-3.1-8b", ["nvfp4_LBHNC", "nvfp4_BLHNC"], 16, 256, fits=(), kv_format="nvfp4")
    assert table["of which scales + padding"].tolist() == ["1 MiB", "1 MiB"] and table["segments"].tolist() == [512, 16]
    with pytest.raises(ValueError, match="the KV format is one of"):
        numbers("llama-3.1-8b", ["LBHNC", "BLHNC"], 16, 256, kv_format="int3")


def test_the_explorers_kv_format_control_changes_the_layouts():
    pytest.importorskip("ipywidgets")
    from kvlab.plotting.explorer import explorer_widget

    found, stack = {}, [explorer_widget()]
    while stack:
        widget = stack.pop()
        stack += getattr(widget, "children", ())
        found.update({c.removeprefix("kvlab-explorer-"): widget for c in widget._dom_classes})
    before = found["map"].value
    found["kv-format"].value = "nvfp4"
    assert list(found["layout-a"].options) == ["nvfp4_LBHNC", "nvfp4_LBNHC", "nvfp4_BLHNC", "nvfp4_BLNHC"]
    assert (found["layout-a"].value, found["layout-b"].value) == ("nvfp4_LBHNC", "nvfp4_BLHNC")
    assert found["map"].value != before and "nvfp4_BLHNC" in found["numbers"].value


def test_a_hybrid_map_draws_each_block_as_its_owner_holds_it():
    fig = hybrid_map(hybrid_miniature(True), ["BLHNC"], [1, 0], 32, colour_by=("kind",))
    try:
        image = fig.axes[0].images[0].get_array()
        assert image.shape[:2] == (2, 3 * 256 // 32)  # a row per block, three attention pages wide
        assert (image[0, 3:] == 1).all() and (image[1] != 1).any()  # block 0: one Mamba state, the rest unused
        assert legend_labels(fig) == ["payload", "unused"]
    finally:
        plt.close(fig)


def test_the_notes_are_computed_from_the_arithmetic():
    costs = quantized_costs(preset("llama-3.1-8b"), 256)
    text = quantized_points(costs)._repr_markdown_()
    assert "int8_per_token_head in LBHNC: 16.5 MiB for what takes 32 MiB in bfloat16" in text
    assert "in 512 segments (512 unquantized)" in text
    rows = hybrid_rows(hybrid_miniature(), ["LBHNC", "BLHNC"], [0, 3])
    assert "BLHNC, segments by group: full_attention 2, sliding_window (window 8) 2, mamba 4" in \
        hybrid_points(rows)._repr_markdown_()
