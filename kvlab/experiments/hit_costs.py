"""What one hit costs the connector, measured in this process (kvlab.harness.driver drives
it as vLLM would): where a whole-step hit's milliseconds go, call by call; a scheduler's
lookup against the chunks a tier stores, and what lookups keep in memory; a Redis load
against the server's own pace. Notebook 05, "How the costs grow"."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any, Iterator

import torch

from kvlab.cache import ModelGeometry, allocate
from kvlab.experiments.scaling import stream_copy_samples
from kvlab.runtime.progress import progress

STORED = (10, 1000, 100_000)

# ---- where a hit's milliseconds go -------------------------------------------------------------
SCHEDULER_CALLS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                   "update_connector_output", "request_finished")
WORKER_CALLS = ("handle_preemptions", "bind_connector_metadata", "start_load_kv", "wait_for_save", "get_finished",
                "build_connector_worker_meta", "get_block_ids_with_load_errors", "clear_connector_metadata")


@contextlib.contextmanager
def without_auth_key_advice() -> Iterator[None]:
    """Without the connector's advice to a deployment that runs a remote tier with no
    ``auth_key`` (a warning every notebook would print): a measurement of the tier's own pace
    runs without one on purpose, as a MAC would add its own cost."""
    def other(record: logging.LogRecord) -> bool:
        return "set auth_key" not in record.getMessage()

    logger = logging.getLogger("kvlab.connector")
    logger.addFilter(other)
    try:
        yield
    finally:
        logger.removeFilter(other)


def overhead_profile(geometry: ModelGeometry, tokens: int = 2000, repeats: int = 15, method: str = "auto",
                     layout: str = "CPU_LBHNC", extra: dict | None = None, stored_as: str | None = None) -> list[dict]:
    """Where a whole-step hit of a ``tokens``-token prefix spends its time, every connector
    call timed as vLLM makes them (kvlab.harness.driver, in this process): the scheduler's
    calls, the worker's, and within ``start_load_kv`` the copy itself
    (``load_work_seconds``). One row per call: its median milliseconds per hit request over
    ``repeats``; then the copy, the rest of the load, the total, and the STREAM-style copy
    of the loaded bytes (the bound). ``extra``: the connector's settings (memory alone by
    default; e.g. ``{"tiers": ["disk"], "disk": {"path": ...}}``). ``stored_as``: the prompt
    stored by an engine of that layout instead (through a shared tier), so every hit converts
    its chunks into ``layout`` as it loads them."""
    from kvlab.connector import reset_stores
    from kvlab.harness.driver import connector_pair, prefill, register, settle

    if tokens < 2 * geometry.block_size or repeats < 1:
        raise ValueError(f"need at least two blocks of tokens ({2 * geometry.block_size}) and one repeat, "
                         f"got {tokens} tokens and {repeats}")
    reset_stores()  # a store of an earlier run in this process (another Redis server) is not this one's
    blocks = tokens // geometry.block_size + 1
    extra = {"tiers": ["memory"], **(extra or {}), "method": method}
    if stored_as is not None and extra["tiers"] == ["memory"]:
        raise ValueError(f"a chunk stored by a {stored_as} engine reaches this one through a shared tier; "
                         f"extra names only {extra['tiers']}")
    prompt = [(13 * i + 5) % 30000 for i in range(tokens)]
    if stored_as is not None:  # another engine, with a memory of its own, writes the prompt through
        with without_auth_key_advice():
            writer_scheduler, writer = connector_pair(geometry, blocks + 1, {**extra, "store_name": "writer"})
        register(writer, f"vllm>=0.29 {stored_as}", geometry, blocks + 1)
        prefill(writer_scheduler, writer, "store", prompt, list(range(blocks)))
        settle(writer_scheduler, writer)
        writer.shutdown()
    with without_auth_key_advice():
        scheduler, worker = connector_pair(geometry, 2 * blocks + 2, extra)
    register(worker, f"vllm>=0.29 {layout}", geometry, 2 * blocks + 2)
    settle(scheduler, worker)
    if stored_as is None:
        prefill(scheduler, worker, "store", prompt, list(range(blocks)))
    spent: dict[str, list[float]] = {}
    for side, names in ((scheduler, SCHEDULER_CALLS), (worker, WORKER_CALLS)):
        for name in names:
            setattr(side, name, _timed(getattr(side, name), spent.setdefault(name, [])))
    per_request: dict[str, list[float]] = {name: [] for name in (*spent, "copy", "total")}
    loaded, stored = 0, (tokens - 1) // geometry.block_size * geometry.block_size  # the last token is computed
    for i in range(repeats + 2):  # the first two warm up
        for times in spent.values():
            times.clear()
        copy_before = worker.stats.load_work_seconds
        hit = prefill(scheduler, worker, f"hit-{i}", prompt, list(range(blocks, 2 * blocks)))["hit_tokens"]
        if hit != stored:  # a miss would store the prompt anew, and the rest would time another hit
            raise RuntimeError(f"hit {i} loaded {hit} of the {stored} tokens stored: not the hit to time")
        loaded = hit * geometry.token_bytes
        if i < 2:
            continue
        for name, times in spent.items():
            per_request[name].append(sum(times))
        per_request["copy"].append(worker.stats.load_work_seconds - copy_before)
        per_request["total"].append(sum(sum(times) for times in spent.values()))
    per_request["start_load_kv without the copy"] = [a - b for a, b in zip(per_request["start_load_kv"],
                                                                           per_request["copy"])]
    per_request["total without the copy"] = [a - b for a, b in zip(per_request["total"], per_request["copy"])]
    rows = [{"call": name, "ms": 1e3 * statistics.median(times), "samples_ms": [1e3 * t for t in times]}
            for name, times in per_request.items()]
    stream = stream_copy_samples(loaded)
    rows.append({"call": "STREAM copy of the loaded bytes", "ms": 1e3 * statistics.median(stream),
                 "samples_ms": [1e3 * t for t in stream]})
    return [{**row, "tokens": tokens, "kv_bytes": loaded, "method": worker.worker.method,
             "layout": layout, "stored_as": stored_as or layout, "tiers": "+".join(extra["tiers"])} for row in rows]


def layouts_sharing(geometry: ModelGeometry, workdir: str | Path, tokens: int = 2000, repeats: int = 15,
                    layouts: tuple[str, str] = ("CPU_LBHNC", "CPU_BLHNC"), tiers: tuple[str, ...] = ("shm", "disk")
                    ) -> list[dict]:
    """Engines of two layouts sharing one store: each layout's whole-step hit from each file
    tier (:func:`overhead_profile`, every call timed) of chunks it stored itself, and of
    chunks the other layout stored, converted as they load. Rows of both, with ``stored_as``.
    The shm tier's folders are made in ``/dev/shm``, the disk tier's in ``workdir``."""
    rows = []
    plans = [(reader, stored, tier) for tier in tiers for reader in layouts for stored in layouts]
    for reader, stored, tier in progress(plans, desc="layouts sharing a store", unit="hit"):
        with tempfile.TemporaryDirectory(dir="/dev/shm" if tier == "shm" else workdir) as folder:
            extra = {"tiers": [tier], tier: {"path": folder}}
            rows += overhead_profile(geometry, tokens, repeats, layout=reader, extra=extra,
                                     stored_as=None if stored == reader else stored)
    return rows


def _timed(call: Any, into: list[float]) -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - began)

    return timed


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
    tiers = {"disk": {"tiers": ["disk"], "disk": {"path": str(Path(workdir).resolve() / "lookup-disk")}}}
    if redis_url is not None:
        import redis

        from kvlab.store.secrets import resolve_redis_url

        redis.Redis.from_url(resolve_redis_url(redis_url)).flushdb()
        tiers["redis"] = {"tiers": ["redis"], "redis": {"url": redis_url}}
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
    from kvlab.harness.driver import connector_pair, prefill

    scheduler, worker = _engine(extra, connector_pair)
    blocks = len(prompt) // SCALE_GEOMETRY.block_size + 1
    prefill(scheduler, worker, "seed", prompt, list(range(blocks)))
    return worker.worker.signature


def _engine(extra: dict, connector_pair: Any) -> tuple[Any, Any]:
    from kvlab.connector import reset_stores
    from kvlab.harness.driver import register, settle

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
    """KVStore's tiers of the shared tiers ``extra`` names (as the connector opens them)."""
    return {"tiers": {tier: extra[tier] for tier in ("disk", "redis") if tier in extra}}


