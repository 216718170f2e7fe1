"""What the connector reads off vLLM's config: the KV geometry of one worker's cache, and
whether this is vLLM's CPU platform. Imports vLLM."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvlab.cache.geometry import ModelGeometry, parse_dtype
from kvlab.cache.quant import QUANTS

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def engine_geometry(vllm_config: VllmConfig, num_layers: int | None = None,
                    dtype: torch.dtype | None = None) -> ModelGeometry:
    """One worker's KV geometry (its share of the kv heads under tensor parallelism), in the
    quantized format the cache dtype names where kvlab knows it; ``num_layers`` and
    ``dtype`` default to the model's."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    block_size = vllm_config.cache_config.block_size
    num_layers = num_layers if num_layers is not None else model.get_num_layers(parallel)
    quant = QUANTS.get(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    dtype = quant.storage if quant else dtype if dtype is not None else parse_dtype(model.dtype)
    name = Path(str(model.model)).name
    if model.use_mla:
        text = model.hf_text_config
        return ModelGeometry.mla(name, num_layers, text.kv_lora_rank, text.qk_rope_head_dim,
                                 dtype=dtype, block_size=block_size)
    return ModelGeometry(name, num_layers, model.get_num_kv_heads(parallel), model.get_head_size(), dtype, block_size,
                         quant=quant)


def total_kv_heads(vllm_config: VllmConfig) -> int | None:
    """The model's kv heads, every tensor-parallel rank's together, where the ranks split
    them by head; None for an MLA latent (the same on every rank)."""
    model = vllm_config.model_config
    return None if model.use_mla else int(model.get_total_num_kv_heads())


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def uses_mla(vllm_config: Any) -> bool:
    """Whether the engine's model keeps an MLA latent cache."""
    model_config = getattr(vllm_config, "model_config", None)
    return bool(getattr(model_config, "use_mla", False))
