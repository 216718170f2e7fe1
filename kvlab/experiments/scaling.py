"""How the connector's costs grow (notebook 03, "How the costs grow"), each measured in one
run on this machine: time to first token over the prefix-hit floor against prompt length,
from each tier and through vLLM's ExampleConnector, beside the STREAM-style copy of the same
bytes (the physical bound); a scheduler's lookup time and memory against the chunks a tier
stores, and the disk tier's start-up; throughput and TTFT percentiles against concurrent
requests through ``vllm serve``."""

from __future__ import annotations

import os
import shutil
import statistics
import time
import tracemalloc
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from kvlab.cache import ModelGeometry, allocate
from kvlab.experiments.sweep import ceiling_copy
from kvlab.runtime.progress import progress
from kvlab.testing.compare import same_outputs
from kvlab.testing.engine import EngineSpec, check_inputs, run_engine

LENGTHS = (512, 2048, 8000)  # SmolLM2 holds 8192 tokens
STORED = (10, 1000, 100_000)
CONCURRENCY = (1, 4, 16, 32)
SHARED_TIERS = ("shm", "disk", "redis")


# ---- time to first token against prompt length ---------------------------------------------
def costs_by_length(model: str, prompts: list[list[int]], workdir: str | Path, redis_url: str,
                    dtype: str = "bfloat16", block_size: int = 32, repeats: int = 3) -> list[dict]:
    """One row per prompt (one length each) and reuse path: KVLabConnector from memory, shm,
    disk and Redis and vLLM's ExampleConnector, each warm first token against the same
    engine's own prefix hit (the floor) right after it, repeated; ``overhead_s`` their
    median difference. One KVLab engine computes the prompts and writes them through every
    tier; one engine per shared tier then reads them from that tier alone. ``stream_s`` is
    kvlab's STREAM-style copy of the loaded bytes in this process (:func:`with_stream_bound`)."""
    from kvlab.runtime.models import geometry_of

    check_inputs(model, prompts)
    if len({len(p) for p in prompts}) != len(prompts):
        raise ValueError("one prompt per length: prompts of one length would be averaged together")
    token_bytes = geometry_of(model, dtype=dtype, block_size=block_size).token_bytes
    workdir = Path(workdir).resolve()
    shm = Path("/dev/shm") / f"kvlab-lengths-{uuid.uuid4().hex[:12]}"
    where = {"shm": {"shm_path": str(shm)}, "disk": {"disk_path": str(workdir / "disk")}, "redis": {"redis_url": redis_url}}
    common = {"model": model, "dtype": dtype, "block_size": block_size, "prefix_caching": True}
    pairs = ("warm", "floor") * repeats
    every = {"tiers": ["memory", *SHARED_TIERS], **where["shm"], **where["disk"], **where["redis"],
             "shm_bytes": 2 << 30, "disk_bytes": 4 << 30}
    plans = [("vLLM prefix cache", EngineSpec(**common, phases=("cold",))),
             ("KVLab, memory", EngineSpec(**common, connector="kvlab", extra=every, phases=("cold", *pairs)))]
    plans += [(f"KVLab, {tier}", EngineSpec(**common, connector="kvlab", phases=pairs,
                                            extra={"tiers": [tier], **where[tier]})) for tier in SHARED_TIERS]
    plans.append(("ExampleConnector", EngineSpec(**common, connector="example", workdir=str(workdir / "example"),
                                                 phases=("cold", *pairs))))
    try:
        results = {name: run_engine(spec, prompts) for name, spec in progress(plans, desc="engines", unit="engine")}
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    rows = []
    for name, result in results.items():
        if "warm" not in result["phases"]:
            continue
        for length in sorted({len(p) for p in prompts}):
            mine = {"phases": {phase: [r for r in runs if r["prompt_tokens"] == length]
                               for phase, runs in result["phases"].items()}}
            warm = [r["seconds"] for r in mine["phases"]["warm"]]
            floor = [r["seconds"] for r in mine["phases"]["floor"]]
            cached = statistics.median(r["cached_tokens"] for r in mine["phases"]["warm"])
            reference = {"phases": {"cold": [r for r in results["vLLM prefix cache"]["phases"]["cold"]
                                             if r["prompt_tokens"] == length]}}
            rows.append({"path": name, "prompt_tokens": length, "model": Path(model).name, "dtype": dtype,
                         "warm_s": statistics.median(warm), "floor_s": statistics.median(floor),
                         "overhead_s": statistics.median(w - f for w, f in zip(warm, floor)),
                         "cached_tokens": cached, "kv_bytes": int(cached * token_bytes), "samples": len(warm),
                         **same_outputs(reference, mine, "cold", "warm")})
    return with_stream_bound(rows)


