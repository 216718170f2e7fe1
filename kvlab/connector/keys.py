"""What a block's key covers besides its tokens: the model's weights, dtypes and block size,
and per request exactly what vLLM keys its own prefix cache with (LoRA adapter,
multimodal inputs, cache salt, prompt embeddings). Imports vLLM."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

from kvlab.store.keys import folder_fingerprint

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys


def model_seed(vllm_config: VllmConfig) -> str:
    """What decides every block's KV besides its tokens: the model's weights (a fingerprint
    of its folder, so new weights at the same path are misses, not stale KV), the dtypes,
    the block size and the model options that change the computation."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    weights = folder_fingerprint(model.model) or _hub_fingerprint(str(model.model), getattr(model, "revision", None))
    options = {name: getattr(model, name, None) for name in ("quantization", "hf_overrides")}
    return (f"{model.model}|weights={weights}|{model.dtype}|{cache.cache_dtype}|bs{cache.block_size}"
            f"|{sorted((k, repr(v)) for k, v in options.items())}")


def _hub_fingerprint(model: str, revision: str | None) -> str:
    """A hub model's snapshot in the local cache (named by its commit), else its id and
    revision: vLLM loads hub models from there."""
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(model, revision=revision, local_files_only=True)
    except Exception:  # not a hub id, or not cached: the name and revision are all there is
        return f"{model}@{revision}"
    return f"{Path(folder).name}:{folder_fingerprint(folder)}"


@functools.lru_cache(maxsize=256)
def _adapter_key(name: str, int_id: int, path: str) -> bytes:
    return repr(("lora", name, int_id, path, folder_fingerprint(path))).encode()


def request_keys(request: Request, block_size: int) -> list[bytes | None] | None:
    """Per full prompt block, what else decides its KV in this request, exactly as vLLM
    keys its own prefix cache (vLLM's generate_block_hash_extra_keys: the LoRA adapter,
    multimodal inputs in the block, the cache salt on the first block, prompt embeddings),
    plus the adapter's id and a fingerprint of its files. None for a plain request."""
    if not any(getattr(request, name, None) for name in ("lora_request", "mm_features", "cache_salt", "prompt_embeds")):
        return None
    lora = request.lora_request
    adapter = _adapter_key(lora.lora_name, lora.lora_int_id, str(lora.lora_path)) if lora else b""
    keys, mm_index = [], 0
    for start in range(0, len(request.prompt_token_ids or []) - block_size + 1, block_size):
        extra, mm_index = generate_block_hash_extra_keys(request, start, start + block_size, mm_index)
        keys.append(adapter + (repr(extra).encode() if extra else b""))
    return keys
