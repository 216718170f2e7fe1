"""KVLabConnector, a vLLM v1 KV connector, and what runs it. Imports vLLM.

Load it with ``kv_connector="KVLabConnector"``, ``kv_connector_module_path="kvlab.connector"``,
``kv_role="kv_both"`` and, optionally, ``kv_connector_extra_config`` (see ConnectorConfig).
The scheduler side owns the index (scheduler, index), the workers own the KV (worker),
and they exchange only keys and block ids (messages). ``kvlab.connector.vllm_views`` builds vLLM's own per-layer views; ``kvlab.connector.backend``
is kvlab's CPU attention backend (a vLLM plugin) that reads block-major caches and calls
kvlab.hooks from its forward. ``kvlab.testing.driver`` drives the connector as vLLM's
scheduler and each runner generation do, without an engine.
"""

from kvlab.connector.config import CROSS_LAYER_LAYOUT, TIERS, ConnectorConfig
from kvlab.connector.connector import KVLabConnector
from kvlab.connector.keys import model_seed, request_keys
from kvlab.connector.messages import KVLabMetadata, KVLabWorkerMeta, LoadSpec, SaveSpec, Source
from kvlab.connector.stores import ConnectorStats, all_stats, reset_stores, shared, worker_stores
from kvlab.connector.worker import runs_per_block

__all__ = [
    "CROSS_LAYER_LAYOUT", "TIERS", "ConnectorConfig", "ConnectorStats", "KVLabConnector", "KVLabMetadata",
    "KVLabWorkerMeta", "LoadSpec", "SaveSpec", "Source", "all_stats", "model_seed",
    "request_keys", "reset_stores", "runs_per_block", "shared", "worker_stores",
]
