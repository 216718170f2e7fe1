"""The cross-layer question on Mooncake Store: what a prefix costs when each contiguous run of
the paged cache is its own object (put and got straight from and into the cache, no copy),
when a chunk is one object written from a list of run descriptors (Mooncake's multi-buffer
batch calls: what its connectors do, one descriptor per cross-layer block run, one per
layer run otherwise), when a chunk is gathered into one buffer first, and through
KVLabConnector's mooncake tier; per cache layout (LBHNC per-layer, BLHNC cross-layer).

Every strategy is timed against the same store moving the same bytes as one ready object
per chunk (its own pace: master, transfer engine, socket), and the per-object and per-byte
costs are fitted from objects of several sizes (:func:`object_pace`), which is what
kvlab.experiments.scale_model scales to many hosts."""

from __future__ import annotations

import statistics
from typing import Any, Callable, Sequence

import torch

from kvlab.cache.allocation import KVCache
from kvlab.cache.geometry import ModelGeometry
from kvlab.experiments.network import (block_runs, bytes_of, fetch_through, packed_bytes, random_cache, scatter_bytes,
                                       scattered_prefix, store_through, timings)
from kvlab.experiments.timing import check_pace_sizes, repeated
from kvlab.runtime.progress import progress
from kvlab.store.keys import signature
from kvlab.store.tiers import MooncakeTier, StoreStats
from kvlab.transfer.engine import Transfer, host_buffer

STRATEGIES = ("object per run", "object per chunk (descriptor per run)", "object per chunk (gather)",
              "kvlab mooncake tier")


def _client(url: str, namespace: str) -> MooncakeTier:
    tier = MooncakeTier(f"{url}&namespace={namespace}", StoreStats())
    tier.check()
    return tier


def _ok(codes: list[int], what: str) -> None:
    if any(code < 0 for code in codes):
        raise RuntimeError(f"Mooncake {what} failed with {sorted(set(c for c in codes if c < 0))}: is the "
                           "segment large enough for the prefix (segment_mb)?")


class _Way:
    """A strategy: ``store()`` and ``fetch()`` a prefix, ``clear()`` its objects (untimed)."""

    calls = 0

    def __init__(self, tier: MooncakeTier, cache: KVCache, chunks: list[list[int]]) -> None:
        self.tier, self.client, self.cache, self.chunks = tier, tier.client, cache, chunks
        self.runs = [[(cache.storage[t].data_ptr() + offset, length) for t, offset, length in block_runs(cache, ids)]
                     for ids in chunks]
        for tensor in cache.storage:  # the cache as the transfer engine's source and target, as connectors do
            _ok([self.client.register_buffer(tensor.data_ptr(), tensor.numel() * tensor.element_size())], "register")

    def clear(self) -> None:
        self.client.remove_by_regex(f"^{self.tier.prefix}.*")


class _PerRun(_Way):
    def objects_and_descriptors(self) -> tuple[float, float]:
        runs = statistics.mean(len(r) for r in self.runs)
        return runs, runs

    def _keys(self, c: int) -> list[str]:
        return [f"{self.tier.prefix}{c}:{r}" for r in range(len(self.runs[c]))]

    def store(self) -> None:
        for c, runs in enumerate(self.runs):
            _ok(self.client.batch_put_from(self._keys(c), [p for p, _ in runs], [n for _, n in runs]), "put")
            self.calls += 1

    def fetch(self) -> None:
        for c, runs in enumerate(self.runs):
            _ok(self.client.batch_get_into(self._keys(c), [p for p, _ in runs], [n for _, n in runs]), "get")
            self.calls += 1


class _Described(_Way):
    def objects_and_descriptors(self) -> tuple[float, float]:
        return 1.0, statistics.mean(len(r) for r in self.runs)

    def store(self) -> None:
        keys = [f"{self.tier.prefix}{c}" for c in range(len(self.runs))]
        _ok(self.client.batch_put_from_multi_buffers(keys, [[p for p, _ in r] for r in self.runs],
                                                     [[n for _, n in r] for r in self.runs]), "put")
        self.calls += 1

    def fetch(self) -> None:
        keys = [f"{self.tier.prefix}{c}" for c in range(len(self.runs))]
        _ok(self.client.batch_get_into_multi_buffers(keys, [[p for p, _ in r] for r in self.runs],
                                                     [[n for _, n in r] for r in self.runs]), "get")
        self.calls += 1


class _Gathered(_Way):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.buffers = [host_buffer(self.cache, len(ids)) for ids in self.chunks]
        self.flats = [torch.cat(bytes_of(b)) for b in self.buffers]

    def objects_and_descriptors(self) -> tuple[float, float]:
        return 1.0, 1.0

    def store(self) -> None:
        for ids, buffer, flat in zip(self.chunks, self.buffers, self.flats):
            Transfer(self.cache, ids, buffer).run()
            torch.cat(bytes_of(buffer), out=flat)  # one object per chunk
        keys = [f"{self.tier.prefix}{c}" for c in range(len(self.chunks))]
        _ok(self.client.batch_put_from(keys, [f.data_ptr() for f in self.flats], [f.numel() for f in self.flats]), "put")
        self.calls += 1

    def fetch(self) -> None:
        keys = [f"{self.tier.prefix}{c}" for c in range(len(self.chunks))]
        _ok(self.client.batch_get_into(keys, [f.data_ptr() for f in self.flats], [f.numel() for f in self.flats]), "get")
        self.calls += 1
        for ids, buffer, flat in zip(self.chunks, self.buffers, self.flats):
            scatter_bytes(flat, buffer)
            Transfer(buffer, range(len(ids)), self.cache, ids).run()


