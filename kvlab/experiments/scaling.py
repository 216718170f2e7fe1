"""How the connector's costs grow with what grows in serving (notebook 05, "How the costs
grow"), each measured in one run on this machine: time to first token over the prefix-hit
floor against prompt length, from each tier and through vLLM's ExampleConnector, beside the
STREAM-style copy of the same bytes (the physical bound); and throughput and TTFT
percentiles against concurrent requests through ``vllm serve``, every server on the same
compute threads.
In-process costs (a hit call by call, lookups against chunks stored): kvlab.experiments.hit_costs."""

from __future__ import annotations

import re
import shutil
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from kvlab.cache.devices import last_level_cache_bytes
from kvlab.experiments.sweep import ceiling_copy
from kvlab.harness.compare import one_prompt, same_outputs
from kvlab.harness.engine import EngineSpec, check_inputs, run_engine
from kvlab.runtime.progress import progress

CONCURRENCY = (1, 4, 16, 32)
SHARED_TIERS = ("shm", "disk", "redis")
EXAMPLE_MAX_TOKENS = 4096  # vLLM's CPU engine computes at most this many tokens per step (max_num_batched_tokens)


# ---- time to first token against prompt length ---------------------------------------------
def costs_by_length(model: str, prompts: list[list[int]], workdir: str | Path, redis_url: str,
                    dtype: str = "bfloat16", block_size: int = 32, repeats: int = 9) -> list[dict]:
    """One row per prompt (one length each) and reuse path: KVLabConnector from memory, shm,
    disk and Redis and vLLM's ExampleConnector, each warm first token against the same
    engine's own prefix hit (the floor) right after it, repeated; ``overhead_s`` their
    median difference. The memory engine holds its own tier alone (no shared tier to look
    up); another KVLab engine computes the prompts and writes them through every shared tier,
    and one engine per shared tier then reads them from that tier alone. ``stream_s`` is
    kvlab's STREAM-style copy of the loaded bytes in this process (:func:`with_stream_bound`)."""
    from kvlab.runtime.models import geometry_of

    check_inputs(model, prompts)
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if len({len(p) for p in prompts}) != len(prompts):
        raise ValueError("one prompt per length: prompts of one length would be averaged together")
    token_bytes = geometry_of(model, dtype=dtype, block_size=block_size).token_bytes
    workdir = Path(workdir).resolve()
    shm = Path("/dev/shm") / f"kvlab-lengths-{uuid.uuid4().hex[:12]}"
    where = {"shm": {"shm": {"path": str(shm), "bytes": 2 << 30}},
             "disk": {"disk": {"path": str(workdir / "disk"), "bytes": 4 << 30}}, "redis": {"redis": {"url": redis_url}}}
    common = {"model": model, "dtype": dtype, "block_size": block_size, "prefix_caching": True,
              "max_model_len": max(map(len, prompts)) + 1}
    pairs = ("warm", "floor") * repeats
    every = {"tiers": list(SHARED_TIERS), **where["shm"], **where["disk"], **where["redis"]}
    plans = [("vLLM prefix cache", EngineSpec(**common, phases=("cold", "floor"))),
             ("KVLab, memory", EngineSpec(**common, connector="kvlab", extra={"tiers": ["memory"]},
                                          phases=("cold", *pairs))),
             ("KVLab, writes the shared tiers", EngineSpec(**common, connector="kvlab", extra=every, phases=("cold",)))]
    plans += [(f"KVLab, {tier}", EngineSpec(**common, connector="kvlab", phases=pairs,
                                            extra={"tiers": [tier], **where[tier]})) for tier in SHARED_TIERS]
    # vLLM's ExampleConnector stores a prompt in the step that computes it: a prompt that
    # chunked prefill splits over steps fails its load (a shape mismatch in vLLM), so it is
    # given the prompts one step holds and the others are rows saying why
    example = [p for p in prompts if len(p) <= EXAMPLE_MAX_TOKENS]
    plans.append(("ExampleConnector", EngineSpec(**common, connector="example", workdir=str(workdir / "example"),
                                                 phases=("cold", *pairs))))
    try:
        results = {name: run_engine(spec, example if name == "ExampleConnector" else prompts)
                   for name, spec in progress(plans, desc="engines", unit="engine")}
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    rows = []
    for name, result in results.items():
        if "warm" not in result["phases"]:
            continue
        for length in sorted({len(p) for p in prompts}):
            # one prompt per length: numbered 0 here, whichever prompts an engine was given
            mine = one_prompt(result, prompt_tokens=length)
            label = {"path": name, "prompt_tokens": length, "model": Path(model).name, "dtype": dtype}
            if not mine["phases"]["warm"]:
                rows.append({**label, "overhead_s": None, "kv_bytes": 0,
                             "skipped": f"one engine step holds {EXAMPLE_MAX_TOKENS} tokens; ExampleConnector's load "
                                        "of a prompt computed over several steps fails in vLLM (a shape mismatch)"})
                continue
            warm = [r["seconds"] for r in mine["phases"]["warm"]]
            floor = [r["seconds"] for r in mine["phases"]["floor"]]
            cached = statistics.median(r["cached_tokens"] for r in mine["phases"]["warm"])
            # the same-split control: vLLM's own prefix hit on the cold run's KV (bitwise), and
            # the cold run, which splits the prefill otherwise (within SPLIT_DRIFT)
            reference = one_prompt(results["vLLM prefix cache"], ("cold", "floor"), prompt_tokens=length)
            control = same_outputs(reference, mine, "floor", "warm")
            paired = [w - f for w, f in zip(warm, floor)]
            rows.append({**label, "warm_s": statistics.median(warm), "floor_s": statistics.median(floor),
                         "overhead_s": statistics.median(paired), "overhead_samples_s": paired,
                         "cached_tokens": cached, "kv_bytes": int(cached * token_bytes), "samples": len(warm),
                         "identical_to_control": control["identical"], "logprob_diff_vs_control": control["max_logprob_diff"],
                         "gap_vs_recompute": same_outputs(reference, mine, "cold", "warm")["max_gap_through_divergence"],
                         "prompts": control["prompts"]})
    return with_stream_bound(rows)


