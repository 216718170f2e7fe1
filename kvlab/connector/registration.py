"""What a worker of KVLabConnector works out when it registers its cache: its tensor-parallel
rank, its copy method, the contiguous runs one block occupies (what a one-copy-per-run engine
would issue), and what became of a cross-layer request, for its registration line."""

from __future__ import annotations

import functools

from kvlab.cache.allocation import KVCache, allocate
from kvlab.cache.geometry import ModelGeometry
from kvlab.connector.geometry import on_cpu
from kvlab.transfer.engine import host_buffer
from kvlab.transfer.plan import HeadSlice, copy_plan
from kvlab.transfer.registry import method_status, preferred_methods

def copy_method(asked: str, cache: KVCache) -> str:
    """The copy method for ``cache``: ``asked``, checked, or for "auto" the most preferred
    one that runs here (each method declares its CopyMethod.preference). ValueError naming
    why when none does."""
    buffer = host_buffer(cache, 1)
    why = "no copy method declares a preference for 'auto'"
    for name in preferred_methods() if asked == "auto" else (asked,):
        why = method_status(name, cache, buffer)
        if why is None:
            return name
    raise ValueError(f"KVLabConnector: method {asked!r} cannot run here: {why}")


@functools.lru_cache(maxsize=32)
def runs_per_block(layout: str, geometry: ModelGeometry, num_blocks: int, per_layer: bool,
                   stored_as: str | None = None, stored_geometry: ModelGeometry | None = None,
                   heads: HeadSlice | None = None) -> int:
    """Contiguous runs one cache block's copy to or from a block of a buffer takes (summed
    over layers when ``per_layer``: a layer-by-layer copy cannot merge across layers), the
    buffer in the cache's own layout or in ``stored_as`` (a chunk of another layout,
    converted: the finer layout's runs), of ``stored_geometry`` with ``heads`` taken from it
    (a shard another tensor-parallel size stored). Planned on the meta device."""
    cache = allocate(layout, geometry, num_blocks, "meta")
    # a chunk of another layout as one of two blocks: a one-block chunk's layers would lie back to back
    one = allocate(layout, geometry, 1, "meta") if stored_as is None \
        else allocate(stored_as, stored_geometry or geometry, 2, "meta")
    if not per_layer:
        return copy_plan(one, [0], cache, [0], heads=heads).segments
    return sum(copy_plan(one, [0], cache, [0], [i], heads).segments for i in range(geometry.num_layers))


def tensor_parallel_rank() -> tuple[int, int]:
    """(rank, workers) of this worker; (0, 1) outside a vLLM worker."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except (AssertionError, ImportError):
        return 0, 1


def cross_layer_decision(asked: bool, cache: KVCache) -> str:
    """What became of ``enable_cross_layers_blocks``, and why, for the registration line."""
    if not asked:
        return "cross-layer blocks not asked for"
    if cache.layout.is_cross_layer:
        return "cross-layer blocks asked for and granted"
    if cache.geometry.is_mla:
        why = ("an MLA latent cache stays layer-major (vLLM's RFC #45997; CPU_MLA's cache update views each layer "
               "as one [tokens, C] matrix, which a block-major buffer cannot give)")
    elif on_cpu():
        from kvlab.connector.backend import installed

        why = ("vLLM's CPU_ATTN declares LBHNC only and kvlab's attention backend is not loaded: VLLM_PLUGINS "
               "leaves out 'kvlab', or kvlab is not installed in this environment" if not installed()
               else "VLLM_KV_CACHE_LAYOUT or another attention group chose a layer-major layout")
    else:
        why = "this platform's attention backends do not all declare BLHNC"
    return f"cross-layer blocks asked for, given per-layer {cache.layout.name}: {why}"
