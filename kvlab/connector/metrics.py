"""KVLabConnector's counters (kvlab.connector.stores.ConnectorStats) through vLLM's own stats
machinery: after every step each side of the connector reports what it counted since its
last report (KVLabStats); vLLM sums the workers' and the scheduler's reports, logs them in
its periodic "KV Transfer metrics: ..." line and records them in Prometheus counters
(KVLabPromMetrics) at ``vllm serve``'s ``/metrics``.

The counters are named ``vllm:kvlab_<counter>`` as vLLM's own connectors name theirs
(``vllm:nixl_*``, ``vllm:kv_offload_*``): vLLM unregisters every ``vllm:`` collector before
it registers its metrics again in a process, so a second server or engine in one process
does not fail on duplicated metrics."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvlab.connector.stores import ConnectorStats

COUNTERS = tuple(f.name for f in fields(ConnectorStats) if f.name != "layout")
# The scheduler side counts lookups and hits, the worker side the rest: in one process (vLLM's
# single-process engine) both sides share one ConnectorStats and each reports only its own.
SCHEDULER_COUNTERS = ("lookups", "hit_tokens", "preemptions")
WORKER_COUNTERS = tuple(name for name in COUNTERS if name not in SCHEDULER_COUNTERS)

PROM_COUNTERS = {
    "hit_tokens": "Prompt tokens KVLabConnector found in its tiers (loaded instead of computed).",
    "loaded_blocks": "KV blocks KVLabConnector loaded into vLLM's cache.",
    "saved_blocks": "KV blocks KVLabConnector saved from vLLM's cache into its tiers.",
    "load_errors": "KVLabConnector loads that failed (vLLM recomputes their blocks).",
    "save_errors": "KVLabConnector saves that failed (nothing stored, the request unaffected).",
    "cancelled_saves": "KVLabConnector saves cancelled because a failed load left their blocks wrong.",
    "fallback_loads": "KVLabConnector chunks loaded from another tier than the one first named.",
    "preemptions": "Requests vLLM preempted while KVLabConnector was configured.",
}
PROM_PREFIX = "vllm:kvlab_"


@dataclass
class KVLabStats(KVConnectorStats):
    """Counter deltas by ConnectorStats field. Only numbers in a plain dict: vLLM pickles the
    object from a worker to the engine core and sends ``to_dict()`` on with msgspec."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.data) - set(COUNTERS))
        if unknown:
            raise ValueError(f"KVLabStats: unknown counters {unknown}; known: {list(COUNTERS)}")
        self.data = {name: self.data.get(name, 0) for name in COUNTERS}  # a copy: vLLM's dict stays as sent

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0)

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def aggregate(self, other: KVConnectorStats) -> KVLabStats:
        """Add ``other`` in place (vLLM sums the workers' reports, then the scheduler's)."""
        if not isinstance(other, KVLabStats):
            raise TypeError(f"KVLabStats cannot aggregate a {type(other).__name__}")
        for name, value in other.data.items():
            self.data[name] += value
        return self

    def reduce(self) -> dict[str, int | float]:
        """vLLM's periodic log line (lookups say why a line of no hits was printed); load/save
        ms are what the model runner blocked on."""
        data = self.data
        return {
            "lookups": data["lookups"], "hit_tokens": data["hit_tokens"], "loaded_blocks": data["loaded_blocks"],
            "saved_blocks": data["saved_blocks"], "load_errors": data["load_errors"],
            "save_errors": data["save_errors"], "load_ms": round(data["load_seconds"] * 1e3, 1),
            "save_ms": round(data["save_seconds"] * 1e3, 1),
        }


class CounterDeltas:
    """What ``names`` of ``stats`` grew by since the last ``take()`` (or since this object was
    made: an earlier connector's counts in this process are not reported again)."""

    def __init__(self, stats: ConnectorStats, names: tuple[str, ...]) -> None:
        self.stats, self.names = stats, names
        self._last = self._now()

    def _now(self) -> dict[str, int | float]:
        return {name: getattr(self.stats, name) for name in self.names}

    def take(self) -> KVLabStats | None:
        """The deltas, None when nothing changed (vLLM then sends no stats for this side)."""
        now = self._now()  # read once: a save thread may count on while this runs
        delta = KVLabStats({name: now[name] - self._last[name] for name in self.names})
        self._last = now
        return None if delta.is_empty() else delta


class KVLabPromMetrics(KVConnectorPromMetrics):
    """PROM_COUNTERS as Prometheus counters, one child per engine (vLLM's labels)."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            name: create_metric_per_engine(
                self._counter_cls(name=PROM_PREFIX + name, documentation=doc, labelnames=labelnames),
                self.per_engine_labelvalues)
            for name, doc in PROM_COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, per_engine in self.counters.items():
            if transfer_stats_data[name]:
                per_engine[engine_idx].inc(transfer_stats_data[name])
