"""The caches KVLabConnector refuses, and what a refused connector does: nothing.

A chunk holds every layer's KV of some blocks, so the connector moves a cache of one KV
cache group of attention K and V. A hybrid model's groups (full attention, sliding window,
Mamba/GDN state) share one buffer and one block id means another group's content in each
group (kvlab.cache.hybrid): a chunk of the attention layers alone would be partial, and a
sliding-window group frees the blocks it no longer attends to. A quantized cache whose
rows kvlab has no layout for cannot be read correctly either. Both sides (the scheduler
and every worker) decide from vLLM's KV cache config alone, so they agree without a word:
the scheduler finds no hits and plans no saves, the worker registers nothing; the engine
runs as without a connector."""

from __future__ import annotations

from typing import Any

from kvlab.cache.quant import QUANTS
from kvlab.connector.messages import KVLabMetadata

# vLLM's kv_cache_dtype values whose caches are laid out as kvlab knows them: unquantized,
# fp8 per tensor, and the quantized formats of kvlab.cache.quant that vLLM builds.
PLAIN_CACHE_DTYPES = ("auto", "float16", "bfloat16", "float32", "half", "float", "fp8", "fp8_e4m3", "fp8_e5m2")
_KINDS = {"FullAttentionSpec": "full_attention", "MLAAttentionSpec": "full_attention (MLA)",
          "SlidingWindowSpec": "sliding_window", "MambaSpec": "mamba"}


def cache_refusal(vllm_config: Any, kv_cache_config: Any) -> str | None:
    """Why this engine's KV cache cannot be moved correctly (naming its layout and groups),
    or None when it can."""
    layout = getattr(kv_cache_config, "kv_cache_layout", None) or "its default layout"
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    kinds = [_kind(group.kv_cache_spec) for group in groups]
    if len(groups) > 1 or any(kind not in ("full_attention", "full_attention (MLA)") for kind in kinds):
        described = ", ".join(f"{kind} ({len(group.layer_names)} layers)" for kind, group in zip(kinds, groups))
        others = sorted({kind for kind in kinds if not kind.startswith("full_attention")}) or ["the other"]
        return (f"a hybrid KV cache ({layout}): {len(groups)} KV cache group(s) share one buffer: {described}; "
                f"a chunk holds one group's attention K and V, so the {' and '.join(others)} group(s)' blocks would "
                f"be left out and every chunk would be partial")
    dtype = getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto") or "auto"
    if dtype not in PLAIN_CACHE_DTYPES and dtype not in QUANTS:
        return (f"a KV cache of {dtype} rows ({layout}): kvlab has no layout for them (it knows "
                f"{sorted(QUANTS)}), so it cannot tell which bytes are whose")
    return None


def _kind(spec: Any) -> str:
    """A group's kind by its spec's class (or the nearest one kvlab names)."""
    for cls in type(spec).__mro__:
        if cls.__name__ in _KINDS:
            return _KINDS[cls.__name__]
    return type(spec).__name__


class RefusedScheduler:
    """The scheduler side of a refused connector: no hits, no saves, nothing held."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVLabMetadata:
        return KVLabMetadata()

    def update_connector_output(self, worker_meta: Any) -> None:
        pass

    def request_finished(self, request: Any) -> tuple[bool, None]:
        return False, None

    def has_pending_work(self) -> bool:
        return False

    def reset_cache(self) -> bool:
        return True

    def shutdown(self) -> None:
        pass
