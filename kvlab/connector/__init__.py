"""KVLabConnector, a vLLM v1 KV connector, and what runs it. Imports vLLM.

Load it with ``kv_connector="KVLabConnector"``, ``kv_connector_module_path="kvlab.connector"``,
``kv_role="kv_both"`` and, optionally, ``kv_connector_extra_config`` (see ConnectorConfig).
The scheduler side owns the index (scheduler, index), the workers own the KV (worker),
and they exchange only keys and block ids (messages). ``kvlab.connector.vllm_views`` builds vLLM's own per-layer views; ``kvlab.connector.backend``
is kvlab's CPU attention backend (a vLLM plugin) that reads block-major caches and calls
kvlab.hooks from its forward. ``kvlab.harness.driver`` drives the connector as vLLM's
scheduler and each runner generation do, without an engine.
"""

from __future__ import annotations

from kvlab._lazy import lazy_names

# Each name loads its module on first use: vLLM's getattr(kvlab.connector, "KVLabConnector")
# loads the connector (and vLLM), while the worker side (kvlab.connector.worker) imports with
# torch alone, where vLLM is not installed (scripts/device-check runs it on a GPU).
_WHERE = {
    **dict.fromkeys(("CROSS_LAYER_LAYOUT", "ConnectorConfig"), "kvlab.connector.config"),
    "KVLabConnector": "kvlab.connector.connector",
    **dict.fromkeys(("model_seed", "request_keys"), "kvlab.connector.keys"),
    **dict.fromkeys(("KVLabMetadata", "KVLabWorkerMeta", "LoadSpec", "SaveSpec", "Source"), "kvlab.connector.messages"),
    **dict.fromkeys(("ConnectorStats", "all_stats", "reset_stores", "shared", "worker_stores"), "kvlab.connector.stores"),
    "runs_per_block": "kvlab.connector.registration",
}
__all__ = sorted(_WHERE)


__getattr__, __dir__ = lazy_names("kvlab.connector", _WHERE, globals())