def with_stream_bound(rows: list[dict], repeats: int = 15) -> list[dict]:
    """Each row with ``stream_s``, the median time kvlab's STREAM-style copy (kvlab's C batch
    copy on torch's threads, one contiguous run) takes for its ``kv_bytes`` here, and
    ``bound_ratio`` = overhead over it: the physical bound of a load."""
    cpu = torch.device("cpu")
    bound: dict[int, float] = {}
    for nbytes in sorted({r["kv_bytes"] for r in rows if r["kv_bytes"]}):
        copy = ceiling_copy(nbytes, "load", cpu, native=True)
        copy()
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            copy()
            times.append(time.perf_counter() - began)
        bound[nbytes] = statistics.median(times)
    return [{**r, "stream_s": bound.get(r["kv_bytes"]),
             "bound_ratio": r["overhead_s"] / bound[r["kv_bytes"]] if r["kv_bytes"] else None} for r in rows]


# ---- lookups against the chunks stored ---------------------------------------------------
SCALE_GEOMETRY = ModelGeometry("lookup-scale", 1, 1, 8, torch.float16, 16)  # 512-byte blocks: 100k files fit
LOOKUP_CHUNK_TOKENS = 256


def lookup_scaling(workdir: str | Path, redis_url: str | None, stored: tuple[int, ...] = STORED,
                   tokens: int = 2048, repeats: int = 30, fresh: int = 5) -> list[dict]:
    """A scheduler's lookup of a ``tokens``-token prompt whose chunks a shared tier holds,
    with ``stored`` chunks in all (the others synthetic, one block each, as another engine
    would have written them), for the disk tier and, with ``redis_url``, Redis (its database
    is emptied first). Per size: the tier's start-up (``startup_ms``: a store opening it),
    the first lookup of a new engine (``first_lookup_ms``: headers read, index filled) and
    its memory (``first_lookup_kib``, traced), and a repeated lookup (``lookup_ms``, median
    of ``repeats``)."""
    tiers = {"disk": {"tiers": ["disk"], "disk_path": str(Path(workdir).resolve() / "lookup-disk")}}
    if redis_url is not None:
        import redis

        from kvlab.store.secrets import resolve_redis_url

        redis.Redis.from_url(resolve_redis_url(redis_url)).flushdb()
        tiers["redis"] = {"tiers": ["redis"], "redis_url": redis_url}
    rows = []
    for tier, extra in tiers.items():
        extra = {**extra, "chunk_size": LOOKUP_CHUNK_TOKENS}
        prompt = [(7 * i + 11) % 30000 for i in range(tokens + 1)]
        signature = _store_prompt(extra, prompt)
        filled = 0
        for count in progress(stored, desc=f"{tier}: chunks stored", unit="size"):
            filled = _fill(extra, signature, filled, count)
            rows.append({"tier": tier, "stored_chunks": count, "prompt_tokens": tokens,
                         **_time_lookups(extra, prompt, repeats, fresh)})
    return rows


