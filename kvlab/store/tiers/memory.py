"""The memory tier: chunks in this process's memory, least recently used evicted first."""

from __future__ import annotations

from kvlab.store.chunk import Chunk
from kvlab.store.tiers.lru import BookedTier, LRUBook
from kvlab.store.tiers.stats import StoreStats


class MemoryTier(BookedTier):
    """Chunks in host memory, least recently used evicted first within ``capacity_bytes``.
    Its process's own (not ``shared``); a :class:`~kvlab.store.tiers.Tier` like the others.
    Not locked: :class:`kvlab.store.KVStore` holds its lock around every call."""

    name, shared = "memory", False

    def __init__(self, capacity_bytes: int, stats: StoreStats) -> None:
        self.stats = stats
        self._book: LRUBook[Chunk] = LRUBook(capacity_bytes)

    # ---- reads ---------------------------------------------------------------------
    def get(self, chunk_key: str) -> Chunk | None:
        """The chunk, marked used (unchecked: KVStore checks it when ``verify="always"``)."""
        self._book.touch(chunk_key)
        return self._book.get(chunk_key)

    def check(self) -> None:
        """Nothing: memory is always there."""

    # ---- updates -------------------------------------------------------------------
    def put(self, chunk: Chunk) -> bool:
        """Keep ``chunk`` (replacing one with its key), evicting to make room; False when
        it cannot fit at all."""
        self._book.remove(chunk.key)
        if chunk.nbytes > self._book.capacity_bytes:
            self.stats.dropped += 1
            return False
        self.stats.evicted += len(self._book.make_room(chunk.nbytes) or ())
        self._book.add(chunk.key, chunk)
        return True

    def clear(self) -> None:
        self._book.clear()

    def chunks(self) -> list[Chunk]:
        """Every chunk, least recently used first."""
        return self._book.values()


def open_memory(settings: None, store) -> MemoryTier:  # noqa: ANN001 - a KVStore (kvlab.store.tiers.registry)
    """Every store has its memory tier, within the store's ``capacity_bytes``."""
    return MemoryTier(store.capacity_bytes, store.stats)
