"""vLLM as the oracle: the per-layer views the installed vLLM (>= 0.29) itself builds.

Calls vLLM's own ``get_kv_cache_config_from_groups`` (kvlab.connector.vllm_versions finds it in
each release) and ``allocate_kv_cache`` with a
small stand-in config, so kvlab's layouts can be checked against vLLM view by view; for a
quantized cache, with the spec its attention backend makes (``customize_spec``) and the
views its attention reads the scales through. Imports vLLM only when called.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch

from kvlab.cache.allocation import layer_name
from kvlab.cache.geometry import ModelGeometry
from kvlab.cache.hybrid import HybridGeometry
from kvlab.cache.layouts import LAYOUTS, VLLM_V29_LAYOUTS
from kvlab.connector.vllm_versions import kv_cache_config_from_groups


def vllm_layer_views(layout: str, geometry: ModelGeometry, num_blocks: int) -> dict[str, torch.Tensor]:
    """The per-layer KV views vLLM allocates for ``layout`` (one of its KVCacheLayout names)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    name = LAYOUTS[layout].vllm_order if layout in LAYOUTS else ""
    if not name:
        raise ValueError(f"vLLM builds only {list(VLLM_V29_LAYOUTS)} (and the layouts read from them), not {layout!r}")
    vllm_layout = KVCacheLayout[name]
    spec_type = MLAAttentionSpec if geometry.is_mla else FullAttentionSpec
    spec = spec_type(
        block_size=geometry.block_size,
        num_kv_heads=geometry.num_kv_heads,
        head_size=geometry.head_size,
        dtype=geometry.dtype,
    )
    if geometry.quant is not None:
        spec = quantized_spec(spec, geometry.quant.name)
    names = [layer_name(i) for i in range(geometry.num_layers)]
    kv_config = kv_cache_config_from_groups()(
        _stand_in(vllm_layout, num_blocks), [KVCacheGroupSpec(names, spec)], num_blocks * geometry.block_bytes
    )
    return allocate_kv_cache(kv_config, torch.device("cpu"), vllm_layout)


def _stand_in(layout: Any, num_blocks: int) -> SimpleNamespace:
    """The parts of a VllmConfig that vLLM's KV cache planning reads."""
    return SimpleNamespace(
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: layout,
            num_gpu_blocks_override=num_blocks,
            prefix_cache_retention_interval=None,
        ),
        attention_config=SimpleNamespace(hisparse_config=None),
    )


def vllm_hybrid(hybrid: HybridGeometry, layout: str, num_blocks: int) -> tuple[Any, dict[str, torch.Tensor]]:
    """vLLM's KV cache config (its ``kv_cache_layout`` set, as the engine core sets it) and
    per-layer views for a hybrid model's groups, from its own planning and allocator."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    groups = []
    for group in hybrid.groups:
        if group.is_attention:
            g = group.geometry
            shape = dict(block_size=g.block_size, num_kv_heads=g.num_kv_heads, head_size=g.head_size, dtype=g.dtype)
            spec = SlidingWindowSpec(**shape, sliding_window=group.window) if group.window else FullAttentionSpec(**shape)
        else:
            block_size = next(g.geometry.block_size for g in hybrid.groups if g.is_attention)
            spec = MambaSpec(block_size=block_size, shapes=((group.content,),), dtypes=(torch.int8,),
                             page_size_padded=group.page if group.page != group.content else None)
        groups.append(KVCacheGroupSpec([layer_name(i) for i in group.layers], spec))
    vllm_layout = KVCacheLayout[layout]
    room = num_blocks * sum(len(group.layers) * group.page for group in hybrid.groups)  # enough for any placement
    kv_config = kv_cache_config_from_groups()(_stand_in(vllm_layout, num_blocks), groups, room)
    kv_config.kv_cache_layout = layout
    return kv_config, allocate_kv_cache(kv_config, torch.device("cpu"), vllm_layout)


def quantized_spec(spec: Any, kv_cache_dtype: str) -> Any:
    """The spec vLLM's attention backend makes of a quantized cache: TRITON_ATTN's own
    ``customize_spec`` for per-token-head scales; for NVFP4, FLASHINFER's rule (its module
    needs flashinfer, so the rule is written out from ``FlashInferBackend.customize_spec``
    around vLLM's own ``nvfp4_kv_cache_full_dim``)."""
    from vllm.utils.torch_utils import nvfp4_kv_cache_full_dim
    from vllm.v1.kv_cache_interface import get_kv_quant_mode

    mode = get_kv_quant_mode(kv_cache_dtype)
    spec = dataclasses.replace(spec, kv_quant_mode=mode)
    if kv_cache_dtype in ("int8_per_token_head", "fp8_per_token_head"):
        from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

        return TritonAttentionBackend.customize_spec(spec)
    if kv_cache_dtype == "nvfp4":
        return dataclasses.replace(spec, num_head_slots=2 * spec.num_kv_heads,
                                   state_content_bytes=nvfp4_kv_cache_full_dim(spec.head_size))
    raise ValueError(f"vLLM builds no {kv_cache_dtype} cache (kvlab.cache.quant names whose format it is)")