class _Tier(_Way):
    """KVLabConnector's mooncake tier: gather, seal (CRC32C), chunk + header + block names per
    chunk; a fetch locates its blocks, reads and checks the chunk, scatters."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.signature = signature(self.cache)
        self.keys = [[f"{c:04x}{b:028x}" for b in range(len(ids))] for c, ids in enumerate(self.chunks)]

    def objects_and_descriptors(self) -> tuple[float, float]:
        blocks = statistics.mean(len(ids) for ids in self.chunks)
        return 2.0 + blocks, 1.0 + len(self.cache.storage) + blocks

    @property
    def calls(self) -> int:
        """The tier counts its own."""
        return self.tier.round_trips

    def store(self) -> None:
        store_through(self.tier, self.cache, self.chunks, self.keys, self.signature)

    def fetch(self) -> None:
        fetch_through(self.tier, self.cache, self.chunks, self.keys)


WAYS: dict[str, Callable[..., _Way]] = dict(zip(STRATEGIES, (_PerRun, _Described, _Gathered, _Tier)))


def ready_objects(tier: MooncakeTier, sizes: Sequence[int], repeats: int = 5) -> tuple[list[float], list[float]]:
    """Seconds of each of ``repeats`` puts, then gets, of one ready object of each of
    ``sizes`` (one batch call each way): the store's own pace for these bytes."""
    buffers = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    keys = [f"{tier.prefix}ready:{i}" for i in range(len(sizes))]
    pointers, lengths = [b.data_ptr() for b in buffers], list(sizes)
    clear = lambda: tier.client.batch_remove(keys, True)  # noqa: E731
    put = repeated(lambda: _ok(tier.client.batch_put_from(keys, pointers, lengths), "put"), repeats, clear)
    get = repeated(lambda: _ok(tier.client.batch_get_into(keys, pointers, lengths), "get"), repeats)
    clear()
    return put, get


def mooncake_prefix_costs(url: str, geometry: ModelGeometry, layouts: Sequence[str] = ("LBHNC", "BLHNC"),
                          tokens: int = 2048, chunk_tokens: int = 256, repeats: int = 5, seed: int = 0) -> list[dict]:
    """Store and fetch a ``tokens``-token prefix of random KV, scattered in the cache, through
    the Mooncake Store at ``url`` with each strategy, per layout: objects and descriptors per
    chunk, batch calls, median seconds over ``repeats``, the store's pace for the same bytes
    as ready objects, and whether every fetched byte equals what was stored."""
    block_ids, chunks, generator = scattered_prefix(geometry, tokens, chunk_tokens, seed)
    rows = []
    for layout in progress(layouts, desc="layouts", unit="layout"):
        cache = random_cache(layout, geometry, 2 * len(block_ids), generator)
        expected = packed_bytes(cache, block_ids)
        chunk_bytes = [len(ids) * geometry.block_bytes for ids in chunks]
        pace_store, pace_fetch = ready_objects(_client(url, f"pace-{layout}"), chunk_bytes, repeats)
        for strategy in STRATEGIES:
            way = WAYS[strategy](_client(url, f"costs-{layout}-{STRATEGIES.index(strategy)}"), cache, chunks)
            way.clear()
            calls = way.calls
            store = repeated(way.store, repeats, way.clear)
            store_calls = way.calls - calls
            Transfer(host_buffer(cache, len(block_ids)), range(len(block_ids)), cache, block_ids).run()  # zeros
            fetch = repeated(way.fetch, repeats)
            objects, descriptors = way.objects_and_descriptors()
            rows.append({
                "store": "mooncake", "layout": layout, "cross_layer": cache.layout.is_cross_layer,
                "strategy": strategy, "tokens": tokens, "chunk_tokens": chunk_tokens, "chunks": len(chunks),
                "bytes": sum(chunk_bytes), "objects_per_chunk": objects, "descriptors_per_chunk": descriptors,
                "store_calls_per_chunk": store_calls / repeats / len(chunks),
                "fetch_calls_per_chunk": (way.calls - calls - store_calls) / repeats / len(chunks),
                **timings(store=store, fetch=fetch, ceiling_store=pace_store, ceiling_fetch=pace_fetch),
                "identical": torch.equal(packed_bytes(cache, block_ids), expected),
            })
            way.clear()
    return rows


def object_pace(url: str, total_bytes: int = 8 << 20, object_bytes: Sequence[int] = (4 << 10, 16 << 10, 64 << 10,
                256 << 10, 1 << 20, 4 << 20), repeats: int = 5) -> list[dict]:
    """The store's pace for ``total_bytes`` as ready objects of each size (one batch call
    each way): what fits a per-object and a per-byte cost (kvlab.experiments.scale_model)."""
    check_pace_sizes(total_bytes, object_bytes, repeats)
    tier = _client(url, "object-pace")
    rows = []
    for size in progress(object_bytes, desc="object sizes", unit="size"):
        count = max(1, total_bytes // size)
        put, get = map(statistics.median, ready_objects(tier, [size] * count, repeats))
        rows.append({"store": "mooncake", "object_bytes": size, "objects": count, "bytes": size * count,
                     "put_s": put, "get_s": get})
    return rows
