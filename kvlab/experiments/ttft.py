"""Time to first token with and without connectors, every engine in its own process on the
same threads: recompute, vLLM's own prefix-cache hit (the floor), KVLabConnector in each
mode and store, vLLM's ExampleConnector and LMCache; and what reuse costs each of them."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from kvlab.experiments.paths import Reuse
from kvlab.harness.compare import same_outputs, summarize
from kvlab.harness.engine import EngineSpec, check_inputs, run_engine
from kvlab.harness.spread import SAMPLES_KEY, row_difference
from kvlab.runtime.progress import progress


def run_any_engine(spec: EngineSpec, prompts: list[list[int]], lmcache: Any = None, **options: Any) -> dict:
    """:func:`run_engine`, or for the "lmcache" connector kvlab.harness.lmcache.run_on_server on the
    ``lmcache`` server (checked before the engine starts; a dead server is named)."""
    if spec.connector != "lmcache":
        return run_engine(spec, prompts, **options)
    if lmcache is None:
        raise ValueError("the lmcache connector needs a running kvlab.runtime.lmcache.LMCacheServer")
    from kvlab.harness.lmcache import run_on_server

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
        extra = {**kvlab, "layerwise": mode == "layerwise", "store": "disk", "disk": {"path": str(workdir / f"kvlab-{mode}")}}
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
        floor = summarize("floor", results[name], "floor")
        for phase, label in labels.items():
            row = summarize(label, results[name], phase, connector=spec.connector, model=Path(model).name,
                            dtype=dtype, new_process=name.endswith("new process"))
            row.update(same_outputs(results["vLLM prefix cache"], results[name], "cold", phase))
            row.update(engine_floor_s=floor["median_s"], engine_floor_samples_s=floor[SAMPLES_KEY])
            rows.append(row)
    return with_overheads(rows)


def engine_floor(row: dict) -> dict:
    """A row's own engine's prefix hit as a timing row of its own (its samples when kept;
    one sample's worth of trust when only the median was)."""
    samples = row.get("engine_floor_samples_s")
    return {"median_s": row["engine_floor_s"], SAMPLES_KEY: samples, "samples": len(samples) if samples else 1}


def with_overheads(rows: list[dict]) -> list[dict]:
    """Each warm row's overhead: its median minus the floor, vLLM's own prefix-cache hit
    (the KV is in place, nothing moves) measured in the same engine between its warm runs,
    which cancels drift between engines, with the interval of that difference
    (``overhead_low_s``, ``overhead_high_s``); ``overhead_vs_plain_s`` uses the engine
    without a connector instead. An engine whose own floor differs from the plain engine's
    by more than their spread is flagged (``floor_differs``): its overheads stand, but the
    engine itself ran slower or faster, and the text must say so."""
    plain = next((r for r in rows if Reuse.of(r["scenario"]) is Reuse.VLLM_PREFIX_HIT), None)
    if plain is None:
        raise ValueError("these rows have no vLLM prefix-cache hit row (the floor): rows of ttft_scenarios are needed")
    out = []
    for r in rows:
        floor = engine_floor(r) if r.get("engine_floor_s") is not None else plain
        warm = r["phase"] != "cold"
        overhead = row_difference(r, floor) if warm else None
        drift = row_difference(floor, plain)
        out.append({**r, "overhead_s": overhead.value if warm else None,
                    "overhead_low_s": overhead.low if warm else None, "overhead_high_s": overhead.high if warm else None,
                    "overhead_interval": overhead.how if warm else None,
                    "overhead_samples": overhead.samples if warm else None,
                    "overhead_vs_plain_s": r["median_s"] - plain["median_s"] if warm else None,
                    "floor_differs": drift.excludes(0.0)})
    return out


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


# The connector's modes as kv_connector_extra_config: "hooks" is layerwise driven from kvlab's
# CPU attention backend through kvlab.hooks (non-dict metadata, (k, v) tuples), as on Ascend.
CONNECTOR_MODES = {"whole-step": {}, "layerwise": {"layerwise": True}, "hooks": {"layerwise": True, "hooks": True}}
HAND_OVERS = {"LBHNC": "per-layer", "BLHNC": "cross-layer"}


def layouts_in_the_engine(model: str, prompts: list[list[int]], redis: Any, dtype: str = "bfloat16",
                          block_size: int = 32, chunk_size: int | None = None, repeats: int = 3,
                          layouts: tuple[str, ...] = tuple(HAND_OVERS),
                          modes: tuple[str, ...] = tuple(CONNECTOR_MODES)) -> list[dict]:
    """Per-layer (LBHNC) against cross-layer (BLHNC, granted by vLLM's own allocator through
    kvlab's CPU attention backend) inside the engine, in each connector mode, from memory
    and from Redis (``redis``, a running kvlab.runtime.redis.RedisServer: a database per
    engine, so that each engine's hits are its own chunks, not another layout's converted;
    the memory tier emptied first), each engine in its own process in vLLM's default process layout, beside an engine without a connector (cold:
    recompute; floor: vLLM's own prefix hit). Each KVLab row gives the time to first token,
    its overhead over the floor measured in the same engine, the copy time (``copy_s``:
    the loads' own copying), the model runner's time blocked in the connector's load calls
    (``runner_load_s``) and, layer by layer, waiting for a layer (``wait_s``), the share of
    the copying hidden behind compute (1 - wait / copy), the segments per chunk, and its
    outputs against vLLM's own prefix hit in the same engine (``identical``,
    ``max_logprob_diff``: the same prefill split, so bitwise) and the largest logprob gap to
    recompute (``gap_vs_recompute``)."""
    unknown = sorted(set(layouts) - set(HAND_OVERS)) + sorted(set(modes) - set(CONNECTOR_MODES))
    if unknown:
        raise ValueError(f"unknown layouts or modes {unknown}; layouts are {list(HAND_OVERS)}, "
                         f"modes {list(CONNECTOR_MODES)}")
    if not callable(getattr(redis, "database", None)):
        raise ValueError(f"redis must be a running kvlab.runtime.redis.RedisServer, got {type(redis).__name__}")
    check_inputs(model, prompts)
    common = {"model": model, "dtype": dtype, "block_size": block_size, "prefix_caching": True,
              "multiprocessing": True}
    paired = ("warm", "floor", "warm-disk", "floor") * repeats
    chunk_blocks = (chunk_size or 256) // block_size
    plans = [(None, None, EngineSpec(**common, phases=("cold",) + ("floor",) * repeats))]
    for layout in layouts:
        for mode in modes:
            extra = {"tiers": ["memory", "redis"], "redis": {"url": redis.database(len(plans))}, "enable_cross_layers_blocks": layout == "BLHNC",
                     **CONNECTOR_MODES[mode], **({"chunk_size": chunk_size} if chunk_size else {})}
            plans.append((layout, mode, EngineSpec(**common, connector="kvlab", extra=extra, phases=("cold", *paired))))
    rows, plain = [], None
    for layout, mode, spec in progress(plans, desc="engines", unit="engine"):
        result = run_engine(spec, prompts)
        plain = plain or result
        floor_row = summarize("floor", result, "floor")
        floor = floor_row["median_s"]
        if layout is None:
            for phase, label in (("cold", Reuse.RECOMPUTE.label), ("floor", Reuse.VLLM_PREFIX_HIT.label)):
                rows.append({**summarize(label, result, phase, model=Path(model).name, dtype=dtype), "layout": "LBHNC",
                             "hand_over": None, "mode": None, "tier": None, "engine_floor_s": floor,
                             "overhead_s": None if phase == "cold" else 0.0})
            continue
        for phase, tier in (("warm", "memory"), ("warm-disk", "Redis")):
            samples = result["phases"][phase]
            counters = [r["kvlab"] for r in samples]
            copy = statistics.median(c["load_work_seconds"] for c in counters)
            wait = statistics.median(c["load_wait_seconds"] for c in counters)
            row = summarize(f"KVLab {layout} {mode}, {tier}", result, phase, connector="kvlab", model=Path(model).name,
                            dtype=dtype)
            overhead = row_difference(row, floor_row)
            row.update(layout=layout, hand_over=HAND_OVERS[layout], mode=mode, tier=tier, engine_floor_s=floor,
                       engine_floor_samples_s=floor_row[SAMPLES_KEY], overhead_s=overhead.value,
                       overhead_low_s=overhead.low, overhead_high_s=overhead.high, overhead_interval=overhead.how,
                       overhead_samples=overhead.samples, copy_s=copy, wait_s=wait if mode != "whole-step" else None,
                       runner_load_s=statistics.median(r["load_s"] for r in samples),
                       runner_save_s=statistics.median(r["save_s"] for r in result["phases"]["cold"]),
                       hidden_share=(1 - wait / copy if copy > 0 else None) if mode != "whole-step" else 0.0,
                       segments_per_chunk=chunk_blocks * sum(c["load_segments"] for c in counters)
                       / max(1, sum(c["loaded_blocks"] for c in counters)),
                       layout_granted=result["kv_cache"]["layout"], registered=result["connector"]["default"]["layout"],
                       # bitwise against the same-split control (vLLM's own prefix hit in this engine); against
                       # recompute only the gap, which another prefill split moves in bf16
                       **same_outputs(result, result, "floor", phase),
                       gap_vs_recompute=same_outputs(plain, result, "cold", phase)["max_gap_through_divergence"])
            rows.append(row)
    return rows


BACKEND_VARIANTS = {"plain CPU_ATTN": {"kvlab_backend": False}, "kvlab backend, LBHNC": {},
                    "kvlab backend, BLHNC": {"kv_cache_layout": "BLHNC"}}


def backend_throughput(model: str, prompts: list[list[int]], dtype: str = "bfloat16", block_size: int = 32,
                       rounds: int = 3, decode_tokens: int = 64) -> list[dict]:
    """Prefill and decode throughput of vLLM's CPU engine with plain CPU_ATTN (kvlab's plugin
    off), kvlab's backend on LBHNC and on BLHNC (no connector): prefill = prompt tokens over
    the time to the first token, decode = ``decode_tokens`` over the time of a request whose
    prompt is the first 32 tokens, medians over the prompts; each engine in its own process
    on the same threads, prefix caching off. Engines differ by several percent from one start
    to the next on a small machine, so the variants run interleaved, ``rounds`` times, and
    each ratio against plain CPU_ATTN is taken within a round; one row per variant: the
    medians over the rounds."""
    check_inputs(model, prompts)
    short = [p[:32] for p in prompts]
    measured: dict[str, list[dict]] = {name: [] for name in BACKEND_VARIANTS}
    plan = [(r, name) for r in range(rounds) for name in BACKEND_VARIANTS]
    for _, name in progress(plan, desc="backend engines", unit="pair"):
        common = {"model": model, "dtype": dtype, "block_size": block_size, "phases": ("cold",), **BACKEND_VARIANTS[name]}
        prefill = run_engine(EngineSpec(**common, max_tokens=1), prompts)
        decode = run_engine(EngineSpec(**common, max_tokens=decode_tokens), short)
        measured[name].append({
            "layout": prefill["kv_cache"]["layout"],
            "prefill_tok_s": statistics.median(r["prompt_tokens"] / r["seconds"] for r in prefill["phases"]["cold"]),
            "decode_tok_s": statistics.median(len(r["token_ids"]) / r["seconds"] for r in decode["phases"]["cold"])})
    plain = measured[next(iter(BACKEND_VARIANTS))]
    rows = []
    for name, runs in measured.items():
        ratios = {key: [run[key] / base[key] for run, base in zip(runs, plain)] for key in ("prefill_tok_s", "decode_tok_s")}
        rows.append({"backend": name, "model": Path(model).name, "dtype": dtype, "layout": runs[0]["layout"],
                     "prompt_tokens": statistics.median(len(p) for p in prompts), "decode_tokens": decode_tokens,
                     "rounds": rounds, **{key: statistics.median(run[key] for run in runs) for key in ratios},
                     "prefill_ratio": statistics.median(ratios["prefill_tok_s"]),
                     "decode_ratio": statistics.median(ratios["decode_tok_s"]),
                     "prefill_ratio_range": [min(ratios["prefill_tok_s"]), max(ratios["prefill_tok_s"])],
                     "decode_ratio_range": [min(ratios["decode_tok_s"]), max(ratios["decode_tok_s"])]})
    return rows
