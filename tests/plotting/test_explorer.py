"""The notebooks' explorer: a miniature that follows the controls, the same transfer at two
scales, estimates from the fitted cost model (or none), and a widget that redraws in place."""

import subprocess
import sys

import matplotlib.pyplot as plt
import pytest

from kvlab.experiments.costmodel import CostFit
from kvlab.plotting.explorer import (MAX_BLOCK_TOKENS, MAX_HEADS, MAX_MOVED_BLOCKS, Scales, gallery, map_figure,
                                     measured_fits, plural, readout)

FIT = CostFit("gpu: test", "offload", "segments", per_segment_s=2e-6, bandwidth=1e10, rows=9, mean_abs_error=0.1)


def test_miniature_follows_block_size_moved_blocks_and_heads_up_to_caps():
    small = Scales.of("llama-3.1-8b", 16, 48)
    assert (small.small.block_size, len(small.moved), small.real_blocks) == (4, 3, 3)
    assert small.small.num_kv_heads == MAX_HEADS < small.real.num_kv_heads
    assert Scales.of("llama-3.1-8b", 32, 48).small.block_size == 8
    big = Scales.of("llama-3.1-8b", 256, 16384)
    assert (big.small.block_size, len(big.moved), big.real_blocks) == (MAX_BLOCK_TOKENS, MAX_MOVED_BLOCKS, 64)
    assert Scales.of("deepseek-r1-distill-qwen-1.5b", 16, 256).small.num_kv_heads == 2  # fewer than the cap
    assert Scales.of("deepseek-v2-lite", 16, 256).small.num_kv_heads == 1  # one MLA latent
    partial = Scales.of("llama-3.1-8b", 64, 16)
    assert (len(partial.moved), partial.real_blocks) == (1, 1)
    assert all(0 < b < big.num_blocks - 1 for b in big.moved)  # none at an end: no runs merge across layers
    with pytest.raises(ValueError, match="tokens must be a positive integer"):
        Scales.of("llama-3.1-8b", 16, 0)


def test_two_scales_and_pluralisation():
    lines = readout("llama-3.1-8b", ["LBHNC", "BLHNC"], 16, 48, fits=())
    assert lines[0] == "miniature: 4 of 32 layers, 4 of 8 heads, blocks of 4 of 16 tokens, 3 of 3 blocks moved"
    assert lines[1] == "  LBHNC: miniature 12 segments; the real transfer 6 MiB in 96 segments of 64 KiB on average"
    assert lines[3] == "BLHNC needs 32x fewer copies than LBHNC for the same 6 MiB"
    one = readout("deepseek-v2-lite", ["BLHNC", "BLHNC"], 64, 16, fits=())
    assert "one MLA latent" in one[0] and "1 of 1 block moved" in one[0]
    assert "miniature 1 segment;" in one[1] and "in 27 segments" in one[1]  # a partial block: one run per layer
    assert one[3] == "BLHNC and BLHNC need as many copies (27) for the same 486 KiB"
    assert plural(1, "segment") == "1 segment" and plural(1024, "segment") == "1,024 segments"
    with pytest.raises(ValueError, match="two layouts"):
        readout("llama-3.1-8b", ["LBHNC"], 16, 48)


def test_estimates_from_fits_or_no_measured_results(tmp_path):
    lines = readout("llama-3.1-8b", ["LBHNC", "BLHNC"], 16, 256, fits=[FIT])
    # LBHNC: 512 x 2 us + 32 MiB / 10 GB/s = 4.38 ms; BLHNC: 16 x 2 us + 3.36 ms = 3.39 ms;
    # break-even: 2 us x 10 GB/s x (1 - 1.1 / 32) / 0.1 = 188.6 KiB
    assert lines[5] == "  gpu: test, 2 µs a copy + 10 GB/s: LBHNC 4.38 ms, BLHNC 3.39 ms"
    assert lines[6] == "    break-even segment 188.6 KiB; mean: LBHNC 64 KiB below, BLHNC 2 MiB above"
    assert readout("llama-3.1-8b", ["LBHNC", "BLHNC"], 16, 256, fits=())[-1] == \
        "estimated offload time: no measured results"
    assert measured_fits(tmp_path) == ()  # an empty results folder
    assert measured_fits() is measured_fits()  # fitted once per process


def test_explorer_core_does_not_import_vllm():
    code = ("import sys; from kvlab.plotting.explorer import readout;"
            "readout('llama-3.1-8b', ['LBHNC', 'BLHNC'], 16, 256);"
            "assert 'vllm' not in sys.modules, 'vllm imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def legend_labels(fig) -> list[str]:
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    return [text.get_text() for legend in legends for text in legend.get_texts()]


def test_no_rope_legend_without_rope_cells():
    packed = map_figure("deepseek-v2-lite", ["LBHNC", "BLHNC"], 16, 64)
    split = map_figure("deepseek-v2-lite", ["LBHNC", "ascend_mla_tuple"], 16, 64)
    try:
        assert "rope" not in legend_labels(packed) and "rope" in legend_labels(split)
        titles = [ax.get_title() for ax in packed.axes[:2]]
        assert titles == ["LBHNC\nminiature: 16 segments", "BLHNC\nminiature: 4 segments"]
    finally:
        plt.close(packed)
        plt.close(split)


def test_gallery_shows_both_scales_for_llama_and_mla():
    fig = gallery(fits=())
    try:
        text = "\n".join(t.get_text() for ax in fig.axes for t in ax.texts)
        assert text.count("no measured results") == 4 and "one MLA latent" in text and "blocks of 8 of 64" in text
        assert "two scales" in fig._suptitle.get_text()
    finally:
        plt.close(fig)


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
    assert "BLHNC: miniature 6 segments; the real transfer 32 MiB in 16 segments" in w["numbers"].value
    assert w["map"].value[:4] == b"\x89PNG"
    maps = [w["map"].value]
    for role, value in (("model", "deepseek-v2-lite"), ("layout-a", "mla_v0.12"), ("layout-b", "ascend_mla_tuple"),
                        ("block-size", 64), ("tokens", 512)):
        w[role].value = value
        assert w["map"].value not in maps, f"the map did not change with {role}"
        maps.append(w["map"].value)
    assert "flash_attn_v0.12" not in w["layout-a"].options
    assert "ascend_mla_tuple: miniature 48 segments; the real transfer 15.2 MiB in 432 segments" in w["numbers"].value
