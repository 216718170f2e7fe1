"""Run vLLM's CPU engine with and without KV connectors, one engine per process, and time
the first token.

Each engine runs in a fresh Python process (``python -m kvlab.engine``), so connector
stores, compile caches and thread bindings never leak between the things compared, and
"a new process" is literally one. Every engine is pinned to the same thread count (on a
2-core machine vLLM otherwise reserves a second core when a connector is configured and
runs the model on a different number of threads). Imports vLLM only in the child process.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

# Same threads for every engine compared (see the class docstring).
PINNED_ENV = {
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

CONNECTORS = ("none", "kvlab", "example")


def kv_transfer_config(connector: str, extra: dict[str, Any] | None = None, workdir: str | Path | None = None) -> dict | None:
    """The ``kv_transfer_config`` of an engine: KVLabConnector, vLLM's ExampleConnector
    (files under ``workdir``) or none."""
    if connector not in CONNECTORS:
        raise ValueError(f"connector must be one of {list(CONNECTORS)}, got {connector!r}")
    if connector == "none":
        return None
    if connector == "kvlab":
        return {"kv_connector": "KVLabConnector", "kv_connector_module_path": "kvlab.connector",
                "kv_role": "kv_both", "kv_connector_extra_config": dict(extra or {})}
    if workdir is None:
        raise ValueError("ExampleConnector needs a workdir for its files")
    return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(workdir), **(extra or {})}}


@dataclass
class EngineSpec:
    """One engine and what to run on it: each phase sends every prompt once, in order.

    Phases: "cold" (first sight), "floor" (again, served by vLLM's own prefix cache:
    nothing moves), "warm" (vLLM's prefix cache emptied before each prompt when it is on,
    so the prefix can only come from the connector), "warm-disk" (also the connector's
    in-memory tier emptied, so KV comes from disk). "cold" runs every prompt first; the
    other phases then run in order for one prompt after another. A phase named more than
    once is repeated and its rows pooled; alternating "floor" and "warm" pairs each
    connector sample with a floor sample of the same prompt in the same engine.
    """

    model: str
    connector: str = "none"
    extra: dict[str, Any] = field(default_factory=dict)
    prefix_caching: bool = False
    phases: tuple[str, ...] = ("cold", "warm")
    dtype: str = "bfloat16"
    block_size: int = 32
    max_tokens: int = 1
    max_model_len: int = 4096
    workdir: str | None = None


def run_engine(spec: EngineSpec, prompts: list[list[int]], timeout: float = 900) -> dict:
    """Start ``spec`` in a new process, run its phases over ``prompts`` (token ids) and
    return per-phase, per-prompt first-token times, outputs, cache hits and connector stats."""
    if not prompts or not all(prompts):
        raise ValueError("need at least one non-empty prompt")
    if not (Path(spec.model) / "config.json").exists():
        raise FileNotFoundError(f"no model folder at {spec.model} (a folder with config.json; "
                                "kvlab.models.model_path gives the prepared ones)")
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.json"
        out = Path(tmp) / "out.json"
        job.write_text(json.dumps({"spec": asdict(spec), "prompts": prompts}))
        env = {**os.environ, **PINNED_ENV}
        proc = subprocess.run([sys.executable, "-m", "kvlab.engine", str(job), str(out)], env=env,
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-25:])
            raise RuntimeError(f"engine {spec.connector} on {spec.model} failed (exit {proc.returncode}):\n{tail}")
        return json.loads(out.read_text())


def _child(job_path: str, out_path: str) -> None:
    """The engine process: build the LLM, run the phases, write JSON."""
    import time

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from kvlab.connector import drop_memory_tiers

    job = json.loads(Path(job_path).read_text())
    spec = EngineSpec(**job["spec"])
    transfer = kv_transfer_config(spec.connector, spec.extra, spec.workdir)
    llm = LLM(model=spec.model, dtype=spec.dtype, block_size=spec.block_size, enforce_eager=True,
              enable_prefix_caching=spec.prefix_caching, max_model_len=spec.max_model_len, seed=0,
              kv_transfer_config=KVTransferConfig(**transfer) if transfer else None)
    params = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, logprobs=1)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)  # warm-up, no shared prefix
    result: dict[str, Any] = {"phases": {}}
    if "floor" in spec.phases and not spec.prefix_caching:
        raise ValueError("the floor phase needs prefix caching on")
    # "cold" is every prompt's first sight; the other phases run prompt by prompt, so a
    # "floor" right after a warm run of the same prompt really is vLLM's own prefix hit
    # (emptying vLLM's prefix cache for one prompt's warm run empties it for all).
    firsts = [p for p in spec.phases if p == "cold"]
    schedule = [(phase, i) for phase in firsts for i in range(len(job["prompts"]))]
    schedule += [(phase, i) for i in range(len(job["prompts"])) for phase in spec.phases if phase != "cold"]
    for phase, index in schedule:
        ids = job["prompts"][index]
        if phase == "warm-disk":
            drop_memory_tiers()
        if phase.startswith("warm") and spec.prefix_caching:
            llm.reset_prefix_cache()  # vLLM's own copy goes; the connector's store stays
        start = time.perf_counter()
        output = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - start
        completion = output.outputs[0]
        result["phases"].setdefault(phase, []).append({
            "prompt": index, "seconds": seconds, "prompt_tokens": len(ids), "cached_tokens": output.num_cached_tokens or 0,
            "token_ids": list(completion.token_ids),
            "logprobs": [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)],
        })
    if spec.connector == "kvlab":
        from kvlab.connector import all_stats

        result["connector"] = all_stats()
    Path(out_path).write_text(json.dumps(result))


def summarize(name: str, result: dict, phase: str, **labels: Any) -> dict:
    """One table row: median, min and max first-token time of a phase over its prompts
    (and repeats)."""
    rows = result["phases"][phase]
    times = [r["seconds"] for r in rows]
    return {
        "scenario": name, "phase": phase, **labels, "samples": len(rows),
        "prompt_tokens": statistics.median(r["prompt_tokens"] for r in rows),
        "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
        "cached_tokens": statistics.median(r["cached_tokens"] for r in rows),
    }


def same_outputs(a: dict, b: dict, phase_a: str = "cold", phase_b: str = "warm") -> dict:
    """Do two runs agree, prompt by prompt: how many prompts gave identical tokens every
    time, and the largest chosen-token logprob difference."""
    reference = {row["prompt"]: row for row in a["phases"][phase_a]}
    same: dict[int, bool] = {}
    diff = 0.0
    for row in b["phases"][phase_b]:
        ref = reference[row["prompt"]]
        same[row["prompt"]] = same.get(row["prompt"], True) and row["token_ids"] == ref["token_ids"]
        diff = max([diff] + [abs(p - q) for p, q in zip(row["logprobs"], ref["logprobs"])])
    return {"identical": sum(same.values()), "prompts": len(same), "max_logprob_diff": diff}


def ttft_scenarios(model: str, prompts: list[list[int]], workdir: str | Path, dtype: str = "bfloat16",
                   block_size: int = 32, chunk_size: int | None = None,
                   modes: tuple[str, ...] = ("whole-step", "layerwise"), repeats: int = 3) -> list[dict]:
    """Time to first token, one engine per process, every engine on the same threads and
    with vLLM's prefix cache on: recompute (first sight), vLLM's own prefix-cache hit (the
    floor: the KV is in place, nothing moves), and the same prompts served through
    KVLabConnector in each of ``modes`` (memory; disk in the same process and in a new
    one; whole-step also with every memory hit checksummed) and vLLM's ExampleConnector,
    vLLM's prefix cache emptied before each of those. Every engine also records its own
    prefix-hit time between its warm runs (``engine_floor_s``: how much the engine itself
    drifts). Each warm row also says whether its outputs equal recompute's; overheads
    come from :func:`with_overheads`."""
    workdir = Path(workdir)
    common = {"model": model, "dtype": dtype, "block_size": block_size, "prefix_caching": True}
    kvlab = {"chunk_size": chunk_size} if chunk_size else {}

    def paired(*phases: str) -> tuple[str, ...]:  # each floor right after a warm run of its prompt
        return tuple(p for _ in range(repeats) for phase in phases for p in (phase, "floor"))

    plans = [("vLLM prefix cache", EngineSpec(**common, phases=("cold",) + ("floor",) * repeats),
              {"cold": "recompute", "floor": "vLLM prefix hit"})]
    for mode in modes:
        extra = {**kvlab, "layerwise": mode == "layerwise", "store": "disk", "disk_path": str(workdir / f"kvlab-{mode}")}
        plans.append((f"KVLab {mode}", EngineSpec(**common, connector="kvlab", extra=extra,
                                                  phases=("cold", *paired("warm", "warm-disk"))),
                      {"warm": f"KVLab {mode}, memory", "warm-disk": f"KVLab {mode}, disk"}))
        plans.append((f"KVLab {mode} new process", EngineSpec(**common, connector="kvlab", extra=extra,
                                                              phases=paired("warm-disk")),
                      {"warm-disk": f"KVLab {mode}, disk, new process"}))
        if mode == "whole-step":
            checked = {**kvlab, "verify": "always"}
            plans.append((f"KVLab {mode} checked", EngineSpec(**common, connector="kvlab", extra=checked,
                                                              phases=("cold", *paired("warm"))),
                          {"warm": f"KVLab {mode}, memory, CRC at every hit"}))
    plans.append(("ExampleConnector", EngineSpec(**common, connector="example", workdir=str(workdir / "example"),
                                                 phases=("cold", *paired("warm"))),
                  {"warm": "ExampleConnector"}))
    rows, results = [], {}
    for name, spec, labels in tqdm(plans, desc="engines", unit="engine"):
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
    plain = next((r["median_s"] for r in rows if r["scenario"] == "vLLM prefix hit"), None)
    if plain is None:
        raise ValueError("these rows have no 'vLLM prefix hit' row (the floor): rows of ttft_scenarios are needed")
    return [{**r, "overhead_s": None if r["phase"] == "cold" else r["median_s"] - r.get("engine_floor_s", plain),
             "overhead_vs_plain_s": None if r["phase"] == "cold" else r["median_s"] - plain} for r in rows]


if __name__ == "__main__":
    _child(*sys.argv[1:3])
