"""The cross-layer question over a network tier, against a real Redis server: every
strategy brings back exactly the bytes it stored, and the object counts follow the
layout (a per-layer cache: a run per layer and block; a cross-layer one: a run per
block; a gathered chunk: one value)."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import ModelGeometry
from kvlab.experiments.network import STRATEGIES, redis_prefix_costs

GEOMETRY = ModelGeometry("net", 3, 2, 32, torch.bfloat16, 16)


def test_every_strategy_round_trips_and_counts_objects(redis_server):
    rows = redis_prefix_costs(redis_server.url, GEOMETRY, tokens=128, chunk_tokens=64, repeats=1)
    assert {(r["layout"], r["strategy"]) for r in rows} == {(l, s) for l in ("LBHNC", "BLHNC") for s in STRATEGIES}
    assert all(r["identical"] for r in rows), "every fetched byte equals what was stored"
    objects = {(r["layout"], r["strategy"]): r["objects_per_chunk"] for r in rows}
    blocks = 64 // GEOMETRY.block_size
    assert objects[("LBHNC", "object per run")] == GEOMETRY.num_layers * blocks  # K and V share a block's run
    assert objects[("BLHNC", "object per run")] == blocks
    assert objects[("LBHNC", "object per chunk (gather)")] == objects[("BLHNC", "object per chunk (gather)")] == 1
    assert objects[("BLHNC", "kvlab Redis tier")] == 1 + blocks  # the value and a name per block
    assert all(r["fetch_round_trips_per_chunk"] <= 2 for r in rows)


def test_a_prefix_that_is_not_whole_chunks_is_refused(redis_server):
    with pytest.raises(ValueError, match="whole chunks"):
        redis_prefix_costs(redis_server.url, GEOMETRY, tokens=100, chunk_tokens=64)
    with pytest.raises(ValueError, match="chunk_tokens must be a positive integer"):
        redis_prefix_costs(redis_server.url, GEOMETRY, tokens=128, chunk_tokens=0)
    with pytest.raises(ValueError, match="repeats must be a positive integer"):
        redis_prefix_costs(redis_server.url, GEOMETRY, tokens=128, chunk_tokens=64, repeats=0)


def test_on_a_cluster_a_chunks_objects_share_a_node_and_the_prefix_spreads(redis_cluster):
    rows = redis_prefix_costs(redis_cluster.url, GEOMETRY, tokens=512, chunk_tokens=64, repeats=1)
    assert all(r["identical"] and r["store"] == "redis cluster" and r["nodes"] == 3 for r in rows)
    per_run = {r["layout"]: r for r in rows if r["strategy"] == "object per run"}
    assert per_run["LBHNC"]["objects_per_chunk"] == GEOMETRY.num_layers * 4
    assert per_run["LBHNC"]["store_round_trips_per_chunk"] == 1, "a chunk's hash-tagged objects: one node, one trip"
    assert all(1 < r["nodes_touched"] <= 3 for r in rows), "8 chunks spread over the nodes"
