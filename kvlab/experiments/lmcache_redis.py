"""LMCache's own Redis remote backend on the same prefix and server as
kvlab.experiments.network, for the row beside kvlab's strategies.

It runs LMCache's engine without vLLM (``LMCacheEngine.store`` / ``retrieve``, its storage
manager, ``RemoteBackend`` with ``remote_url="redis://..."``, serde "naive", no local CPU
tier so every fetch comes from Redis), in a process of its own: LMCache's token database
imports vLLM to find a hash function, and vLLM's CPU engine cannot start in a process that
has imported LMCache. The "device" is a CPU tensor in LMCache's KV_2LTD chunk format; LMCache
ships no CPU connector, so :func:`kv2ltd_connector` copies between it and LMCache's memory
objects. What it finds about LMCache 0.5.6 (two keys per chunk, written one after the other;
one EXISTS per chunk, then two GETs) is counted from the server's own command statistics."""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kvlab.cache.geometry import ModelGeometry
from kvlab.runtime.processes import run_child
from kvlab.store.secrets import resolve_redis_url


def lmcache_redis_costs(url: str, geometry: ModelGeometry, tokens: int = 2048, chunk_tokens: int = 256,
                        repeats: int = 5, timeout: float = 600) -> dict:
    """One row like kvlab.experiments.network.redis_prefix_costs's: LMCache storing and
    fetching ``tokens`` tokens of random KV through the Redis server at ``url``."""
    if geometry.is_mla:
        raise ValueError("this measures LMCache's K/V chunk format (KV_2LTD); give a K/V geometry")
    job = {"url": url, "layers": geometry.num_layers, "heads": geometry.num_kv_heads, "head_size": geometry.head_size,
           "dtype": str(geometry.dtype).removeprefix("torch."), "tokens": tokens, "chunk_tokens": chunk_tokens,
           "repeats": repeats, "model": geometry.name}
    # LMCache keys chunks with Python's hash() here: a fixed seed keeps its keys the same in every run
    return run_child("kvlab.experiments.lmcache_redis", job, "LMCache's Redis backend", timeout,
                     {"PYTHONHASHSEED": "0", "LMCACHE_LOG_LEVEL": "WARNING", "LMCACHE_TRACK_USAGE": "false"})


