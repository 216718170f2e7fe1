"""KVLabConnector's counters through vLLM's stats machinery (kvlab.connector.metrics): each
side reports only what it counted since its last report, the reports survive the trips vLLM
sends them on (pickle, msgspec), sum as vLLM sums them, and reach vLLM's own log line and
Prometheus counters. ``vllm serve``'s /metrics: tests/integration/test_serve.py."""

from __future__ import annotations

import functools
import pickle
import re

import msgspec
import pytest
import torch

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorStats  # noqa: E402

from kvlab.cache import ModelGeometry  # noqa: E402
from kvlab.connector import KVLabConnector  # noqa: E402
from kvlab.connector.metrics import COUNTERS, KVLabStats  # noqa: E402
from kvlab.harness.driver import connector_pair, prefill, register, stand_in_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_stores")

NUM_BLOCKS = 24
GQA = ModelGeometry("tiny-gqa", 4, 2, 64, torch.float32, 16)
BS = GQA.block_size
PROMPT = list(range(7 * BS + 5))  # 7 full blocks


@pytest.fixture
def pair() -> tuple[KVLabConnector, KVLabConnector]:
    """A scheduler and a worker side in one process (sharing one ConnectorStats, as in vLLM's
    single-process engine), a prompt saved and then served from the connector."""
    scheduler, worker = connector_pair(GQA, NUM_BLOCKS)
    register(worker, "vllm>=0.29 CPU_LBHNC", GQA, NUM_BLOCKS)
    prefill(scheduler, worker, "a", PROMPT, [3, 11, 5, 20, 8, 14, 1, 17])
    assert prefill(scheduler, worker, "b", PROMPT, [9, 2, 23, 6, 15, 0, 12, 19])["hit_tokens"] == 7 * BS
    return scheduler, worker


def test_each_side_reports_its_own_counts_once(pair) -> None:
    scheduler, worker = pair
    from_worker, from_scheduler = worker.get_kv_connector_stats(), scheduler.get_kv_connector_stats()
    assert from_worker.data["saved_blocks"] == 7 and from_worker.data["loaded_blocks"] == 7
    assert from_worker.data["hit_tokens"] == from_worker.data["lookups"] == 0  # the scheduler's counters
    assert from_worker.data["load_seconds"] > 0 and from_worker.data["load_errors"] == 0
    assert from_scheduler.data["hit_tokens"] == 7 * BS and from_scheduler.data["lookups"] >= 2
    assert from_scheduler.data["saved_blocks"] == from_scheduler.data["loaded_blocks"] == 0
    assert worker.get_kv_connector_stats() is None and scheduler.get_kv_connector_stats() is None  # nothing new
    prefill(scheduler, worker, "c", PROMPT, [4, 7, 10, 13, 16, 18, 21, 22])
    assert worker.get_kv_connector_stats().data["loaded_blocks"] == 7, "the delta, not the running total"
    assert scheduler.get_kv_connector_stats().data["hit_tokens"] == 7 * BS
    assert worker.stats.loaded_blocks == 14  # the process's running totals are untouched


def test_reports_sum_and_reduce_as_vllm_logs_them(pair) -> None:
    scheduler, worker = pair
    from_worker, from_scheduler = worker.get_kv_connector_stats(), scheduler.get_kv_connector_stats()
    total = from_worker.aggregate(from_scheduler)  # vLLM's order: the workers', then the scheduler's
    assert total is from_worker and total.data["hit_tokens"] == 7 * BS and total.data["saved_blocks"] == 7
    reduced = total.reduce()
    assert {k: reduced[k] for k in ("hit_tokens", "loaded_blocks", "saved_blocks", "load_errors", "save_errors")} == {
        "hit_tokens": 7 * BS, "loaded_blocks": 7, "saved_blocks": 7, "load_errors": 0, "save_errors": 0}
    assert reduced["load_ms"] == round(total.data["load_seconds"] * 1e3, 1) and reduced["save_ms"] >= 0
    with pytest.raises(TypeError, match="cannot aggregate a KVConnectorStats"):
        total.aggregate(KVConnectorStats())


def test_stats_survive_vllms_trips_between_processes(pair) -> None:
    scheduler, worker = pair
    total = worker.get_kv_connector_stats().aggregate(scheduler.get_kv_connector_stats())
    assert pickle.loads(pickle.dumps(total)) == total  # worker process -> engine core
    sent = msgspec.msgpack.decode(msgspec.msgpack.encode(total.to_dict()))  # engine core -> API server
    assert KVLabConnector.build_kv_connector_stats(sent) == total
    assert KVLabConnector.build_kv_connector_stats(total.to_dict()).data is not total.data


def test_empty_and_bad_stats() -> None:
    empty = KVLabConnector.build_kv_connector_stats(None)
    assert empty.is_empty() and set(empty.data) == set(COUNTERS) and "layout" not in empty.data
    assert not KVLabStats({"save_errors": 1}).is_empty()  # failures alone are worth a report
    with pytest.raises(ValueError, match=r"unknown counters \['hits'\]"):
        KVLabConnector.build_kv_connector_stats({"hits": 3})


def test_vllms_log_line_and_prometheus_counters(pair) -> None:
    scheduler, worker = pair
    sent = worker.get_kv_connector_stats().aggregate(scheduler.get_kv_connector_stats()).to_dict()
    config = stand_in_config(GQA)
    vllm_logging = KVConnectorLogging(config.kv_transfer_config)  # vLLM's own, resolving the class by module path
    vllm_logging.observe(sent)
    lines = []
    vllm_logging.log(lambda fmt, *args: lines.append(fmt % args))
    expected = (rf"KV Transfer metrics: lookups=\d+, hit_tokens={7 * BS}, loaded_blocks=7, saved_blocks=7, "
                r"load_errors=0, save_errors=0, load_ms=[\d.]+, save_ms=[\d.]+$")
    assert lines and re.match(expected, lines[0]), lines

    registry = CollectorRegistry()
    types = {Gauge: Gauge, Counter: functools.partial(Counter, registry=registry), Histogram: Histogram}
    prom = KVLabConnector.build_prom_metrics(config, types, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    prom.observe(sent, engine_idx=1)
    prom.observe(sent, engine_idx=1)

    def value(name: str, engine: str) -> float | None:
        return registry.get_sample_value(f"vllm:kvlab_{name}_total", {"model_name": "m", "engine": engine})

    assert value("hit_tokens", "1") == 2 * 7 * BS and value("loaded_blocks", "1") == value("saved_blocks", "1") == 14
    assert value("load_errors", "1") == value("save_errors", "1") == 0
    assert value("hit_tokens", "0") == 0
