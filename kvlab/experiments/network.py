"""The cross-layer question over a network tier: what a prefix costs in a Redis server when
each contiguous run of the cache is its own object (a per-layer cache's zero-copy way),
when a chunk is gathered into one object first (KVLabConnector's Redis tier, with its
header and checksum), per cache layout. A per-layer cache (LBHNC) has a run per layer and
block; a cross-layer one (BLHNC) a run per block, or per run of adjacent blocks.

Every strategy is timed against the same server moving the same bytes as one value per
chunk from memory that is already contiguous (the ceiling: the server and its socket).

On a Redis Cluster (a ``redis-cluster://`` URL) a chunk's per-run objects are hash-tagged by
the chunk, so they live on one node and go in one pipelined round trip; what one prefix
touches is counted in nodes."""

from __future__ import annotations

import statistics
from typing import Any, Sequence

import torch

from kvlab.cache.allocation import KVCache, allocate
from kvlab.cache.geometry import ModelGeometry
from kvlab.experiments.timing import check_positive_int, repeated
from kvlab.runtime.progress import progress
from kvlab.store.chunk import Chunk
from kvlab.store.keys import signature
from kvlab.store.secrets import is_cluster_url, resolve_redis_url
from kvlab.store.tiers import RedisTier, StoreStats
from kvlab.transfer.engine import Transfer, host_buffer
from kvlab.transfer.plan import copy_plan

STRATEGIES = ("object per run", "object per chunk (gather)", "kvlab Redis tier")
PREFIX = "kvlab-bench:"


