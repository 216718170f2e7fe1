"""KVLabConnector's Redis tier on a real 3-node Redis Cluster as vLLM deploys it, driven
without an engine: another engine (another process, another host) hits and loads the same
bytes; a killed node costs the chunks it held (recomputed), never an error, and is counted.
Engine runs: tests/integration/test_connector_vllm.py."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("vllm")

from test_deployed import BS, PROMPT, blocks_of, engine  # noqa: E402

from kvlab.connector import reset_stores  # noqa: E402
from kvlab.connector.stores import all_stats  # noqa: E402
from kvlab.harness.driver import prefill  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_stores")
LONG = list(range(16 * BS + 1))  # 16 blocks, 4 chunks of 4


def test_another_engine_loads_through_the_cluster_and_a_dead_node_is_a_counted_miss(redis_cluster):
    extra = {**redis_cluster.extra(), "chunk_size": 4 * BS}
    scheduler, (worker,) = engine(extra)
    prefill(scheduler, worker, "a", LONG, list(range(17)))
    expected = blocks_of(worker, list(range(16)))
    reset_stores()
    scheduler_b, (worker_b,) = engine({**extra, "tiers": ["redis"]})
    assert prefill(scheduler_b, worker_b, "b", PROMPT, [0, 1, 2, 3, 4])["hit_tokens"] == 4 * BS
    reset_stores()
    scheduler_c, (worker_c,) = engine({**extra, "tiers": ["redis"]})
    assert prefill(scheduler_c, worker_c, "c", LONG, list(range(17)))["hit_tokens"] == 16 * BS
    assert torch.equal(blocks_of(worker_c, list(range(16))), expected)
    redis_cluster.kill_node(1)  # not the node the URL names: a new engine still starts
    began = time.monotonic()
    assert prefill(scheduler_c, worker_c, "c2", LONG, list(range(17, 34)))["hit_tokens"] < 16 * BS
    assert all_stats()["default"]["store"]["read_errors"] >= 1 and time.monotonic() - began < 10, "counted, quick"
    reset_stores()
    scheduler_d, (worker_d,) = engine({**extra, "tiers": ["redis"]})
    result = prefill(scheduler_d, worker_d, "d", LONG, list(range(17)))
    assert 0 < result["hit_tokens"] < 16 * BS and not result["report"].invalid_block_ids
    loaded = list(range(result["hit_tokens"] // BS))  # the prefix up to the first chunk node 1 held
    assert torch.equal(blocks_of(worker_d, loaded), blocks_of(worker, loaded))
