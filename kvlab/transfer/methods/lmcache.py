"""``lmcache`` (a peer): LMCache's own ``multi_layer_kv_transfer`` between a vLLM per-layer
NHD cache and a KV_2LTD / KV_MLA_FMT chunk (its torch fallback on a CPU, its CUDA kernels
on a GPU). Imports LMCache only when asked for."""

from __future__ import annotations

import os
from math import prod
from typing import TYPE_CHECKING

import torch

from kvlab.cache.allocation import KVCache, axis_sizes, layer_name
from kvlab.cache.layouts import LAYOUTS
from kvlab.transfer.common import device_of
from kvlab.transfer.registry import CopyMethod, register

if TYPE_CHECKING:
    from kvlab.transfer.engine import Transfer


def _lmcache_sides(src: KVCache, dst: KVCache) -> tuple[KVCache, KVCache, bool] | None:
    """(paged cache, chunk, into_chunk) when LMCache's transfer functions cover the pair:
    a paged layout and its LMCache peer format (Layout.lmcache_peer)."""
    for paged, chunk, into in ((src, dst, True), (dst, src, False)):
        if paged.layout.lmcache_peer is not None and paged.layout.lmcache_peer == chunk.layout.name:
            return paged, chunk, into
    return None


def unavailable(src: KVCache, dst: KVCache) -> str | None:
    if _lmcache_sides(src, dst) is None:
        return (
            "LMCache's multi_layer_kv_transfer moves a vLLM per-layer NHD cache "
            f"({', '.join(n for n, layout in LAYOUTS.items() if layout.lmcache_peer)}) to or from its "
            f"KV_2LTD / KV_MLA_FMT chunk, not {src.layout.name} -> {dst.layout.name}"
        )
    if src.geometry.itemsize == 1 and "cpu" == device_of(src).type == device_of(dst).type:
        return "LMCache's CPU fallback cannot copy fp8 caches (torch has no CPU index_copy_ for float8)"
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    try:
        import lmcache  # noqa: F401
        from lmcache import device_ops  # noqa: F401
    except Exception as error:  # ImportError, or its backend failing to load
        return f"lmcache is not usable here ({type(error).__name__}: {error})"
    return None


def copy_lmcache(t: Transfer) -> None:
    from lmcache import device_ops
    from lmcache.lmcache_native import TransferDirection
    from lmcache.utils import EngineType
    from lmcache.v1.gpu_connector.utils import normalize_kv_and_discover_format

    paged, chunk, into_chunk = _lmcache_sides(t.src, t.dst)
    paged_blocks, chunk_blocks = (t.src_blocks, t.dst_blocks) if into_chunk else (t.dst_blocks, t.src_blocks)
    g = paged.geometry
    kv_format, layers = normalize_kv_and_discover_format(
        [paged.layers[layer_name(i)] for i in range(g.num_layers)], EngineType.VLLM,
        layout_hints={"kv_layout": "NHD", "num_kv_heads": g.num_kv_heads, "tokens_per_block": g.block_size},
    )
    device = device_of(paged)
    slots = torch.full((chunk.num_blocks * g.block_size,), -1, dtype=torch.int64)
    within = torch.arange(g.block_size)
    for c, p in zip(chunk_blocks, paged_blocks):
        slots[c * g.block_size:(c + 1) * g.block_size] = p * g.block_size + within
    if device.type == "cpu":  # the torch fallback takes the layers shaped as its page buffers (Layout.lmcache_pages)
        sizes = axis_sizes(paged.layout, g, paged.num_blocks)
        shape = [prod(sizes[axis] for axis in group) for group in paged.layout.lmcache_pages[:-1]] + [-1]
        pointers = [x.view(shape) for x in layers]
    else:
        pointers = torch.tensor([x.data_ptr() for x in layers], device=device)
    device_ops.multi_layer_kv_transfer(
        chunk.storage[0], pointers, slots.to(device), device, paged.num_blocks * g.block_size,
        TransferDirection.D2H if into_chunk else TransferDirection.H2D, kv_format,
        block_size=g.block_size, head_size=g.head_size,
    )


register(CopyMethod("lmcache", copy_lmcache, colour="#E69F00", unavailable=unavailable, peer=True, rank=50))
