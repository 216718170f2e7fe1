"""The scheduler's index of what the workers hold in memory.

Each worker keeps its chunks in its own process, where the scheduler cannot look, so the
scheduler keeps the books: it decides which chunks go into memory and which leave (its
budget is each worker's ``store_bytes``), and a chunk becomes loadable only once every
worker reported it stored. A chunk a load is about to read is pinned: it cannot be
evicted until that load's step is over. So a worker is never asked to load what it does
not hold."""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.store.tiers.lru import Booked, LRUBook


@dataclass
class IndexedChunk:
    block_keys: tuple[str, ...]
    nbytes: int
    acks: int = 0  # workers that reported it stored
    stored: bool = False  # every worker holds it: loadable
    pins: int = 0  # loads in flight


class MemoryIndex(Booked):
    """Chunks of the workers' memory tiers, least recently used first (in the store's LRU
    book, kvlab.store.tiers.LRUBook, as a memory tier keeps its own)."""

    def __init__(self, capacity_bytes: int, workers: int) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers <= 0:
            raise ValueError(f"workers must be a positive number of workers, got {workers!r}")
        self.workers = workers
        self._book: LRUBook[IndexedChunk] = LRUBook(capacity_bytes)

    def locate(self, block_key: str) -> tuple[str, int, IndexedChunk] | None:
        found = self._book.locate(block_key)
        if found is None:
            return None
        return found[0], found[1], self._book.get(found[0])

    def reserve(self, block_keys: tuple[str, ...], nbytes: int) -> list[str] | None:
        """Make room for a new chunk (pending until the workers report it) by evicting least
        recently used stored chunks nobody is loading; returns the evicted keys (the
        workers are told to drop them), or None, evicting nothing, when it cannot fit."""
        if block_keys[-1] in self._book:
            return None
        evicted = self._book.make_room(nbytes, lambda chunk: chunk.stored and not chunk.pins)
        if evicted is not None:
            self._book.add(block_keys[-1], IndexedChunk(tuple(block_keys), nbytes))
        return evicted

    def acknowledge(self, chunk_key: str, workers: int) -> None:
        chunk = self._book.get(chunk_key)
        if chunk is not None and not chunk.stored:
            chunk.acks += workers
            chunk.stored = chunk.acks >= self.workers

    def forget(self, chunk_key: str) -> None:
        self._book.remove(chunk_key)

    def pin(self, chunk_key: str, delta: int) -> None:
        chunk = self._book.get(chunk_key)
        if chunk is not None:
            chunk.pins += delta

    def has_pending(self) -> bool:
        return any(not chunk.stored for chunk in self._book.values())

    def clear(self) -> None:
        self._book.clear()
