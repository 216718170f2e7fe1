"""The Redis tier on a real 3-node Redis Cluster (kvlab.runtime.redis_cluster): chunks and
block names spread over the nodes by slot, read back bitwise by another client in one round
trip per call, damage dropped, and a node killed mid-run costing its own keys only (misses,
never an error), the others serving on."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import pytest
import torch

from kvlab.cache import ModelGeometry
from kvlab.connector.config import ConnectorConfig
from kvlab.harness.chunks import random_chunk, same_chunk
from kvlab.runtime.redis import RedisError
from kvlab.runtime.redis_cluster import RedisCluster
from kvlab.store import KVStore
from kvlab.store.tiers import RedisTier, StoreStats

GEOMETRY = ModelGeometry("cluster-test", 4, 2, 64, torch.bfloat16, 16)  # 32 KiB per block
chunk = partial(random_chunk, GEOMETRY, blocks=4, salt="r")


def nodes_of(client: Any, keys: list[str]) -> set[str]:
    """The nodes ("host:port") a redis.RedisCluster ``client`` sends ``keys`` to: how many
    nodes one prefix touches (its blocks' names spread over the cluster)."""
    return {client.get_node_from_key(key).name for key in keys}


def test_chunks_spread_over_the_nodes_and_another_client_reads_them_bitwise(redis_cluster) -> None:
    writer, reader = RedisTier(redis_cluster.url, StoreStats()), RedisTier(redis_cluster.url, StoreStats())
    writer.check()
    stored = [chunk(tag) for tag in range(12)]
    assert all(writer.put(c) for c in stored)
    assert all(count > 0 for count in redis_cluster.keys_per_node()), "every node holds some"
    keys = [key for c in stored for key in c.block_keys]
    before = reader.round_trips
    assert reader.locate_many(keys) == [(c.key, position) for c in stored for position in range(4)]
    assert reader.round_trips == before + 1, "48 names on 3 nodes: one call"
    assert reader.locate_many(["0" * 64]) == [None]
    headers = reader.describe_many([c.key for c in stored] + ["0" * 64])
    assert [h.block_keys for h in headers[:-1]] == [c.block_keys for c in stored] and headers[-1] is None
    assert all(same_chunk(reader.get(c.key), c) for c in stored) and reader.get("0" * 64) is None
    assert len(nodes_of(redis_cluster.client(), [f"kvlab:b:{{{k}}}" for k in keys])) == 3


def test_a_store_and_the_connector_config_take_the_cluster_url(redis_cluster) -> None:
    KVStore(tiers={"redis": {"url": redis_cluster.url}}).put(chunk(3))
    fetched = KVStore(tiers={"redis": {"url": redis_cluster.url}}).fetch(chunk(3).key, tier="redis")
    assert fetched.chunk is not None and same_chunk(fetched.chunk, chunk(3))
    assert ConnectorConfig.parse(redis_cluster.extra()).tier_settings["redis"].url == redis_cluster.url
    with pytest.raises(ValueError, match="no database"):
        ConnectorConfig.parse(redis_cluster.extra(redis={"url": redis_cluster.url.replace("?", "/2?")}))


def test_a_damaged_chunk_is_dropped(redis_cluster) -> None:
    stats = StoreStats()
    writer, reader = RedisTier(redis_cluster.url, StoreStats()), RedisTier(redis_cluster.url, stats)
    good = chunk(1)
    writer.put(good)
    client, name = redis_cluster.client(), f"kvlab:c:{{{good.key}}}"
    value = bytearray(client.get(name))
    value[-5] ^= 0x40
    client.set(name, bytes(value))
    assert reader.get(good.key) is None and stats.corrupt == 1 and not client.exists(name)


def test_a_killed_node_costs_its_own_keys_only(redis_cluster) -> None:
    """Kill the node of one chunk: its lookups and reads miss within a timeout, writes that
    touch it are skipped, and chunks wholly on the other nodes are read as before."""
    stats = StoreStats()
    tier = RedisTier(redis_cluster.url, stats, timeout_s=1.0)
    stored = [chunk(tag) for tag in range(12)]
    assert all(tier.put(c) for c in stored)
    victim = redis_cluster.node_of(f"kvlab:c:{{{stored[0].key}}}")
    survivors = [c for c in stored if redis_cluster.node_of(f"kvlab:c:{{{c.key}}}") != victim]
    assert survivors
    redis_cluster.kill_node(victim)
    began = time.monotonic()
    assert tier.get(stored[0].key) is None
    located = tier.locate_many([key for c in stored for key in c.block_keys])
    assert None in located and stats.read_errors >= 1
    assert time.monotonic() - began < 10
    assert all(same_chunk(tier.get(c.key), c) for c in survivors), "the other nodes serve on"
    assert tier.put(chunk(99)) in (True, False)  # skipped or written, never raised


def test_bad_clusters_and_a_cluster_down_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="at least 3"):
        RedisCluster(nodes=2)
    with pytest.raises(RedisError, match="not running"):
        RedisCluster().kill_node(0)
    tier = RedisTier("redis-cluster://127.0.0.1:1", StoreStats(), timeout_s=0.5)
    with pytest.raises(ValueError, match="cannot reach"):
        tier.check()
    assert tier.locate_many(["0" * 64]) == [None] and tier.get("0" * 64) is None
