"""KVLabConnector as vLLM deploys it, measured: every engine in vLLM's default process layout
(front end, engine core with the scheduler side, worker with the KV apart).

- :func:`serving_costs`: time to first token of the connector's hit over the engine's own
  prefix hit, beside vLLM's ExampleConnector; the seconds the model runner blocks in save
  calls (saves run beside the forward); decode throughput with the connector saving.
- :func:`sharing_runs`: other engines hitting what one engine stored, through shared
  memory and through Redis; tensor-parallel ranks each with their own shard.
The figures of the issue's targets come from :func:`targets`."""

from __future__ import annotations

import shlex
import statistics
from pathlib import Path
from typing import Any

from kvlab.experiments.paths import Reuse
from kvlab.harness.compare import same_outputs, summarize
from kvlab.harness.engine import EngineSpec, check_inputs, run_engine
from kvlab.runtime.progress import progress

SAVE_REFERENCE_BYTES = 43.6 * 2**20  # a 2000-token SmolLM2 bf16 prefix: the unit for save blocking
# The targets for the deployed connector (:func:`targets`)
OVERHEAD_VS_EXAMPLE_TARGET = 0.5  # at most: KVLab's TTFT overhead as a share of ExampleConnector's
SAVE_TARGET_MS = 5.0  # at most: the model runner's milliseconds in save calls per SAVE_REFERENCE_BYTES
DECODE_TARGET = 0.95  # at least: decode throughput with the connector over without


def serving_costs(model: str, prompts: list[list[int]], decode_prompts: list[list[int]], workdir: str | Path,
                  dtype: str = "bfloat16", repeats: int = 3, decode_tokens: int = 128) -> list[dict]:
    """One row per engine, vLLM's default processes and prefix cache on. ``prompts``: each
    sent cold, then ``repeats`` times alternately from the connector (vLLM's prefix cache
    emptied) and from vLLM's prefix cache (the floor, same engine): the overhead is the
    median of warm minus floor. The model runner's seconds in save calls, per cold
    prompt, scaled to SAVE_REFERENCE_BYTES of KV. ``decode_prompts``: each generating
    ``decode_tokens`` tokens cold (the connector storing its prompt), tokens per second,
    with the connector and without one."""
    from kvlab.runtime.models import geometry_of

    check_inputs(model, prompts)
    check_inputs(model, decode_prompts)
    token_bytes = geometry_of(model, dtype=dtype, block_size=32).token_bytes
    common = {"model": model, "dtype": dtype, "block_size": 32, "prefix_caching": True, "multiprocessing": True}
    paired = ("cold",) + ("warm", "floor") * repeats
    plans = [(Reuse.VLLM_PREFIX_HIT.label, EngineSpec(**common, phases=("cold",) + ("floor",) * repeats), prompts),
             ("KVLabConnector", EngineSpec(**common, connector="kvlab", phases=paired), prompts),
             (Reuse.EXAMPLE_CONNECTOR.label, EngineSpec(**common, connector="example", phases=paired,
                                                        workdir=str(Path(workdir) / "example")), prompts),
             ("decode, no connector", EngineSpec(**common, phases=("cold",), max_tokens=decode_tokens), decode_prompts),
             ("decode, KVLabConnector", EngineSpec(**common, connector="kvlab", phases=("cold",),
                                                   max_tokens=decode_tokens), decode_prompts)]
    results = {name: run_engine(spec, these) for name, spec, these in progress(plans, desc="engines", unit="engine")}
    rows = []
    for (name, spec, _), result in zip(plans, results.values()):
        phases = result["phases"]
        row = {"engine": name, "connector": spec.connector, "model": Path(model).name, "dtype": dtype,
               "processes": "vLLM default (multiprocessing)"}
        if name.startswith("decode"):
            rates = [len(r["token_ids"]) / r["seconds"] for r in phases["cold"]]
            row.update(decode_tokens=decode_tokens, tokens_per_s=statistics.median(rates),
                       runner_save_s=statistics.median(r["save_s"] for r in phases["cold"]))
        else:
            cold, floor = summarize("cold", result, "cold"), summarize("floor", result, "floor")
            row.update(prompt_tokens=cold["prompt_tokens"], cold_s=cold["median_s"], floor_s=floor["median_s"])
            if "warm" in phases:
                warm = summarize("warm", result, "warm")
                stored = warm["cached_tokens"] * token_bytes
                save_s = statistics.median(r["save_s"] for r in phases["cold"])
                row.update(warm_s=warm["median_s"], cached_tokens=warm["cached_tokens"],
                           overhead_s=statistics.median(w["seconds"] - f["seconds"]
                                                        for w, f in zip(phases["warm"], phases["floor"])),
                           runner_save_s=save_s, stored_bytes=stored,
                           save_s_per_reference=save_s * SAVE_REFERENCE_BYTES / stored if stored else None,
                           **same_outputs(results[Reuse.VLLM_PREFIX_HIT.label], result, "cold", "warm"))
        rows.append(row)
    return rows


