"""Time to first token with and without connectors, every engine in its own process on the
same threads: recompute, vLLM's own prefix-cache hit (the floor), KVLabConnector in each
mode and store, vLLM's ExampleConnector and LMCache; and what reuse costs each of them."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from kvlab.experiments.paths import Reuse
from kvlab.runtime.engine import EngineSpec, check_inputs, run_engine, same_outputs, summarize
from kvlab.runtime.progress import progress


def run_any_engine(spec: EngineSpec, prompts: list[list[int]], lmcache: Any = None, **options: Any) -> dict:
    """:func:`run_engine`, or for the "lmcache" connector kvlab.runtime.lmcache.run_on_server on the
    ``lmcache`` server (checked before the engine starts; a dead server is named)."""
    if spec.connector != "lmcache":
        return run_engine(spec, prompts, **options)
    if lmcache is None:
        raise ValueError("the lmcache connector needs a running kvlab.runtime.lmcache.LMCacheServer")
    from kvlab.runtime.lmcache import run_on_server

    return run_on_server(lmcache, spec, prompts, **options)


EXTRA_ENGINES = ("new process", "checked")


def ttft_scenarios(model: str, prompts: list[list[int]], workdir: str | Path, dtype: str = "bfloat16",
                   block_size: int = 32, chunk_size: int | None = None,
                   modes: tuple[str, ...] = ("whole-step", "layerwise"), repeats: int = 3,
                   extras: tuple[str, ...] = EXTRA_ENGINES) -> list[dict]:
    """Time to first token, one engine per process, every engine on the same threads and
    with vLLM's prefix cache on: recompute (first sight), vLLM's own prefix-cache hit (the
    floor: the KV is in place, nothing moves), and the same prompts served through
    KVLabConnector in each of ``modes`` (memory; disk in the same process and in a new
    one; whole-step also with every memory hit checksummed) and vLLM's ExampleConnector,
    vLLM's prefix cache emptied before each of those. Every engine also records its own
    prefix-hit time between its warm runs (``engine_floor_s``: how much the engine itself
    drifts). Each warm row also says whether its outputs equal recompute's; overheads
    come from :func:`with_overheads`. ``extras`` picks the engines beyond one per mode
    (a new process reading the disk tier, whole-step with every hit checksummed): fewer
    engines for a shorter run."""
    unknown = sorted(set(extras) - set(EXTRA_ENGINES))
    if unknown:
        raise ValueError(f"unknown extra engines {unknown}; choose from {list(EXTRA_ENGINES)}")
    workdir = Path(workdir).resolve()  # every engine process must mean the same folders
    common = {"model": model, "dtype": dtype, "block_size": block_size, "prefix_caching": True}
    kvlab = {"chunk_size": chunk_size} if chunk_size else {}

    def paired(*phases: str) -> tuple[str, ...]:  # each floor right after a warm run of its prompt
        return tuple(p for _ in range(repeats) for phase in phases for p in (phase, "floor"))

    plans = [("vLLM prefix cache", EngineSpec(**common, phases=("cold",) + ("floor",) * repeats),
              {"cold": Reuse.RECOMPUTE.label, "floor": Reuse.VLLM_PREFIX_HIT.label})]
    for mode in modes:
        label = {"whole-step": Reuse.KVLAB_WHOLE_STEP, "layerwise": Reuse.KVLAB_LAYERWISE}[mode].label
        extra = {**kvlab, "layerwise": mode == "layerwise", "store": "disk", "disk_path": str(workdir / f"kvlab-{mode}")}
        plans.append((label, EngineSpec(**common, connector="kvlab", extra=extra,
                                        phases=("cold", *paired("warm", "warm-disk"))),
                      {"warm": f"{label}, memory", "warm-disk": f"{label}, disk"}))
        if "new process" in extras:
            plans.append((f"{label} new process", EngineSpec(**common, connector="kvlab", extra=extra,
                                                             phases=paired("warm-disk")),
                          {"warm-disk": f"{label}, disk, new process"}))
        if mode == "whole-step" and "checked" in extras:
            checked = {**kvlab, "verify": "always"}
            plans.append((f"{label} checked", EngineSpec(**common, connector="kvlab", extra=checked,
                                                         phases=("cold", *paired("warm"))),
                          {"warm": f"{label}, memory, CRC at every hit"}))
    plans.append((Reuse.EXAMPLE_CONNECTOR.label, EngineSpec(**common, connector="example",
                                                            workdir=str(workdir / "example"),
                                                            phases=("cold", *paired("warm"))),
                  {"warm": Reuse.EXAMPLE_CONNECTOR.label}))
    rows, results = [], {}
    for name, spec, labels in progress(plans, desc="engines", unit="engine"):
        results[name] = run_engine(spec, prompts)
        floor = summarize("floor", results[name], "floor")["median_s"]
        for phase, label in labels.items():
            row = summarize(label, results[name], phase, connector=spec.connector, model=Path(model).name,
                            dtype=dtype, new_process=name.endswith("new process"))
            row.update(same_outputs(results["vLLM prefix cache"], results[name], "cold", phase))
            row["engine_floor_s"] = floor
            rows.append(row)
    return with_overheads(rows)


def with_overheads(rows: list[dict]) -> list[dict]:
    """Each warm row's overhead: its median minus the floor, vLLM's own prefix-cache hit
    (the KV is in place, nothing moves) measured in the same engine between its warm runs,
    which cancels drift between engines; ``overhead_vs_plain_s`` uses the engine without a
    connector instead."""
    plain = next((r["median_s"] for r in rows if Reuse.of(r["scenario"]) is Reuse.VLLM_PREFIX_HIT), None)
    if plain is None:
        raise ValueError("these rows have no vLLM prefix-cache hit row (the floor): rows of ttft_scenarios are needed")
    return [{**r, "overhead_s": None if r["phase"] == "cold" else r["median_s"] - r.get("engine_floor_s", plain),
             "overhead_vs_plain_s": None if r["phase"] == "cold" else r["median_s"] - plain} for r in rows]


def connector_comparison(model: str, prompts: list[list[int]], workdir: str | Path, lmcache: Any = None,
                         dtype: str = "bfloat16", block_size: int = 32, repeats: int = 3) -> list[dict]:
    """KVLabConnector, LMCache (on ``lmcache``, a running kvlab.runtime.lmcache.LMCacheServer;
    skipped when None) and
    vLLM's ExampleConnector on the same prompts, each engine in its own process with vLLM's
    prefix cache on: time to first token cold (first sight: compute and store) and warm
    (vLLM's prefix cache emptied: the prefix comes from the connector), each warm sample
    paired with a floor sample (vLLM's own prefix hit in the same engine).

    Costs and throughputs, end to end as a request sees them, against the engine without a
    connector: retrieve = warm minus its floor (vLLM's own prefix hit: the KV already in
    place), store = cold minus its cold; GB/s = KV bytes served from the connector (cached
    tokens x the model's KV bytes per token) over those costs. ``floor_s`` is each engine's
    own prefix hit (a connector that slows every request shows there). Also
    the seconds the model runner blocked inside the connector (``runner_load_s``,
    ``runner_save_s``; near zero for LMCache, whose server moves KV asynchronously)."""
    from kvlab.runtime.models import geometry_of

    check_inputs(model, prompts)
    token_bytes = geometry_of(model, dtype=dtype, block_size=block_size).token_bytes
    workdir = Path(workdir).resolve()
    common = {"model": model, "dtype": dtype, "block_size": block_size, "prefix_caching": True}
    paired = ("cold",) + ("warm", "floor") * repeats
    plans = [("no connector", EngineSpec(**common, phases=("cold",) + ("floor",) * repeats))]
    plans.append(("KVLabConnector", EngineSpec(**common, connector="kvlab", phases=paired)))
    if lmcache is not None:
        plans.append((Reuse.LMCACHE.label, EngineSpec(**common, connector="lmcache", phases=paired)))
    plans.append((Reuse.EXAMPLE_CONNECTOR.label, EngineSpec(**common, connector="example", workdir=str(workdir / "example"),
                                                            phases=paired)))
    results = {name: run_any_engine(spec, prompts, lmcache) for name, spec in progress(plans, desc="connectors", unit="engine")}
    plain = results["no connector"]
    rows = []
    for name, result in results.items():
        cold, floor = summarize("cold", result, "cold"), summarize("floor", result, "floor")
        row = {"connector": name, "model": Path(model).name, "dtype": dtype, "prompt_tokens": cold["prompt_tokens"],
               "cold_s": cold["median_s"], "floor_s": floor["median_s"],
               "runner_save_s": statistics.median(r["save_s"] for r in result["phases"]["cold"])}
        if "warm" in result["phases"]:
            warm = summarize("warm", result, "warm")
            row.update(warm_s=warm["median_s"], warm_min_s=warm["min_s"], warm_max_s=warm["max_s"],
                       cached_tokens=warm["cached_tokens"], kv_bytes=warm["cached_tokens"] * token_bytes,
                       runner_load_s=statistics.median(r["load_s"] for r in result["phases"]["warm"]),
                       **same_outputs(plain, result, "cold", "warm"))
        rows.append(row)
    return connector_costs(rows)


def connector_costs(rows: list[dict]) -> list[dict]:
    """What KV reuse costs a request with each connector, from rows of
    :func:`connector_comparison` (recorded rows too): ``retrieve_s`` = warm minus the
    prefix hit of the engine without a connector (the KV already in place), and the KV
    bytes served over it (``retrieve_gbps``); ``store_gbps`` = the KV bytes over the time
    the model runner blocked in the connector's save calls (``runner_save_s``: the cold
    forward's extra work; a difference of two cold prefills, ``cold_overhead_s``, is
    reported too but drowns in their noise)."""
    plain = next((r for r in rows if r["connector"] == "no connector"), None)
    if plain is None:
        raise ValueError("these rows have no 'no connector' row: rows of connector_comparison are needed")
    costed = []
    for row in rows:
        row = dict(row)
        if row.get("warm_s") is not None and row["warm_s"] == row["warm_s"]:
            retrieve = row["warm_s"] - plain["floor_s"]
            row.update(retrieve_s=retrieve, cold_overhead_s=row["cold_s"] - plain["cold_s"],
                       retrieve_gbps=row["kv_bytes"] / retrieve / 1e9 if retrieve > 0 else None,
                       store_gbps=row["kv_bytes"] / row["runner_save_s"] / 1e9 if row["runner_save_s"] > 0 else None)
        costed.append(row)
    return costed
