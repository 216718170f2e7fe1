"""A hybrid model's groups in one buffer (where each group's pages sit, what moving a
group's blocks touches, what each byte of a block holds), and telling layouts apart from
the views alone (kvlab.cache.identify)."""

import pytest
import torch

from kvlab.cache import ModelGeometry, adopt, allocate, compatible_layouts
from kvlab.cache.hybrid import UNUSED, HybridGeometry, KVGroup, allocate_hybrid, group_segments, hybrid_cells
from kvlab.cache.identify import ambiguities, overlays, view_classes
from kvlab.cache.quant import PADDING, PAYLOAD, QUANTS

GQA = ModelGeometry("gqa", 1, 2, 16, torch.float32, block_size=4)  # a page: 2 x 4 x 32 x 4 = 1 KiB
PAGE = GQA.page_bytes
UNIFORM = HybridGeometry("uniform", (KVGroup.attention(GQA, [0, 3]), KVGroup.attention(GQA, [1, 4], window=8),
                                     KVGroup.mamba([2, 5], 384, PAGE)))
MIXED = HybridGeometry("mixed", (KVGroup.attention(GQA, [0, 1, 3]), KVGroup.mamba([2], 384)))


def test_groups_start_at_byte_zero_and_share_the_blocks():
    layer_outer = UNIFORM.placements("LBHNC", 6)
    assert {(p.offset, p.layer_stride, p.block_stride) for p in layer_outer} == {(0, 6 * PAGE, PAGE)}
    assert UNIFORM.bytes_per_block("LBHNC") == 2 * PAGE and UNIFORM.bytes_per_block("BLHNC") == 2 * PAGE
    packed = MIXED.placements("BLHNC", 6)
    assert [(p.layer_stride, p.block_stride) for p in packed] == [(PAGE, 3 * PAGE), (384, 3 * PAGE)]
    with pytest.raises(ValueError, match="needs one page size"):
        MIXED.placements("LBNHC", 6)
    with pytest.raises(ValueError, match="pages of one run"):
        UNIFORM.placements("LHBNC", 6)


def test_bad_groups_are_refused():
    with pytest.raises(ValueError, match="hold each layer once"):
        HybridGeometry("twice", (KVGroup.attention(GQA, [0, 1]), KVGroup.mamba([1], 64)))
    with pytest.raises(ValueError, match="must hold its content"):
        KVGroup.mamba([0], 512, 256)
    with pytest.raises(ValueError, match="Mamba state, not K and V"):
        allocate_hybrid(UNIFORM, "BLHNC", 4).group_cache(2)


@pytest.mark.parametrize("layout, runs", [("LBHNC", 2), ("BLHNC", 1)])
def test_moving_a_groups_block_touches_its_layers_pages_only(layout, runs):
    cache = allocate_hybrid(UNIFORM, layout, 6)
    attention = group_segments(cache, 0, [1, 4])
    assert attention.count == 2 * runs and attention.total_bytes == 2 * 2 * PAGE
    state = group_segments(cache, 2, [1])
    assert state.total_bytes == 2 * 384 and set(state.length.tolist()) == {384}  # not the page's padding


def test_a_blocks_bytes_hold_its_owners_pages():
    cache = allocate_hybrid(MIXED, "BLHNC", 2)
    cells = hybrid_cells(cache, [1, 0], 128)  # block 0: Mamba state, block 1: attention
    per_block = 3 * PAGE // 128
    block0 = {k: v[:per_block] for k, v in cells.items()}
    assert block0["kind"].tolist() == [PAYLOAD] * 3 + [UNUSED] * (per_block - 3)
    assert block0["layer"][:3].tolist() == [2, 2, 2] and block0["group"][3:].eq(-1).all()
    assert cells["kind"][per_block:].eq(PAYLOAD).all() and cells["block"][per_block:].eq(1).all()
    padded = hybrid_cells(allocate_hybrid(UNIFORM, "LBHNC", 2), [2, 2], 128)
    assert padded["kind"].tolist().count(PADDING) == 2 * 2 * (PAGE - 384) // 128


def test_a_hybrid_buffer_shows_in_its_views():
    views = allocate_hybrid(UNIFORM, "LBHNC", 4).layers
    classes = view_classes(views)
    assert [len(c.layers) for c in classes] == [4, 2]  # full attention and sliding window look alike
    assert overlays(views) == [("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn",
                                "model.layers.2.self_attn.attn"),
                               ("model.layers.3.self_attn.attn", "model.layers.4.self_attn.attn",
                                "model.layers.5.self_attn.attn")]
    assert overlays(allocate("LBHNC", GQA.with_(num_layers=3), 4).layers) == []


SMALL = ModelGeometry("small", 2, 2, 32, block_size=4)
QUANTIZED = [SMALL.quantized(name) for name in QUANTS]


@pytest.mark.parametrize("geometry", QUANTIZED, ids=lambda g: g.quant.name)
def test_every_quantized_layout_is_identified_from_its_views(geometry):
    for layout in compatible_layouts(geometry, chunk_formats=False):
        found = adopt(allocate(layout, geometry, 5).layers, geometry)
        same = found.layout.name == layout or any(
            a.other == found.layout.name and a.same_meaning for a in ambiguities(geometry, [layout, found.layout.name]))
        assert same, (layout, found.layout.name)


@pytest.mark.parametrize("geometry", QUANTIZED, ids=lambda g: g.quant.name)
def test_no_two_quantized_layouts_look_alike_and_mean_different_bytes(geometry):
    assert [a for a in ambiguities(geometry) if not a.same_meaning] == []


def test_the_cpu_page_looks_like_the_gpu_page_and_means_other_bytes():
    """The #4463 class among the layouts kvlab already had: CPU_ATTN's [2*BS, D] page and the
    GPU backends' [BS, 2D] one are the same views; only the platform tells which."""
    found = {(a.layout, a.other): a.same_meaning for a in ambiguities(SMALL)}
    assert found[("LBHNC", "CPU_LBHNC")] is False and found[("CPU_LBHNC", "LBHNC")] is False
    assert found[("LBNHC", "flash_attn_v0.26")] is True  # 0.26's per-layer NHD tensors, in one buffer