def _store_prompt(extra: dict, prompt: list[int]) -> str:
    """Store the prompt's chunks through a connector (as an engine would); the workers'
    cache signature."""
    from kvlab.testing.driver import connector_pair, prefill

    scheduler, worker = _engine(extra, connector_pair)
    blocks = len(prompt) // SCALE_GEOMETRY.block_size + 1
    prefill(scheduler, worker, "seed", prompt, list(range(blocks)))
    return scheduler.scheduler.signature


def _engine(extra: dict, connector_pair: Any) -> tuple[Any, Any]:
    from kvlab.connector import reset_stores
    from kvlab.testing.driver import register, settle

    reset_stores()
    blocks = 4096 // SCALE_GEOMETRY.block_size + 8
    scheduler, worker = connector_pair(SCALE_GEOMETRY, blocks, extra)
    register(worker, "vllm>=0.29 LBHNC", SCALE_GEOMETRY, blocks)
    settle(scheduler, worker)  # the scheduler learns the workers' cache
    return scheduler, worker


def _fill(extra: dict, signature: str, filled: int, count: int) -> int:
    """Write synthetic one-block chunks until ``count`` are stored in all."""
    from kvlab.store import Chunk, KVStore

    store = KVStore(capacity_bytes=1 << 20, promote=False, **_store_settings(extra))
    buffer = allocate("LBHNC", SCALE_GEOMETRY, 1)
    sealed = Chunk([os.urandom(16).hex()], buffer, signature).seal()
    for _ in range(max(0, count - filled)):
        store.save(Chunk([os.urandom(16).hex()], buffer, signature, sealed.crc), memory=False)
    return max(filled, count)


def _store_settings(extra: dict) -> dict:
    return {key: extra[key] for key in ("disk_path", "redis_url") if key in extra}


def _time_lookups(extra: dict, prompt: list[int], repeats: int, fresh: int) -> dict:
    from kvlab.store import KVStore
    from kvlab.testing.driver import connector_pair, vllm_request

    startup = []
    for _ in range(3):
        began = time.perf_counter()
        KVStore(capacity_bytes=1 << 20, **_store_settings(extra))
        startup.append(time.perf_counter() - began)
    firsts = []
    for i in range(fresh):  # a new engine's first lookup: every header read, the index filled
        scheduler, _ = _engine(extra, connector_pair)
        began = time.perf_counter()
        hit, _ = scheduler.get_num_new_matched_tokens(vllm_request(f"first-{i}", prompt), 0)
        firsts.append(time.perf_counter() - began)
    expected = (len(prompt) - 1) // SCALE_GEOMETRY.block_size * SCALE_GEOMETRY.block_size
    if hit != expected:
        raise RuntimeError(f"the lookup found {hit} of the prompt's {expected} stored tokens")
    again = []
    for i in range(repeats + 5):  # the first five warm up
        request = vllm_request(f"again-{i}", prompt)
        began = time.perf_counter()
        scheduler.get_num_new_matched_tokens(request, 0)
        again.append(time.perf_counter() - began)
        scheduler.request_finished(request, [])  # as vLLM ends it: its state goes
    scheduler, _ = _engine(extra, connector_pair)
    tracemalloc.start()  # what a first lookup keeps (the scheduler's memo, the tier's index), untimed
    scheduler.get_num_new_matched_tokens(vllm_request("traced", prompt), 0)
    kept = tracemalloc.get_traced_memory()[0] / 1024
    tracemalloc.stop()
    return {"startup_ms": 1e3 * statistics.median(startup), "first_lookup_ms": 1e3 * statistics.median(firsts),
            "first_lookup_kib": kept, "lookup_ms": 1e3 * statistics.median(again[5:]),
            "hit_tokens": hit}


