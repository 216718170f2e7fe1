"""The scheduler's index of what the workers hold in memory.

Each worker keeps its chunks in its own process, where the scheduler cannot look, so the
scheduler keeps the books: it decides which chunks go into memory and which leave (its
budget is each worker's ``store_bytes``), and a chunk becomes loadable only once every
worker reported it stored. A chunk a load is about to read is pinned: it cannot be
evicted until that load's step is over. So a worker is never asked to load what it does
not hold."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvlab.store.tiers import unlist


@dataclass
class IndexedChunk:
    block_keys: tuple[str, ...]
    nbytes: int
    acks: int = 0  # workers that reported it stored
    stored: bool = False  # every worker holds it: loadable
    pins: int = 0  # loads in flight


class MemoryIndex:
    """Chunks of the workers' memory tiers, least recently used first."""

    def __init__(self, capacity_bytes: int, workers: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.workers = workers
        self.bytes = 0
        self._chunks: OrderedDict[str, IndexedChunk] = OrderedDict()
        self._blocks: dict[str, tuple[str, int]] = {}

    def locate(self, block_key: str) -> tuple[str, int, IndexedChunk] | None:
        found = self._blocks.get(block_key)
        if found is None:
            return None
        return found[0], found[1], self._chunks[found[0]]

    def reserve(self, block_keys: tuple[str, ...], nbytes: int) -> list[str] | None:
        """Make room for a new chunk (pending until the workers report it) by evicting least
        recently used stored chunks nobody is loading; returns the evicted keys (the
        workers are told to drop them), or None, evicting nothing, when it cannot fit."""
        evictable = [(key, chunk) for key, chunk in self._chunks.items() if chunk.stored and not chunk.pins]
        if block_keys[-1] in self._chunks or self.bytes + nbytes - sum(c.nbytes for _, c in evictable) > self.capacity_bytes:
            return None
        evicted = []
        for key, _ in evictable:
            if self.bytes + nbytes <= self.capacity_bytes:
                break
            self.forget(key)
            evicted.append(key)
        self._chunks[block_keys[-1]] = IndexedChunk(block_keys, nbytes)
        self.bytes += nbytes
        for position, key in enumerate(block_keys):
            self._blocks[key] = (block_keys[-1], position)
        return evicted

    def acknowledge(self, chunk_key: str, workers: int) -> None:
        chunk = self._chunks.get(chunk_key)
        if chunk is not None and not chunk.stored:
            chunk.acks += workers
            chunk.stored = chunk.acks >= self.workers

    def forget(self, chunk_key: str) -> None:
        chunk = unlist(self._chunks, self._blocks, chunk_key)
        if chunk is not None:
            self.bytes -= chunk.nbytes

    def pin(self, chunk_key: str, delta: int) -> None:
        chunk = self._chunks.get(chunk_key)
        if chunk is not None:
            chunk.pins += delta

    def touch(self, chunk_key: str) -> None:
        if chunk_key in self._chunks:
            self._chunks.move_to_end(chunk_key)

    def has_pending(self) -> bool:
        return any(not chunk.stored for chunk in self._chunks.values())

    def clear(self) -> None:
        self._chunks.clear()
        self._blocks.clear()
        self.bytes = 0

    def __contains__(self, chunk_key: str) -> bool:
        return chunk_key in self._chunks
