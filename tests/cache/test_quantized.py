"""Quantized KV caches as data: what a row holds, which layouts carry it, what a transfer
moves by kind, and what each map cell is (the formats: kvlab.cache.quant)."""

import pytest
import torch

from kvlab.cache import ModelGeometry, allocate, compatible_layouts, preset, transfer_cost
from kvlab.cache.cells import cell_labels, cells_per_page
from kvlab.cache.quant import PADDING, PAYLOAD, QUANTS, SCALE

LLAMA = preset("llama-3.1-8b")
SMALL = ModelGeometry("small", 2, 2, 32, block_size=4)


@pytest.mark.parametrize("name, row, split", [
    ("int8_per_token_head", 132, {"payload": 128, "scale": 4, "padding": 0}),  # vLLM #38378: D + 4
    ("fp8_per_token_head", 132, {"payload": 128, "scale": 4, "padding": 0}),
    ("fp8_inline_slot16", 144, {"payload": 128, "scale": 4, "padding": 12}),  # FlashInfer #5164/#5272: D + 16
    ("nvfp4", 72, {"payload": 64, "scale": 8, "padding": 0}),  # D/2 + D/16 (FlexKV #252)
])
def test_a_row_is_its_values_its_scales_and_its_padding(name, row, split):
    geometry = LLAMA.quantized(name)
    assert geometry.row_size == row and QUANTS[name].split(128) == split
    assert geometry.page_bytes == 16 * 8 * 2 * row and geometry.dtype == QUANTS[name].storage


def test_bad_quantized_geometries_are_refused():
    with pytest.raises(ValueError, match="not MLA latents"):
        preset("deepseek-v2-lite").quantized("nvfp4")
    with pytest.raises(ValueError, match="multiple of 16, got 24"):
        ModelGeometry("odd", 2, 2, 24).quantized("nvfp4")
    with pytest.raises(ValueError, match="stored as int8, not bfloat16"):
        ModelGeometry("m", 2, 2, 32, quant="int8_per_token_head")
    with pytest.raises(ValueError, match="unknown quantized KV format 'int4'"):
        LLAMA.quantized("int4")


def test_each_format_lives_in_the_layouts_that_carry_it():
    nvfp4 = compatible_layouts(LLAMA.quantized("nvfp4"))
    assert nvfp4 == ["nvfp4_LBHNC", "nvfp4_LBNHC", "nvfp4_BLHNC", "nvfp4_BLNHC"]
    inline = compatible_layouts(LLAMA.quantized("int8_per_token_head"))
    assert {"LBHNC", "BLNHC", "flashinfer_v0.12"} <= set(inline)
    assert not [n for n in inline if n.startswith(("CPU_", "cpu_attn", "KV_", "ascend", "nvfp4"))]
    assert not [n for n in compatible_layouts(LLAMA) if n.startswith("nvfp4")]
    with pytest.raises(ValueError, match="layout nvfp4_LBHNC carries regions scales .NVFP4., but .* is unquantized"):
        allocate("nvfp4_LBHNC", SMALL, 2)
    with pytest.raises(ValueError, match="layout CPU_LBHNC carries no scales, but .* is int8_per_token_head"):
        allocate("CPU_LBHNC", SMALL.quantized("int8_per_token_head"), 2)


def test_a_transfer_counts_payload_scales_and_padding_apart():
    plain = transfer_cost("LBHNC", LLAMA, 256)
    for name in ("int8_per_token_head", "fp8_inline_slot16"):
        cost = transfer_cost("LBHNC", LLAMA.quantized(name), 256)
        assert cost["segments"] == plain["segments"]  # the scales ride inside each row's run
        assert cost["payload_bytes"] + cost["scale_bytes"] + cost["padding_bytes"] == cost["bytes_moved"]
        assert cost["scale_bytes"] == 256 * 32 * 8 * 2 * 4 and cost["payload_bytes"] == plain["bytes_moved"] // 2
    nvfp4 = transfer_cost("nvfp4_BLHNC", LLAMA.quantized("nvfp4"), 256)
    assert nvfp4["segments"] == 16 and nvfp4["scale_bytes"] * 8 == nvfp4["payload_bytes"]
    assert "payload_bytes" not in plain


def test_an_nvfp4_page_moves_whole():
    with pytest.raises(ValueError, match="moves whole blocks only.*interleaves V's scales"):
        transfer_cost("nvfp4_LBHNC", LLAMA.quantized("nvfp4"), 250)


def test_inline_cells_end_each_row_with_its_scale():
    geometry = SMALL.quantized("fp8_inline_slot16")  # row 32 + 16 bytes: 8 payload cells, 1 scale, 3 padding
    cells = cell_labels("LBHNC", geometry, 2)
    assert cells["kind"][:12].tolist() == [PAYLOAD] * 8 + [SCALE] + [PADDING] * 3
    assert len(cells["kind"]) * 4 == allocate("LBHNC", geometry, 2).nbytes
    assert cells_per_page("LBHNC", geometry) == 4 * 2 * 2 * 12


@pytest.mark.parametrize("layout, heads_first", [("nvfp4_LBHNC", True), ("nvfp4_BLNHC", False)])
def test_an_nvfp4_side_holds_every_rows_values_then_their_scales(layout, heads_first):
    geometry = SMALL.quantized("nvfp4")  # D 32: 16 value bytes, 2 scale bytes a row; cells of 2 bytes
    cells = {k: v[: cells_per_page(layout, geometry)] for k, v in cell_labels(layout, geometry, 3).items()}
    rows = 2 * 4  # heads x tokens in one side
    k_side = slice(0, rows * 9)
    assert cells["part"][k_side].eq(0).all() and cells["part"][rows * 9:].eq(1).all()
    assert cells["kind"][k_side].tolist() == [PAYLOAD] * rows * 8 + [SCALE] * rows
    second = (cells["head"][8].item(), cells["token"][8].item())  # the second row's first cell
    assert second == ((0, 1) if heads_first else (1, 0))
    assert torch.equal(cells["block"], torch.zeros_like(cells["block"])) and cells["layer"].eq(0).all()
