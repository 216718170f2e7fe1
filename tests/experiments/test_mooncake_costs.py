"""The cross-layer question on a real Mooncake Store (kvlab.runtime.mooncake): every strategy
gives back the bytes it stored, with the objects and descriptors each layout implies."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import ModelGeometry
from kvlab.experiments.mooncake_costs import STRATEGIES, mooncake_prefix_costs, object_pace

GEOMETRY = ModelGeometry("moon", 3, 2, 32, torch.bfloat16, 16)


def test_every_strategy_round_trips_and_counts_objects_and_descriptors(mooncake_store):
    rows = mooncake_prefix_costs(mooncake_store.url, GEOMETRY, tokens=128, chunk_tokens=64, repeats=1)
    assert {(r["layout"], r["strategy"]) for r in rows} == {(l, s) for l in ("LBHNC", "BLHNC") for s in STRATEGIES}
    assert all(r["identical"] for r in rows), "every fetched byte equals what was stored"
    shape = {(r["layout"], r["strategy"]): (r["objects_per_chunk"], r["descriptors_per_chunk"]) for r in rows}
    blocks = 64 // GEOMETRY.block_size
    assert shape[("LBHNC", "object per run")] == (GEOMETRY.num_layers * blocks,) * 2
    assert shape[("BLHNC", "object per run")] == (blocks, blocks)
    assert shape[("LBHNC", "object per chunk (descriptor per run)")] == (1, GEOMETRY.num_layers * blocks)
    assert shape[("BLHNC", "object per chunk (gather)")] == (1, 1)
    assert all(r["ceiling_store_s"] > 0 and r["ceiling_fetch_s"] > 0 for r in rows)


def test_the_pace_of_ready_objects_and_bad_sizes(mooncake_store):
    rows = object_pace(mooncake_store.url, total_bytes=256 << 10, object_bytes=(16 << 10, 128 << 10), repeats=1)
    assert [r["objects"] for r in rows] == [16, 2] and all(r["put_s"] > 0 and r["get_s"] > 0 for r in rows)
    with pytest.raises(ValueError, match="whole chunks"):
        mooncake_prefix_costs(mooncake_store.url, GEOMETRY, tokens=100, chunk_tokens=64)