def block_runs(cache: KVCache, block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(tensor, byte offset, bytes) of each contiguous run ``block_ids`` occupy in ``cache``."""
    plan = copy_plan(cache, block_ids, host_buffer(cache, len(block_ids)), range(len(block_ids)))
    tensors, offsets, _, _, lengths = plan.lists
    return list(zip(tensors, offsets, lengths))


def packed_bytes(cache: KVCache, block_ids: Sequence[int]) -> torch.Tensor:
    """The blocks' bytes, packed (to compare what was stored with what came back)."""
    buffer = host_buffer(cache, len(block_ids))
    Transfer(cache, block_ids, buffer).run()
    return torch.cat(bytes_of(buffer))


def scatter_bytes(flat: torch.Tensor, buffer: KVCache) -> None:
    """Copy one object's bytes into ``buffer``'s tensors, laid end to end as ``packed_bytes`` joins them."""
    start = 0
    for tensor in buffer.storage:
        part = tensor.view(-1).view(torch.uint8)
        part.copy_(flat[start:start + part.numel()])
        start += part.numel()


def bytes_of(cache: KVCache) -> list[torch.Tensor]:
    """Each backing tensor of ``cache`` as its bytes (what one object per chunk joins)."""
    return [tensor.view(-1).view(torch.uint8) for tensor in cache.storage]


class _PerRun:
    """One Redis value per contiguous run, all of a chunk's in one pipelined round trip."""

    def __init__(self, client: Any, cache: KVCache, chunks: list[list[int]]) -> None:
        self.client, self.flat = client, bytes_of(cache)
        self.runs = [block_runs(cache, ids) for ids in chunks]
        self.round_trips = 0

    def objects_per_chunk(self) -> float:
        return statistics.mean(len(runs) for runs in self.runs)

    def store(self) -> None:
        for c, runs in enumerate(self.runs):
            pipe = self.client.pipeline(transaction=False)
            for r, (tensor, offset, length) in enumerate(runs):
                pipe.set(f"{PREFIX}{{{c}}}:{r}", memoryview(self.flat[tensor][offset:offset + length].numpy()))
            pipe.execute()
            self.round_trips += 1

    def fetch(self) -> None:
        for c, runs in enumerate(self.runs):
            pipe = self.client.pipeline(transaction=False)
            for r in range(len(runs)):
                pipe.get(f"{PREFIX}{{{c}}}:{r}")
            values = pipe.execute()
            self.round_trips += 1
            for (tensor, offset, length), value in zip(runs, values):
                self.flat[tensor][offset:offset + length].copy_(torch.frombuffer(bytearray(value), dtype=torch.uint8))


class _Gathered:
    """Each chunk gathered into a packed buffer and stored as one value."""

    def __init__(self, client: Any, cache: KVCache, chunks: list[list[int]]) -> None:
        self.client, self.cache, self.chunks = client, cache, chunks
        self.buffers = [host_buffer(cache, len(ids)) for ids in chunks]
        self.round_trips = 0

    def objects_per_chunk(self) -> float:
        return 1.0

    def store(self) -> None:
        for c, (ids, buffer) in enumerate(zip(self.chunks, self.buffers)):
            Transfer(self.cache, ids, buffer).run()
            self.client.set(f"{PREFIX}{c}", b"".join(memoryview(t.view(-1).view(torch.uint8).numpy())
                                                   for t in buffer.storage))
            self.round_trips += 1

    def fetch(self) -> None:
        for c, (ids, buffer) in enumerate(zip(self.chunks, self.buffers)):
            value = torch.frombuffer(bytearray(self.client.get(f"{PREFIX}{c}")), dtype=torch.uint8)
            self.round_trips += 1
            scatter_bytes(value, buffer)
            Transfer(buffer, range(len(ids)), self.cache, ids).run()


class _Tier:
    """KVLabConnector's Redis tier: gather, seal (CRC32C), one value and the blocks' index
    entries per chunk; a fetch locates its blocks (one MGET), reads and checks the chunk, scatters."""

    def __init__(self, url: str, cache: KVCache, chunks: list[list[int]]) -> None:
        self.tier = RedisTier(url, StoreStats())
        self.tier.PREFIX = PREFIX + "tier:"
        self.cache, self.chunks, self.signature = cache, chunks, signature(cache)
        self.keys = [[f"{c:04x}{b:028x}" for b in range(len(ids))] for c, ids in enumerate(chunks)]

    @property
    def round_trips(self) -> int:
        return self.tier.round_trips

    def objects_per_chunk(self) -> float:
        return 1.0 + statistics.mean(len(ids) for ids in self.chunks)  # the value, and a name per block

    def store(self) -> None:
        store_through(self.tier, self.cache, self.chunks, self.keys, self.signature)

    def fetch(self) -> None:
        fetch_through(self.tier, self.cache, self.chunks, self.keys)


def store_through(tier: Any, cache: KVCache, chunks: list[list[int]], keys: list[list[str]], sig: str) -> None:
    """A connector tier's store of a prefix: each chunk gathered, sealed (CRC32C) and put."""
    for ids, chunk_keys in zip(chunks, keys):
        buffer = host_buffer(cache, len(ids))
        Transfer(cache, ids, buffer).run()
        if not tier.put(Chunk(chunk_keys, buffer, sig).seal()):
            raise RuntimeError(f"the {tier.name} tier did not store a chunk")


def fetch_through(tier: Any, cache: KVCache, chunks: list[list[int]], keys: list[list[str]]) -> None:
    """A connector tier's fetch of a prefix: its blocks located, each chunk read, checked and scattered."""
    for ids, chunk_keys in zip(chunks, keys):
        chunk_key = {found[0] for found in tier.locate_many(chunk_keys)}.pop()
        chunk = tier.get(chunk_key)
        if chunk is None:
            raise RuntimeError(f"the {tier.name} tier lost a chunk")
        Transfer(chunk.buffer, range(len(ids)), cache, ids).run()


class _Ceiling:
    """The same bytes as one ready value per chunk: the server and the socket, no cache."""

    def __init__(self, client: Any, chunk_bytes: list[int]) -> None:
        self.client = client
        self.values = [bytes(n) for n in chunk_bytes]
        self.round_trips = 0

    def store(self) -> None:
        for c, value in enumerate(self.values):
            self.client.set(f"{PREFIX}ceiling:{c}", value)

    def fetch(self) -> None:
        for c in range(len(self.values)):
            self.client.get(f"{PREFIX}ceiling:{c}")


def timings(**samples: list[float]) -> dict[str, Any]:
    """``<name>_s`` (the median) and ``<name>_samples_s`` (every sample) for each named set."""
    return {key: value for name, times in samples.items()
            for key, value in ((f"{name}_s", statistics.median(times)), (f"{name}_samples_s", times))}


def redis_client(url: str) -> Any:
    """A redis-py client of the server, or of the cluster, at ``url``."""
    import redis

    from kvlab.store.tiers.redis_cluster import cluster_client

    client = cluster_client(url, 30) if is_cluster_url(url) else redis.Redis.from_url(resolve_redis_url(url),
                                                                                      socket_timeout=30)
    client.ping()
    return client


def _nodes(client: Any) -> list[Any]:
    """Each node's own client (a single server: itself)."""
    if hasattr(client, "get_primaries"):
        return [client.get_redis_connection(node) for node in client.get_primaries()]
    return [client]


def scattered_prefix(geometry: ModelGeometry, tokens: int, chunk_tokens: int,
                     seed: int) -> tuple[list[int], list[list[int]], torch.Generator]:
    """A ``tokens``-token prefix's blocks scattered in a cache of twice as many (every other
    block, shuffled: no two adjacent, as vLLM's allocator leaves them after a while), split
    into chunks of ``chunk_tokens``; and the generator that fills the caches."""
    check_positive_int("tokens", tokens)
    check_positive_int("chunk_tokens", chunk_tokens)
    if tokens % chunk_tokens or chunk_tokens % geometry.block_size:
        raise ValueError(f"tokens ({tokens}) must be whole chunks of chunk_tokens ({chunk_tokens}), "
                         f"and a chunk whole blocks of {geometry.block_size}")
    blocks, per_chunk = tokens // geometry.block_size, chunk_tokens // geometry.block_size
    generator = torch.Generator().manual_seed(seed)
    block_ids = (2 * torch.randperm(blocks, generator=generator)).tolist()
    return block_ids, [block_ids[i:i + per_chunk] for i in range(0, blocks, per_chunk)], generator


def random_cache(layout: str, geometry: ModelGeometry, blocks: int, generator: torch.Generator) -> KVCache:
    """A cache of ``blocks`` blocks of random bytes."""
    cache = allocate(layout, geometry, blocks)
    for tensor in cache.storage:
        tensor.view(-1).view(torch.uint8).copy_(torch.randint(0, 256, (tensor.numel() * tensor.element_size(),),
                                                              dtype=torch.uint8, generator=generator))
    return cache


def redis_prefix_costs(url: str, geometry: ModelGeometry, layouts: Sequence[str] = ("LBHNC", "BLHNC"),
                       tokens: int = 2048, chunk_tokens: int = 256, repeats: int = 5, seed: int = 0) -> list[dict]:
    """Store and fetch a ``tokens``-token prefix of random KV through the Redis server at
    ``url`` with each strategy, per layout: objects and round trips per chunk, median
    seconds over ``repeats``, the ceiling measured between them, and whether every fetched
    byte equals what was stored. The blocks are scattered in the cache (as vLLM's
    allocator leaves them after a while), so no two are adjacent. On a Redis Cluster, also
    how many of its nodes the prefix's objects landed on."""
    block_ids, chunks, generator = scattered_prefix(geometry, tokens, chunk_tokens, seed)
    client = redis_client(url)
    nodes = _nodes(client)
    rows = []
    for layout in progress(layouts, desc="layouts", unit="layout"):
        cache = random_cache(layout, geometry, 2 * len(block_ids), generator)
        expected = packed_bytes(cache, block_ids)
        chunk_bytes = [len(ids) * geometry.block_bytes for ids in chunks]
        ceiling = _Ceiling(client, chunk_bytes)
        for strategy in STRATEGIES:
            way = {"object per run": lambda: _PerRun(client, cache, chunks),
                   "object per chunk (gather)": lambda: _Gathered(client, cache, chunks),
                   "kvlab Redis tier": lambda: _Tier(url, cache, chunks)}[strategy]()
            client.flushdb()
            store, ceiling_store = repeated(way.store, repeats), repeated(ceiling.store, repeats)
            held = [sum(not key.startswith(f"{PREFIX}ceiling:".encode()) for key in  # the ceiling's apart
                        node.scan_iter(match=f"{PREFIX}*", count=1000)) for node in nodes]
            objects = sum(held)
            trips = way.round_trips
            Transfer(host_buffer(cache, len(block_ids)), range(len(block_ids)), cache, block_ids).run()  # zeros
            fetch, ceiling_fetch = repeated(way.fetch, repeats), repeated(ceiling.fetch, repeats)
            rows.append({
                "store": "redis cluster" if len(nodes) > 1 else "redis", "nodes": len(nodes),
                "nodes_touched": sum(count > 0 for count in held), "layout": layout,
                "cross_layer": cache.layout.is_cross_layer, "strategy": strategy,
                "tokens": tokens, "chunk_tokens": chunk_tokens, "chunks": len(chunks), "bytes": sum(chunk_bytes),
                "objects_per_chunk": objects / len(chunks), "planned_objects_per_chunk": way.objects_per_chunk(),
                "store_round_trips_per_chunk": trips / repeats / len(chunks),
                "fetch_round_trips_per_chunk": (way.round_trips - trips) / repeats / len(chunks),
                **timings(store=store, fetch=fetch, ceiling_store=ceiling_store, ceiling_fetch=ceiling_fetch),
                "identical": torch.equal(packed_bytes(cache, block_ids), expected),
            })
        client.flushdb()
    return rows