def stream_copy_samples(nbytes: int, repeats: int = 15) -> list[float]:
    """Seconds kvlab's STREAM-style copy (kvlab's C batch copy on torch's threads, one
    contiguous run) takes for ``nbytes`` here, one sample a repeat: the physical bound of a
    load. As STREAM asks, the bytes come from memory, not from the cache: each repeat copies
    another buffer, and the buffers together are four times the last-level cache
    (:func:`last_level_cache_bytes`)."""
    cpu = torch.device("cpu")
    copies = [ceiling_copy(nbytes, "load", cpu, native=True)
              for _ in range(max(2, min(-(-4 * last_level_cache_bytes() // nbytes), (4 << 30) // nbytes)))]
    for copy in copies:
        copy()
    times = []
    for i in range(repeats):
        began = time.perf_counter()
        copies[i % len(copies)]()
        times.append(time.perf_counter() - began)
    return times


def with_stream_bound(rows: list[dict], repeats: int = 15) -> list[dict]:
    """Each row with ``stream_s``, the median of :func:`stream_copy_samples` for its
    ``kv_bytes`` (every sample in ``stream_samples_s``), and ``bound_ratio`` = overhead over
    it: the physical bound of a load."""
    bound = {nbytes: stream_copy_samples(nbytes, repeats) for nbytes in sorted({r["kv_bytes"] for r in rows
                                                                                if r["kv_bytes"]})}
    return [{**r, "stream_s": statistics.median(bound[r["kv_bytes"]]) if r["kv_bytes"] else None,
             "stream_samples_s": bound.get(r["kv_bytes"]),
             "bound_ratio": r["overhead_s"] / statistics.median(bound[r["kv_bytes"]]) if r["kv_bytes"] else None}
            for r in rows]


# ---- concurrent requests through vllm serve ---------------------------------------------------
# vLLM's CPU worker reserves one core per rank for the engine core, and one more when a KV
# connector is configured; on a 2-core machine that leaves none reserved, and the model then
# computes on both cores while a server without a connector computes on one. Servers compared
# for throughput must compute on the same threads: every one reserves exactly one core.
SAME_THREADS = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
_CORES = re.compile(r"local_rank=0, core ids=\[([\d, ]*)\]")


def compute_threads(log: str) -> int | None:
    """How many cores a `vllm serve` log says its rank-0 worker computed on (None: not said)."""
    found = _CORES.findall(log)
    return len([c for c in found[-1].split(",") if c.strip()]) if found else None


UNPINNED = "KVLabConnector, vLLM's own thread choice"  # the artefact the pin removes, measured beside it
STARTUP_TIMEOUT_S = 900.0
# 16 clients' full prefills queue behind each other on the "no cache" server: on a 2-core AVX2
# machine computing bf16 (vLLM's default for an fp32 folder) a request waits past the usual 300 s
REQUEST_TIMEOUT_S = 1800.0


def concurrency_sweep(model: str, ids: list[int], levels: tuple[int, ...] = CONCURRENCY, repeats: int = 3,
                      prefixes: int = 8, prefix_tokens: int = 512, suffix_tokens: int = 32,
                      reference_repeats: int = 1, unpinned: bool = True) -> list[dict]:
    """Requests sharing ``prefixes`` prefixes of ``prefix_tokens`` tokens, each with a suffix
    of its own, ``c`` at a time for each ``c`` in ``levels`` (2c requests, at least 8, each
    level ``repeats`` times with new suffixes), one token each (its latency is its time to
    first token), through ``vllm serve`` with vLLM's defaults and the same compute threads
    (:data:`SAME_THREADS`): with KVLabConnector, with vLLM's own prefix cache alone, with no
    cache, and with KVLabConnector alone (vLLM's prefix cache off: every reuse is a load).
    ``unpinned`` adds KVLabConnector as vLLM runs it unpinned (:data:`UNPINNED`: on 2 cores,
    both cores), so the run shows what the pin removes. "no cache", a reference a tenth as
    fast that nothing is compared with, is measured ``reference_repeats`` times. Each server
    first sees every prefix once. One row per server and level: the median throughput and
    every repeat's (``throughput_samples_rps``), p50/p99 over all its requests, and the cores
    its worker computed on (``compute_threads``, from its log)."""
    from kvlab.runtime.servers import VLLMServer

    if not levels or any(not isinstance(c, int) or c < 1 for c in levels) or min(prefixes, prefix_tokens, suffix_tokens) < 1:
        raise ValueError(f"levels must be positive request counts and the prefixes and suffixes non-empty, got "
                         f"{levels}, {prefixes} x {prefix_tokens} + {suffix_tokens}")
    for name, value in (("repeats", repeats), ("reference_repeats", reference_repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    span = prefixes * prefix_tokens
    requests = ((3 + unpinned) * repeats + reference_repeats) * sum(max(8, 2 * c) for c in levels)
    if span + requests + suffix_tokens > len(ids):
        raise ValueError(f"need {span + requests + suffix_tokens} token ids, got {len(ids)}")
    heads = [ids[i * prefix_tokens:(i + 1) * prefix_tokens] for i in range(prefixes)]
    # vLLM's defaults compile the model at start-up: minutes on a small, busy machine
    common = {"vllm_defaults": True, "startup_timeout": STARTUP_TIMEOUT_S, "request_timeout": REQUEST_TIMEOUT_S}
    servers = {
        "KVLabConnector": VLLMServer(model, "kvlab", {}, env=SAME_THREADS, **common),
        "vLLM prefix cache": VLLMServer(model, "none", env=SAME_THREADS, **common),
        "no cache": VLLMServer(model, "none", env=SAME_THREADS, args=("--no-enable-prefix-caching",), **common),
        "KVLabConnector alone": VLLMServer(model, "kvlab", {}, env=SAME_THREADS, args=("--no-enable-prefix-caching",),
                                           **common),
    }
    if unpinned:
        servers[UNPINNED] = VLLMServer(model, "kvlab", {}, **common)
    rows = []
    offset = span  # every request's suffix is new, across servers too
    for name, server in progress(servers.items(), desc="servers", unit="server"):
        with server:
            for head in heads:
                server.complete(head, 1)
            threads = compute_threads(Path(server.log_path).read_text(errors="replace"))
            for level in levels:
                count = max(8, 2 * level)
                runs = []
                for _ in range(reference_repeats if name == "no cache" else repeats):
                    batch = [heads[i % prefixes] + ids[offset + i: offset + i + suffix_tokens] for i in range(count)]
                    offset += count
                    runs.append(_serve(server, batch, level))
                rows.append({"server": name, "model": Path(model).name, "concurrency": level,
                             "compute_threads": threads, **_pooled(runs)})
    return rows


def _serve(server: Any, prompts: list[list[int]], clients: int) -> dict:
    def one(prompt: list[int]) -> tuple[float, int]:
        began = time.perf_counter()
        response = server.complete(prompt, 1)
        details = response.get("usage", {}).get("prompt_tokens_details") or {}
        return time.perf_counter() - began, details.get("cached_tokens") or 0

    began = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        done = list(pool.map(one, prompts))
    return {"requests": len(prompts), "wall_s": time.perf_counter() - began, "latencies": [t for t, _ in done],
            "cached": [c for _, c in done]}


def _pooled(runs: list[dict]) -> dict:
    """One level's repeats: throughput per repeat and its median, latency percentiles and
    cached tokens over every request."""
    rates = [run["requests"] / run["wall_s"] for run in runs]
    latencies = sorted(t for run in runs for t in run["latencies"])
    return {"requests": sum(run["requests"] for run in runs), "repeats": len(runs),
            "throughput_rps": statistics.median(rates), "throughput_samples_rps": rates,
            "ttft_p50_s": statistics.median(latencies), "ttft_p99_s": _percentile(latencies, 0.99),
            "cached_tokens": statistics.median(c for run in runs for c in run["cached"])}


def _percentile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of sorted values, linearly interpolated."""
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
