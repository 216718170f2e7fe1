"""The ``kv_transfer_config`` of each connector kvlab runs vLLM with: KVLabConnector,
vLLM's ExampleConnector, LMCacheMPConnector (on an ``lmcache server``), or none."""

from __future__ import annotations

from pathlib import Path
from typing import Any

CONNECTORS = ("none", "kvlab", "example", "lmcache")

# Seconds LMCacheMPConnector waits for each reply of its server (its default, 300, turns a
# dead server into a hang of minutes; after this it recomputes, see kvlab.runtime.lmcache).
LMCACHE_MQ_TIMEOUT = 10.0


def kv_transfer_config(connector: str, extra: dict[str, Any] | None = None, workdir: str | Path | None = None) -> dict | None:
    """The ``kv_transfer_config`` of an engine: KVLabConnector, vLLM's ExampleConnector
    (files under ``workdir``), LMCacheMPConnector or none.

    For "lmcache", ``extra`` is ``{"port": P}``, the port of the ``lmcache server`` on
    127.0.0.1 (kvlab.runtime.lmcache.LMCacheServer runs one and gives this dict); its other keys
    are LMCacheMPConnector options without their "lmcache.mp." prefix ("mq_timeout"
    defaults to LMCACHE_MQ_TIMEOUT).
    """
    if connector not in CONNECTORS:
        raise ValueError(f"connector must be one of {list(CONNECTORS)}, got {connector!r}")
    if connector == "none":
        return None
    if connector == "lmcache":
        options = {"mq_timeout": LMCACHE_MQ_TIMEOUT, **(extra or {})}
        if "port" not in options:
            raise ValueError("the lmcache connector needs the LMCache server's port: extra={'port': P} "
                             "(kvlab.runtime.lmcache.LMCacheServer.engine_extra gives it)")
        port = int(options.pop("port"))
        return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",  # vLLM's default fails the request
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port,
                                              **{f"lmcache.mp.{key}": value for key, value in options.items()}}}
    if connector == "kvlab":
        return {"kv_connector": "KVLabConnector", "kv_connector_module_path": "kvlab.connector",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",  # a failed load is recomputed
                "kv_connector_extra_config": dict(extra or {})}
    if workdir is None:
        raise ValueError("ExampleConnector needs a workdir for its files")
    return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(workdir), **(extra or {})}}