def _time_lookups(extra: dict, prompt: list[int], repeats: int, fresh: int) -> dict:
    from kvlab.harness.driver import connector_pair, vllm_request
    from kvlab.store import KVStore

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
            "lookup_samples_ms": [1e3 * t for t in again[5:]],
            "hit_tokens": hit}


def lookup_memory(workdir: str | Path, chunks: int = 2000, chunk_blocks: int = 16) -> dict:
    """What a scheduler's lookups keep per chunk, traced: the disk tier's index of a chunk
    of ``chunk_blocks`` blocks (the checked-chunk memo holds one tuple of the same keys, no
    more), and the bound its limits set: (INDEXED_CHUNKS + CHECKED_CHUNKS) chunks."""
    from kvlab.connector.scheduler import CHECKED_CHUNKS
    from kvlab.store import Chunk, KVStore
    from kvlab.store.tiers.disk import INDEXED_CHUNKS

    folder = Path(workdir) / "lookup-memory"
    writer = KVStore(capacity_bytes=1 << 20, tiers={"disk": {"path": folder}}, promote=False)
    buffer = allocate("LBHNC", SCALE_GEOMETRY, chunk_blocks)
    crc = Chunk(["0" * 32], buffer, "memory").seal().crc
    written = [[os.urandom(16).hex() for _ in range(chunk_blocks)] for _ in range(chunks)]
    for keys in written:
        writer.save(Chunk(keys, buffer, "memory", crc), memory=False)
    reader = KVStore(capacity_bytes=1 << 20, tiers={"disk": {"path": folder}}, promote=False)
    tracemalloc.start()
    for keys in written:
        reader.disk.locate_many(keys)
    per_chunk = tracemalloc.get_traced_memory()[0] / min(chunks, INDEXED_CHUNKS)
    tracemalloc.stop()
    shutil.rmtree(folder, ignore_errors=True)
    return {"chunk_blocks": chunk_blocks, "index_bytes_per_chunk": per_chunk, "indexed_chunks": INDEXED_CHUNKS,
            "checked_chunks": CHECKED_CHUNKS, "bound_mib": per_chunk * (INDEXED_CHUNKS + CHECKED_CHUNKS) / 2**20}