def vllm_byte_views(layer: torch.Tensor, kv_cache_dtype: str, num_kv_heads: int) -> dict[tuple[str, str], torch.Tensor]:
    """Where vLLM's attention reads each kind of bytes of one layer's view, as byte views
    ``[block, token, head, bytes]`` by (part, kind): the per-token-head scales as
    ``TritonAttentionImpl._ensure_scale_caches`` cuts them; NVFP4 values and scales as
    FLASHINFER's ``_nvfp4_kv_views`` cuts each side (its source, run here: its module needs
    flashinfer) and ``nvfp4_split_data_scale`` splits it."""
    if kv_cache_dtype == "nvfp4":
        from vllm.utils.torch_utils import nvfp4_split_data_scale

        sides = vllm_function("vllm.v1.attention.backends.flashinfer", "_nvfp4_kv_views",
                              {"torch": torch, "nvfp4_split_data_scale": nvfp4_split_data_scale, "_KVPair": tuple})
        (k_data, v_data), (k_scale, v_scale), order = sides(layer, num_kv_heads)
        views = {("K", "payload"): k_data, ("V", "payload"): v_data, ("K", "scale"): k_scale, ("V", "scale"): v_scale}
        return {key: _as_bytes(v if order == "NHD" else v.transpose(1, 2)) for key, v in views.items()}
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    holder = SimpleNamespace(_k_scale_cache=None)
    TritonAttentionImpl._ensure_scale_caches(holder, layer)
    return {("K", "scale"): _as_bytes(holder._k_scale_cache[..., None]),
            ("V", "scale"): _as_bytes(holder._v_scale_cache[..., None])}


def _as_bytes(view: torch.Tensor) -> torch.Tensor:
    """A [block, token, head, n] view of any 1- or 4-byte type as the same bytes, uint8."""
    size = view.element_size()
    strides = [s * size for s in view.stride()[:3]] + [1]
    shape = [*view.shape[:3], view.shape[3] * size]
    raw = torch.empty(0, dtype=torch.uint8).set_(view.untyped_storage())
    return raw.as_strided(shape, strides, view.storage_offset() * size)


def vllm_function(module: str, name: str, namespace: dict[str, Any]) -> Callable:
    """A module-level function of vLLM, compiled from its source file with ``namespace`` as
    its globals: for functions whose module cannot be imported here (flashinfer missing)."""
    path = Path(importlib.util.find_spec(module.split(".")[0]).submodule_search_locations[0])
    source = path.joinpath(*module.split(".")[1:]).with_suffix(".py").read_text()
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    scope = dict(namespace)
    exec(compile(ast.Module([node], []), f"<{module}.{name}>", "exec"), scope)
    return scope[name]
