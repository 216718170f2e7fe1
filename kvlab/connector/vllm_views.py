"""vLLM as the oracle: the per-layer views the installed vLLM (>= 0.29) itself builds.

Calls vLLM's own ``get_kv_cache_config_from_groups`` (kvlab.connector.vllm_versions finds it in
each release) and ``allocate_kv_cache`` with a
small stand-in config, so kvlab's layouts can be checked against vLLM view by view.
Imports vLLM only when called.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvlab.cache.allocation import layer_name
from kvlab.cache.geometry import ModelGeometry
from kvlab.cache.layouts import VLLM_V29_LAYOUTS
from kvlab.connector.vllm_versions import kv_cache_config_from_groups


def vllm_layer_views(layout: str, geometry: ModelGeometry, num_blocks: int) -> dict[str, torch.Tensor]:
    """The per-layer KV views vLLM allocates for ``layout`` (one of its KVCacheLayout names)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    name = layout.removeprefix("CPU_")
    if name not in VLLM_V29_LAYOUTS:
        raise ValueError(f"vLLM builds only {list(VLLM_V29_LAYOUTS)}, not {layout!r}")
    vllm_layout = KVCacheLayout[name]
    spec_type = MLAAttentionSpec if geometry.is_mla else FullAttentionSpec
    spec = spec_type(
        block_size=geometry.block_size,
        num_kv_heads=geometry.num_kv_heads,
        head_size=geometry.head_size,
        dtype=geometry.dtype,
    )
    names = [layer_name(i) for i in range(geometry.num_layers)]
    config = SimpleNamespace(
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: vllm_layout,
            num_gpu_blocks_override=num_blocks,
            prefix_cache_retention_interval=None,
        ),
        attention_config=SimpleNamespace(hisparse_config=None),
    )
    kv_config = kv_cache_config_from_groups()(
        config, [KVCacheGroupSpec(names, spec)], num_blocks * geometry.block_bytes
    )
    return allocate_kv_cache(kv_config, torch.device("cpu"), vllm_layout)