# ---- concurrent requests through vllm serve ---------------------------------------------------
def concurrency_sweep(model: str, ids: list[int], levels: tuple[int, ...] = CONCURRENCY,
                      prefixes: int = 8, prefix_tokens: int = 512, suffix_tokens: int = 32) -> list[dict]:
    """Requests sharing ``prefixes`` prefixes of ``prefix_tokens`` tokens, each with a suffix
    of its own, ``c`` at a time for each ``c`` in ``levels`` (2c requests, at least 8), one
    token each (its latency is its time to first token), through ``vllm serve`` with vLLM's
    defaults: with KVLabConnector, with vLLM's own prefix cache alone, with no cache, and
    with KVLabConnector alone (vLLM's prefix cache off: every reuse is a load). Each server
    first sees every prefix once. One row per server and level: throughput and p50/p99."""
    from kvlab.runtime.servers import VLLMServer

    span = prefixes * prefix_tokens
    requests = sum(max(8, 2 * c) for c in levels)
    if span + requests + suffix_tokens > len(ids):
        raise ValueError(f"need {span + requests + suffix_tokens} token ids, got {len(ids)}")
    heads = [ids[i * prefix_tokens:(i + 1) * prefix_tokens] for i in range(prefixes)]
    servers = {
        "KVLabConnector": VLLMServer(model, "kvlab", {}, vllm_defaults=True),
        "vLLM prefix cache": VLLMServer(model, "none", vllm_defaults=True),
        "no cache": VLLMServer(model, "none", vllm_defaults=True, args=("--no-enable-prefix-caching",)),
        "KVLabConnector alone": VLLMServer(model, "kvlab", {}, vllm_defaults=True,
                                           args=("--no-enable-prefix-caching",)),
    }
    rows = []
    for name, server in progress(servers.items(), desc="servers", unit="server"):
        with server:
            for head in heads:
                server.complete(head, 1)
            offset = span
            for level in levels:
                count = max(8, 2 * level)
                batch = [heads[i % prefixes] + ids[offset + i: offset + i + suffix_tokens] for i in range(count)]
                offset += count
                rows.append({"server": name, "concurrency": level, **_serve(server, batch, level)})
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
    wall = time.perf_counter() - began
    latencies = sorted(t for t, _ in done)
    return {"requests": len(prompts), "wall_s": wall, "throughput_rps": len(prompts) / wall,
            "ttft_p50_s": statistics.median(latencies), "ttft_p99_s": _percentile(latencies, 0.99),
            "cached_tokens": statistics.median(c for _, c in done)}


