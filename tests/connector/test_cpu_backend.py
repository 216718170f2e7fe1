"""kvlab's CPU attention backend without an engine: which of vLLM's layouts CPU_ATTN's own
kernels read (proved bitwise on per-layer views of a 5-D buffer, before any kernel of our
own was considered), the plugin, the hooks mode's errors, and layerwise saves copying
each layer when its attention is done. Engines: tests/integration/test_backend_engine.py."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

pytest.importorskip("vllm")

from vllm import _custom_ops as ops  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvlab.cache import ModelGeometry  # noqa: E402
from kvlab.cache.layouts import CPU_ATTN_LAYOUTS  # noqa: E402
from kvlab.connector import ConnectorConfig  # noqa: E402
from kvlab.connector.backend import READABLE_LAYOUTS, KVLabCPUAttentionBackend, installed, kv_pair, register  # noqa: E402
from kvlab.harness.driver import connector_pair, prefill  # noqa: E402
from kvlab.harness.driver import register as register_cache  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_stores", "vllm_cpu_build")

LAYERS, BLOCKS, HEADS, BLOCK, DIM, QUERY_HEADS, TOKENS = 3, 6, 2, 32, 64, 4, 50
TABLE = [5, 2]  # the sequence's blocks, out of order


def layer_views(layout: KVCacheLayout, dtype: torch.dtype) -> torch.Tensor:
    """vLLM's per-layer [L][B, H, N, 2D] views of one buffer in ``layout``'s physical order."""
    logical = (LAYERS, BLOCKS, HEADS, BLOCK, 2 * DIM)
    order = layout.stride_order
    physical = torch.zeros([logical[i] for i in order], dtype=dtype)
    return physical.permute(*[order.index(i) for i in range(5)])


def attend(cache: torch.Tensor, dtype: torch.dtype, damage: Callable[[torch.Tensor], Any] | None = None) -> torch.Tensor:
    """CPU_ATTN's two kernels as its backend calls them: write one sequence's K/V through the
    slot mapping (then ``damage`` the cache, if given), then attend over it; the output."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(TOKENS, heads, DIM, generator=generator).to(dtype) for heads in (QUERY_HEADS, HEADS, HEADS))
    isa = _get_attn_isa(dtype, BLOCK, DIM)
    slots = torch.tensor([TABLE[t // BLOCK] * BLOCK + t % BLOCK for t in range(TOKENS)])
    starts, lengths = torch.tensor([0, TOKENS], dtype=torch.int32), torch.tensor([TOKENS], dtype=torch.int32)
    key_cache, value_cache = kv_pair(cache)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")
    if damage is not None:
        damage(cache)
    schedule = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=QUERY_HEADS, num_kv_heads=HEADS, head_dim=DIM, seq_lens=lengths, dtype=dtype,
        query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False,
        dynamic_causal=None, kv_cache_dtype="auto")
    out = torch.empty(TOKENS, QUERY_HEADS, DIM, dtype=dtype)
    ops.cpu_attention_with_kv_cache(
        query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts, seq_lens=lengths,
        scale=DIM ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1,
        block_table=torch.tensor([TABLE], dtype=torch.int32), softcap=0, scheduler_metadata=schedule, s_aux=None,
        dynamic_causal=None, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    return out


def test_cpu_attn_kernels_read_every_head_major_layout_bitwise(dtype: torch.dtype = torch.float32) -> None:
    """The question the issue put first: do CPU_ATTN's kernels honour a block (and head)
    stride? For every layout whose block interior is head-major they do, bitwise, for every
    layer of the buffer, touching no other layer; the token-major ones cannot even be viewed
    as CPU_ATTN's [2*BS, D] pages. So the backend declares exactly the readable ones. (fp32:
    the bf16 kernels need instructions not every x86 CPU has; the engine tests run bf16.)"""
    reference_cache = torch.zeros(BLOCKS, HEADS, BLOCK, 2 * DIM, dtype=dtype)
    reference = attend(reference_cache, dtype)
    readable = []
    for layout in KVCacheLayout:
        views = layer_views(layout, dtype)
        try:
            kv_pair(views[0])
        except RuntimeError:  # "view size is not compatible with input tensor's size and stride"
            assert layout.stride_order[-2:] != (3, 4), "only a token-major page cannot be viewed"
            continue
        for layer in range(LAYERS):
            views.zero_()
            assert torch.equal(attend(views[layer], dtype), reference), (layout.name, layer)
            assert torch.equal(views[layer].contiguous(), reference_cache), "the same bytes, where they belong"
            others = [i for i in range(LAYERS) if i != layer]
            assert not views[others].any(), "no other layer touched"
        readable.append(layout.name)
    assert tuple(readable) == READABLE_LAYOUTS
    assert [layout.name for layout in KVCacheLayout if layout.stride_order[-2:] == (3, 4)] == readable  # N, C inner
    assert KVLabCPUAttentionBackend.supported_kv_cache_layouts()[0] is KVCacheLayout.LBHNC, "vLLM's default stays"
    assert CPU_ATTN_LAYOUTS == tuple(f"CPU_{name}" for name in READABLE_LAYOUTS)


@pytest.mark.parametrize("damage", ["zeroed", "shifted"])
def test_damaged_kv_moves_the_kernel_output(damage: str) -> None:
    """The bitwise check above can fail: the same attention over a block-major layer whose
    first block was zeroed, or whose tokens moved by one, after the write differs."""
    cache = layer_views(KVCacheLayout.BLHNC, torch.float32)[1]
    reference = attend(cache, torch.float32)

    def zeroed(c: torch.Tensor) -> None:
        c[TABLE[0]].zero_()

    def shifted(c: torch.Tensor) -> None:
        c[TABLE[0]].copy_(c[TABLE[0]].roll(1, dims=1))

    assert not torch.equal(attend(cache, torch.float32, {"zeroed": zeroed, "shifted": shifted}[damage]), reference)


def test_the_plugin_puts_the_backend_in_cpu_attns_place() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    before = AttentionBackendEnum.CPU_ATTN.get_path()
    try:
        register()
        assert installed() and AttentionBackendEnum.CPU_ATTN.get_class() is KVLabCPUAttentionBackend
        assert KVLabCPUAttentionBackend.get_name() == "CPU_ATTN"  # the same kernels, the same name in vLLM's logs
    finally:
        from vllm.v1.attention.backends import registry

        registry._ATTN_OVERRIDES.pop(AttentionBackendEnum.CPU_ATTN, None)
    assert AttentionBackendEnum.CPU_ATTN.get_path() == before


GQA = ModelGeometry("tiny-gqa", 4, 2, 64, torch.float32, 32)


def test_hooks_mode_needs_a_layerwise_connector_and_kvlabs_backend() -> None:
    with pytest.raises(ValueError, match='hooks: true drives a layerwise connector.*"layerwise": true'):
        ConnectorConfig.parse({"hooks": True})
    _, worker = connector_pair(GQA, 8, {"layerwise": True, "hooks": True})
    with pytest.raises(ValueError, match="hooks: true needs kvlab's CPU attention backend.*VLLM_PLUGINS"):
        register_cache(worker, "vllm>=0.29 CPU_LBHNC", GQA, 8)


@pytest.mark.parametrize("variant", ["vllm>=0.29 CPU_LBHNC", "vllm>=0.29 BLHNC"])
def test_layerwise_saves_copy_each_layer_right_after_its_attention(variant: str) -> None:
    """Each layer is copied out when save_kv_layer is called for it: a layer overwritten
    after its own call (as a later step would) is stored as it was at that call."""
    scheduler, worker = connector_pair(GQA, 16, {"layerwise": True, "async_saves": False})
    register_cache(worker, variant, GQA, 16)
    for tensor in worker.cache.storage:
        tensor.view(torch.int32).random_()
    names = list(worker.cache.layers)
    blocks = [3, 7, 1, 12]
    before = {name: worker.cache.layers[name][blocks].view(torch.int32).clone() for name in names}
    original_save = worker.worker.save_layer

    def save_then_overwrite(layer_name, kv_layer, meta):  # the layer changes once it was handed over
        original_save(layer_name, kv_layer, meta)
        worker.cache.layers[layer_name].zero_()

    worker.worker.save_layer = save_then_overwrite
    prompt = list(range(4 * GQA.block_size + 1))
    prefill(scheduler, worker, "a", prompt, blocks + [0], layerwise=True)
    assert worker.stats.saved_blocks == 4 and worker.stats.save_errors == 0
    assert worker.stats.save_segments == 4 * GQA.num_layers, "one run per block and layer, layer by layer"
    worker.worker.save_layer = original_save
    assert prefill(scheduler, worker, "b", prompt, [9, 2, 14, 5, 0], layerwise=True)["hit_tokens"] == 4 * GQA.block_size
    for name in names:
        assert torch.equal(worker.cache.layers[name][[9, 2, 14, 5]].view(torch.int32), before[name]), name


def test_a_layer_save_of_other_memory_is_refused() -> None:
    scheduler, worker = connector_pair(GQA, 16, {"layerwise": True, "async_saves": False})
    register_cache(worker, "vllm>=0.29 CPU_LBHNC", GQA, 16)
    first, second = list(worker.cache.layers)[:2]
    original_save = worker.worker.save_layer

    def swapped(layer_name, kv_layer, meta):
        other = second if layer_name == first else first
        original_save(layer_name, worker.cache.layers[other], meta)

    worker.worker.save_layer = swapped
    with pytest.raises(ValueError, match="is not that layer of the registered CPU_LBHNC cache"):
        prefill(scheduler, worker, "a", list(range(2 * GQA.block_size + 1)), [1, 2, 3], layerwise=True)
