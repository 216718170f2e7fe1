"""The memory tier: chunks in this process's memory, least recently used evicted first."""

from __future__ import annotations

from kvlab.store.chunk import Chunk
from kvlab.store.tiers.lru import Booked, LRUBook
from kvlab.store.tiers.stats import StoreStats


class MemoryTier(Booked):
    """Chunks in host memory, least recently used evicted first within ``capacity_bytes``.
    Its process's own (not ``shared``); a :class:`~kvlab.store.tiers.Tier` like the others.
    Not locked: :class:`kvlab.store.KVStore` holds its lock around every call."""

    name, shared = "memory", False

    def __init__(self, capacity_bytes: int, stats: StoreStats) -> None:
        self.stats = stats
        self._book: LRUBook[Chunk] = LRUBook(capacity_bytes)

    # ---- lookups -------------------------------------------------------------------
    def locate(self, block_key: str) -> tuple[str, int] | None:
        return self._book.locate(block_key)

    def locate_many(self, block_keys: list[str]) -> list[tuple[str, int] | None]:
        return [self._book.locate(key) for key in block_keys]

    def get(self, chunk_key: str) -> Chunk | None:
        """The chunk, marked used (unchecked: KVStore checks it when ``verify="always"``)."""
        self._book.touch(chunk_key)
        return self._book.get(chunk_key)

    def identity(self, chunk_key: str) -> int | None:
        """The chunk object's id: a chunk put again under the key is another one."""
        chunk = self._book.get(chunk_key)
        return None if chunk is None else id(chunk)

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

    def discard(self, chunk_key: str) -> None:
        self._book.remove(chunk_key)

    def clear(self) -> None:
        self._book.clear()

    def chunks(self) -> list[Chunk]:
        """Every chunk, least recently used first."""
        return self._book.values()


def open_memory(settings) -> MemoryTier:  # noqa: ANN001 - a KVStore (kvlab.store.tiers.registry)
    """Every store has its memory tier, within ``capacity_bytes``."""
    return MemoryTier(settings.capacity_bytes, settings.stats)
