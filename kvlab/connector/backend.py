"""kvlab's attention backend for vLLM's CPU build: CPU_ATTN's own kernels, reading every
KV cache layout they can, and (in hooks mode) calling kvlab.hooks around attention as
vllm-ascend's attention does.

CPU_ATTN declares LBHNC only, so vLLM drops a connector's cross-layer request on a CPU.
Its kernels follow the cache's block and head strides (tests/connector/test_cpu_backend.py
proves it bitwise), so a per-layer view of a block-major buffer is read as it is: this
backend declares the head-major layouts, LBHNC first, and changes nothing else. A run that
asks for no other layout therefore gets LBHNC and the same kernels, bitwise the same
outputs. The NHD layouts (LBNHC, BLNHC) cannot be viewed as CPU_ATTN's [2*BS, D] pages.

Installed with kvlab as the ``vllm.general_plugins`` entry point ``kvlab``, so every vLLM
process (engine core, workers) loads it; ``VLLM_PLUGINS`` without ``kvlab`` turns it off."""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvlab.hooks import connector_active, maybe_save_kv_layer_to_connector, wait_for_kv_layer_from_connector

READABLE_LAYOUTS = ("LBHNC", "LHBNC", "BLHNC", "BHLNC")  # the default first: vLLM prefers it


def register() -> None:
    """The plugin: kvlab's backend in CPU_ATTN's place, on vLLM's CPU build only."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, f"{__name__}.KVLabCPUAttentionBackend")


def installed() -> bool:
    """Whether vLLM's CPU attention in this process is kvlab's backend."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum.CPU_ATTN.get_class() is KVLabCPUAttentionBackend


class KVLabCPUAttentionBackend(CPUAttentionBackend):
    """CPU_ATTN, declaring every layout its kernels read."""

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return tuple(KVCacheLayout[name] for name in READABLE_LAYOUTS)

    @staticmethod
    def get_impl_cls() -> type[KVLabCPUAttentionImpl]:
        return KVLabCPUAttentionImpl


def kv_pair(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's (k_cache, v_cache), as CPU_ATTN's forward splits its packed pages: what
    vllm-ascend's attention hands its connector."""
    num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, -1).chunk(2, dim=2)
    return key_cache, value_cache


def hooked_connector() -> Any:
    """vLLM's active connector when it asks for the hooks (KVLabConnector with
    ``"hooks": true``), else None."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    connector = get_kv_transfer_group()
    config = getattr(connector, "config", None)
    return connector if getattr(config, "hooks", False) else None


class KVLabCPUAttentionImpl(CPUAttentionBackendImpl):
    """CPU_ATTN's forward; in hooks mode wrapped as vllm-ascend wraps its attention: wait for
    this layer's KV before, hand the layer's ``(k, v)`` tuple and the step's single metadata
    object (not a per-layer dict) to the connector after."""

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: Any, output: torch.Tensor, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        connector = hooked_connector() if attn_metadata is not None else None
        if connector is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        with connector_active(connector, attn_metadata):
            wait_for_kv_layer_from_connector(layer.layer_name)
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                            output_block_scale)
            maybe_save_kv_layer_to_connector(layer.layer_name, kv_pair(kv_cache))
        return output
