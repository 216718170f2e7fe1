"""Per-layer against cross-layer hand-over through KVLabConnector, driven exactly as each
vLLM generation registers its cache (kvlab.harness.driver): save then load one prompt,
count segments and time both. Imports vLLM."""

from __future__ import annotations

import statistics

from kvlab.cache.geometry import ModelGeometry
from kvlab.harness.driver import connector_pair, prefill, register


def registration_costs(geometry: ModelGeometry, tokens: int, ways: list[str], repeats: int = 3) -> list[dict]:
    """Save then load one ``tokens``-token prompt through the connector for each way of
    handing over the cache: layout recognised, segments per load and save, median times and
    every sample (``save_samples_ms``, ``load_samples_ms``)."""
    from kvlab.connector.stores import reset_stores

    blocks = tokens // geometry.block_size
    if blocks < 1:
        raise ValueError(f"tokens must cover at least one block of {geometry.block_size}, got {tokens}")
    num_blocks = 2 * blocks + 2
    rows = []
    for how in ways:
        samples = []
        for _ in range(repeats):
            reset_stores()
            # saves in the step, so that their time is the copy's (async saves hide it)
            scheduler, worker = connector_pair(geometry, num_blocks, {"async_saves": False})
            register(worker, how, geometry, num_blocks)
            prompt = list(range(blocks * geometry.block_size + 1))
            cold = prefill(scheduler, worker, "cold", prompt, list(range(0, 2 * blocks + 2, 2)))
            warm = prefill(scheduler, worker, "warm", prompt, list(range(1, 2 * blocks + 2, 2)))
            samples.append((cold["save_s"], warm["load_s"], warm["hit_tokens"]))
        stats = worker.stats
        rows.append({
            "registration": how, "layout": worker.cache.layout.name, "cross_layer": worker.cache.layout.is_cross_layer,
            "tokens": blocks * geometry.block_size, "hit_tokens": samples[-1][2],
            "save_segments": stats.save_segments, "load_segments": stats.load_segments,
            "save_ms": 1e3 * statistics.median(s[0] for s in samples),
            "load_ms": 1e3 * statistics.median(s[1] for s in samples),
            "save_samples_ms": [1e3 * s[0] for s in samples], "load_samples_ms": [1e3 * s[1] for s in samples],
        })
    reset_stores()
    return rows