def sharing_runs(model: str, prompts: list[list[int]], workdir: str | Path, redis_url: str,
                 tp_model: str | None = None, tp_prompts: list[list[int]] | None = None) -> list[dict]:
    """Engine A (vLLM's default processes) computes ``prompts`` and writes through to a
    shared-memory folder and a Redis server; engine B (another process) reads only the
    shared memory, engine C (standing in for another host) only Redis. With
    ``tp_model``: an engine of two tensor-parallel ranks, its prompts cold then warm. One
    row per engine run: hits, whether its tokens equal the cold ones, the counters."""
    shm = str(Path(workdir).resolve() / "shm")
    common = {"dtype": "float32", "max_tokens": 8, "multiprocessing": True}
    writer = {"tiers": ["memory", "shm", "redis"], "shm": {"path": shm}, "redis": {"url": redis_url}}
    readers = {"shared memory, another process": {"tiers": ["shm"], "shm": {"path": shm}},
               "Redis, another host": {"tiers": ["redis"], "redis": {"url": redis_url}}}
    plans = [("writer (memory, shared memory, Redis)", EngineSpec(model, "kvlab", writer, phases=("cold", "warm"),
                                                                  **common), prompts)]
    plans += [(name, EngineSpec(model, "kvlab", extra, phases=("warm",), **common), prompts)
              for name, extra in readers.items()]
    if tp_model is not None:
        plans.append(("tensor parallel, 2 ranks", EngineSpec(tp_model, "kvlab", {}, phases=("cold", "warm"),
                                                             tensor_parallel_size=2, **common), tp_prompts or prompts))
    results = {name: run_engine(spec, these) for name, spec, these in progress(plans, desc="engines", unit="engine")}
    first = next(iter(results.values()))
    rows = []
    for (name, spec, _), result in zip(plans, results.values()):
        reference = result if "cold" in result["phases"] else first
        ranks = [r["default"] for r in result["ranks"]]
        rows.append({"engine": name, "model": Path(spec.model).name, "ranks": len(ranks),
                     "prompt_tokens": [r["prompt_tokens"] for r in result["phases"]["warm"]],
                     "cached_tokens": [r["cached_tokens"] for r in result["phases"]["warm"]],
                     "loaded_blocks_per_rank": [r["loaded_blocks"] for r in ranks],
                     "shm_reads": sum(r["store"]["shm_reads"] for r in ranks),
                     "redis_reads": sum(r["store"]["redis_reads"] for r in ranks),
                     "load_errors": sum(r["load_errors"] for r in ranks),
                     **same_outputs(reference, result, "cold", "warm")})
    return rows


def targets(serving: list[dict]) -> dict[str, Any]:
    """The issue's three targets from :func:`serving_costs` rows: the connector's TTFT
    overhead as a share of ExampleConnector's, the model runner's milliseconds in save
    calls per SAVE_REFERENCE_BYTES, decode throughput with the connector against without
    (each against its target above)."""
    by = {row["engine"]: row for row in serving}
    kvlab, example = by["KVLabConnector"], by[Reuse.EXAMPLE_CONNECTOR.label]
    ratio = kvlab["overhead_s"] / example["overhead_s"] if example["overhead_s"] > 0 else float("inf")
    save_ms = 1e3 * kvlab["save_s_per_reference"]
    decode = by["decode, KVLabConnector"]["tokens_per_s"] / by["decode, no connector"]["tokens_per_s"]
    return {"overhead_vs_example": ratio, "overhead_target_met": ratio <= OVERHEAD_VS_EXAMPLE_TARGET,
            "save_ms_per_43.6MiB": save_ms, "save_target_met": save_ms <= SAVE_TARGET_MS,
            "decode_ratio": decode, "decode_target_met": decode >= DECODE_TARGET}


def serve_check(model: str | Path, text: str, extra: dict | None = None, max_tokens: int = 16,
                log_path: str | Path | None = None) -> dict:
    """The command a user copies, ``vllm serve <model> --kv-transfer-config '{"kv_connector":
    "KVLabConnector", ..., "kv_connector_extra_config": {"enable_cross_layers_blocks": true}}'``,
    with vLLM's defaults for everything else (kvlab.runtime.servers.VLLMServer's
    ``vllm_defaults``): ``text`` cold, repeated (vLLM's own prefix cache), and repeated
    once vLLM's prefix cache is emptied (the connector). One row: the command, start-up
    seconds, cached tokens of each, and whether the connector's repeat says what vLLM's did."""
    from kvlab.runtime.servers import VLLMServer

    extra = {"enable_cross_layers_blocks": True} if extra is None else extra
    with VLLMServer(model, extra=extra, vllm_defaults=True, env={"VLLM_SERVER_DEV_MODE": "1"},
                    log_path=log_path) as server:
        command = server.command()
        processes = len(server.pids())
        cold = server.complete(text, max_tokens)
        vllm_repeat = server.complete(text, max_tokens)
        if not server.reset_prefix_cache():
            raise RuntimeError("vLLM did not empty its prefix cache")
        connector_repeat = server.complete(text, max_tokens)

    def cached(response: dict) -> int:
        return response["usage"]["prompt_tokens_details"]["cached_tokens"]

    return {"command": shlex.join(["vllm", *command[1:]]).replace(str(server.model_folder), server.model_folder.name),
            "model": server.model_folder.name, "startup_s": server.startup_seconds, "processes": processes,
            "prompt_tokens": cold["usage"]["prompt_tokens"], "cold_cached": cached(cold),
            "vllm_repeat_cached": cached(vllm_repeat), "connector_repeat_cached": cached(connector_repeat),
            "same_text": connector_repeat["choices"][0]["text"] == vllm_repeat["choices"][0]["text"]}