class NoVLLM:
    """Refuse ``import vllm`` in this process: LMCache's token database tries it only to find
    a hash function and falls back to Python's own, which it uses here anyway."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("vLLM is kept out of the LMCache process")
        return None


def kv2ltd_connector(source: Any, target: Any) -> Any:
    """LMCache's "GPU connector" for a CPU tensor in its KV_2LTD format [2, L, T, H*D]: it
    copies chunks from ``source`` (a store) and into ``target`` (a retrieve); LMCache ships
    none for a CPU."""
    import torch
    from lmcache.v1.gpu_connector import GPUConnectorInterface

    class CPUConnector(GPUConnectorInterface):
        def from_gpu(self, memory_obj, start, end, **kwargs):
            memory_obj.tensor.copy_(source[:, :, start:end])

        def to_gpu(self, memory_obj, start, end, **kwargs):
            target[:, :, start:end].copy_(memory_obj.tensor)

        def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
            for obj, start, end in zip(memory_objs, starts, ends):
                self.from_gpu(obj, start, end)

        def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs):
            for obj, start, end in zip(memory_objs, starts, ends):
                self.to_gpu(obj, start, end)

        def get_shape(self, num_tokens):
            return torch.Size([2, source.shape[1], num_tokens, source.shape[3]])

    return CPUConnector()


def _child(job_path: str, out_path: str) -> None:
    sys.meta_path.insert(0, NoVLLM())
    import redis

    job = json.loads(Path(job_path).read_text())
    url = resolve_redis_url(job["url"])  # LMCache takes the password in the URL (and logs it in this child)
    client = redis.Redis.from_url(url)
    client.ping()
    engine, source, target, stored = _lmcache_engine(job, url)
    Path(out_path).write_text(json.dumps(_round_trips(job, engine, client, source, target, stored)))
    # not LMCacheEngineBuilder.destroy: in LMCache 0.5.6 RedisConnector.close() waits, on its own
    # event loop, for work that loop must run (a deadlock); the process ends here instead
    os._exit(0)


def _lmcache_engine(job: dict, url: str) -> tuple[Any, Any, Any, threading.Event]:
    """LMCache's engine over the Redis server at ``url``, its source and target KV_2LTD
    tensors, and an event set when its Redis put finished (``store`` returns before that)."""
    import torch
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    layers, heads, head_size, chunk = job["layers"], job["heads"], job["head_size"], job["chunk_tokens"]
    dtype = getattr(torch, job["dtype"])
    config = LMCacheEngineConfig.from_defaults(chunk_size=chunk, local_cpu=False, max_local_cpu_size=0.5,
                                               remote_url=url.rsplit("/", 1)[0], remote_serde="naive",
                                               save_unfull_chunk=False, enable_async_loading=False)
    metadata = LMCacheMetadata(model_name=job["model"], world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=dtype, kv_shape=(layers, 2, chunk, heads, head_size),
                               chunk_size=chunk)
    generator = torch.Generator().manual_seed(0)
    source = torch.randn(2, layers, job["tokens"], heads * head_size, generator=generator).to(dtype)
    target = torch.zeros_like(source)
    engine = LMCacheEngineBuilder.get_or_create("kvlab-redis", config, metadata, kv2ltd_connector(source, target),
                                                lambda tensor, rank: None, lambda obj, rank: obj)
    engine.post_init()
    remote = next(b for b in engine.storage_manager.storage_backends.values() if type(b).__name__ == "RemoteBackend")
    connection = remote.connection
    stored = threading.Event()  # store() returns before Redis has the bytes: time until its put finished
    put = connection.batched_put

    async def signalled_put(keys, objs):
        try:
            return await put(keys, objs)
        finally:
            stored.set()

    connection.batched_put = signalled_put
    return engine, source, target, stored


def _round_trips(job: dict, engine: Any, client: Any, source: Any, target: Any, stored: threading.Event) -> dict:
    """The row: ``job["repeats"]`` stores and fetches of new keys, timed, with the objects
    and the commands per chunk the server counted."""
    import torch

    def commands() -> dict[str, int]:
        return {name.split("_", 1)[1]: stats["calls"] for name, stats in client.info("commandstats").items()}

    tokens, chunk = job["tokens"], job["chunk_tokens"]
    chunks = tokens // chunk
    store_s, fetch_s, identical = [], [], True
    for repeat in range(job["repeats"]):
        client.flushdb()
        ids = torch.arange(tokens, dtype=torch.long) + repeat * 1_000_000  # new keys: every fetch from Redis
        target.zero_()
        stored.clear()
        client.config_resetstat()
        start = time.perf_counter()
        engine.store(ids)
        if not stored.wait(60):
            raise RuntimeError("LMCache's Redis put did not finish in 60 s")
        store_s.append(time.perf_counter() - start)
        store_commands, objects = commands(), client.dbsize()
        client.config_resetstat()
        start = time.perf_counter()
        hit = int(engine.retrieve(ids, req_id=f"r{repeat}").sum())
        fetch_s.append(time.perf_counter() - start)
        fetch_commands = commands()
        identical = identical and hit == tokens and torch.equal(source.view(torch.int16), target.view(torch.int16))

    def per_chunk(counts: dict[str, int], *names: str) -> float:
        return sum(counts.get(name, 0) for name in names) / chunks

    return {"layout": "KV_2LTD", "cross_layer": False, "strategy": "LMCache Redis backend", "tokens": tokens,
            "chunk_tokens": chunk, "chunks": chunks, "bytes": source.numel() * source.element_size(),
            "objects_per_chunk": objects / chunks, "planned_objects_per_chunk": 2.0,
            # one command a round trip: LMCache sends each chunk's SETs (GETs) one after the other
            "store_round_trips_per_chunk": per_chunk(store_commands, "set"),
            "fetch_round_trips_per_chunk": per_chunk(fetch_commands, "get", "exists"),
            "store_s": statistics.median(store_s), "fetch_s": statistics.median(fetch_s),
            "ceiling_store_s": None, "ceiling_fetch_s": None, "identical": identical}


if __name__ == "__main__":
    _child(*sys.argv[1:3])