def _percentile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of sorted values, linearly interpolated."""
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


# ---- Redis: a load against the server's own pace ---------------------------------------------
def redis_fetch_pace(redis_url: str, geometry: ModelGeometry, tokens: int = 2048, chunk_tokens: int = 256,
                     repeats: int = 15) -> dict:
    """A ``tokens``-token prefix stored in Redis as chunks of ``chunk_tokens``, fetched the way
    a worker does (the Redis tier's ``get``: one GET per chunk, then the header checked, the
    CRC32C and a view of the bytes without a copy) against the server's own pace for the
    same ready values (a bare GET of each): medians, and their ratio."""
    import redis

    from kvlab.store import Chunk, KVStore, block_hashes, signature
    from kvlab.store.secrets import resolve_redis_url

    client = redis.Redis.from_url(resolve_redis_url(redis_url))
    client.flushdb()
    store = KVStore(capacity_bytes=1 << 20, redis_url=redis_url, promote=False)
    tier = store.tier("redis")
    blocks = chunk_tokens // geometry.block_size
    keys = block_hashes(list(range(tokens)), geometry.block_size, "pace")
    chunks = []
    for first in range(0, len(keys), blocks):
        buffer = allocate("LBHNC", geometry, len(keys[first:first + blocks]))
        for part in buffer.storage:
            part.view(torch.uint8).random_()
        chunks.append(Chunk(keys[first:first + blocks], buffer, signature(buffer)).seal())
        store.save(chunks[-1], memory=False)
    names = [tier.PREFIX + "c:" + chunk.key for chunk in chunks]
    bare, ours = [], []
    for _ in range(repeats):
        began = time.perf_counter()
        for name in names:
            client.get(name)
        bare.append(time.perf_counter() - began)
        began = time.perf_counter()
        for chunk in chunks:
            if tier.get(chunk.key) is None:
                raise RuntimeError(f"chunk {chunk.key} did not come back from Redis")
        ours.append(time.perf_counter() - began)
    nbytes = sum(chunk.nbytes for chunk in chunks)
    return {"prompt_tokens": tokens, "chunks": len(chunks), "kv_bytes": nbytes,
            "server_get_s": statistics.median(bare), "tier_get_s": statistics.median(ours),
            "ratio": statistics.median(ours) / statistics.median(bare),
            "server_gbps": nbytes / statistics.median(bare) / 1e9}


# ---- where a hit's milliseconds go -------------------------------------------------------------
SCHEDULER_CALLS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                   "update_connector_output", "request_finished")
WORKER_CALLS = ("handle_preemptions", "bind_connector_metadata", "start_load_kv", "wait_for_save", "get_finished",
                "build_connector_worker_meta", "get_block_ids_with_load_errors", "clear_connector_metadata")


def overhead_profile(geometry: ModelGeometry, tokens: int = 2000, repeats: int = 15, method: str = "auto",
                     layout: str = "CPU_LBHNC", tiers: tuple[str, ...] = ("memory",)) -> list[dict]:
    """Where a whole-step hit of a ``tokens``-token prefix spends its time, every connector
    call timed as vLLM makes them (kvlab.testing.driver, in this process): the scheduler's
    calls, the worker's, and within ``start_load_kv`` the copy itself
    (``load_work_seconds``). One row per call: its median milliseconds per hit request over
    ``repeats``; then the copy, the rest of the load, the total, and the STREAM-style copy
    of the loaded bytes (the bound)."""
    from kvlab.testing.driver import connector_pair, prefill, register, settle

    blocks = tokens // geometry.block_size + 1
    scheduler, worker = connector_pair(geometry, 2 * blocks + 2, {"tiers": list(tiers), "method": method})
    register(worker, f"vllm>=0.29 {layout}", geometry, 2 * blocks + 2)
    settle(scheduler, worker)
    prompt = [(13 * i + 5) % 30000 for i in range(tokens)]
    prefill(scheduler, worker, "store", prompt, list(range(blocks)))
    spent: dict[str, list[float]] = {}
    for side, names in ((scheduler, SCHEDULER_CALLS), (worker, WORKER_CALLS)):
        for name in names:
            setattr(side, name, _timed(getattr(side, name), spent.setdefault(name, [])))
    per_request: dict[str, list[float]] = {name: [] for name in (*spent, "copy", "total")}
    loaded = 0
    for i in range(repeats + 2):  # the first two warm up
        for times in spent.values():
            times.clear()
        copy_before = worker.stats.load_work_seconds
        hit = prefill(scheduler, worker, f"hit-{i}", prompt, list(range(blocks, 2 * blocks)))["hit_tokens"]
        loaded = hit * geometry.token_bytes
        if i < 2:
            continue
        for name, times in spent.items():
            per_request[name].append(sum(times))
        per_request["copy"].append(worker.stats.load_work_seconds - copy_before)
        per_request["total"].append(sum(sum(times) for times in spent.values()))
    rows = [{"call": name, "ms": 1e3 * statistics.median(times)} for name, times in per_request.items()]
    medians = {row["call"]: row["ms"] for row in rows}
    rows.append({"call": "start_load_kv without the copy", "ms": medians["start_load_kv"] - medians["copy"]})
    rows.append({"call": "total without the copy", "ms": medians["total"] - medians["copy"]})
    (bound,) = with_stream_bound([{"kv_bytes": loaded, "overhead_s": medians["total"] / 1e3}])
    rows.append({"call": "STREAM copy of the loaded bytes", "ms": 1e3 * bound["stream_s"]})
    return [{**row, "tokens": tokens, "kv_bytes": loaded, "method": worker.worker.method if hasattr(worker.worker, "method") else method,
             "layout": layout, "tiers": "+".join(tiers)} for row in rows]


def _timed(call: Any, into: list[float]) -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - began)

    return timed