# ---- Redis: a load against the server's own pace ---------------------------------------------
def redis_fetch_pace(redis_url: str, geometry: ModelGeometry, tokens: int = 2000, repeats: int = 15) -> dict:
    """A worker's fetch of a ``tokens``-token prefix from Redis (a whole-step hit's load, not
    counting the copy: :func:`overhead_profile` with the Redis tier alone; one GET per
    chunk into memory of its own, the header and CRC32C checked, two chunks at a time)
    against the server's own pace for the same ready values: the same GETs read into memory
    and nothing else (``server_get_s``); redis-py's own GET beside them (``redis_py_get_s``,
    its parser copies each value twice). Medians, and the ratio of the fetch to the pace."""
    import redis

    from kvlab.store.secrets import resolve_redis_url
    from kvlab.store.tiers.resp import BulkReader

    client = redis.Redis.from_url(resolve_redis_url(redis_url))
    client.flushdb()
    profile = {row["call"]: row for row in overhead_profile(geometry, tokens, repeats,
                                                             extra={"tiers": ["redis"], "redis": {"url": redis_url}})}
    names = sorted(key.decode() for key in client.keys("kvlab:c:*"))  # the prompt's chunks, stored by the profile
    raw = BulkReader(client.connection_pool.connection_kwargs, timeout_s=30)
    ways = {"server_get_s": lambda: [raw.get(name) for name in names],
            "redis_py_get_s": lambda: [client.get(name) for name in names]}
    times: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(repeats):
        for way, fetch in ways.items():  # in turn: each sees the same machine
            began = time.perf_counter()
            if any(value is None for value in fetch()):
                raise RuntimeError(f"a chunk did not come back from Redis ({way})")
            times[way].append(time.perf_counter() - began)
    raw.close()
    medians = {way: statistics.median(seconds) for way, seconds in times.items()}
    fetch_s = profile["start_load_kv without the copy"]["ms"] / 1e3
    return {"prompt_tokens": tokens, "chunks": len(names), "kv_bytes": profile["total"]["kv_bytes"], **medians,
            "server_get_samples_s": times["server_get_s"],
            "worker_fetch_s": fetch_s, "worker_fetch_samples_s": [t / 1e3 for t in
                                                                  profile["start_load_kv without the copy"]["samples_ms"]],
            "copy_s": profile["copy"]["ms"] / 1e3, "ratio": fetch_s / medians["server_get_s"],
            "server_gbps": profile["total"]["kv_bytes"] / medians["server_get_s"] / 1e9}
