"""One LRU book of chunks by key: the memory tier's (its chunks) and the scheduler's index
of the workers' memory tiers (kvlab.connector.index: what each worker holds) both keep
theirs in it."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Generic, Iterator, Protocol, TypeVar


class Entry(Protocol):
    """What the book needs of an entry: the keys of its blocks (the last one is the entry's
    own key) and its size."""

    block_keys: list[str] | tuple[str, ...]
    nbytes: int


E = TypeVar("E", bound=Entry)


class LRUBook(Generic[E]):
    """Entries by chunk key, least recently used first, within ``capacity_bytes``, with a
    map from every block to (chunk key, position). A block two entries hold is found in
    the newer one, and stays found when the older leaves."""

    def __init__(self, capacity_bytes: int) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be a positive number of bytes, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, E] = OrderedDict()
        self._blocks: dict[str, tuple[str, int]] = {}  # block key -> (chunk key, position)

    # ---- reading ------------------------------------------------------------------------
    def locate(self, block_key: str) -> tuple[str, int] | None:
        """(chunk key, position) of the entry that holds ``block_key``."""
        return self._blocks.get(block_key)

    def get(self, key: str) -> E | None:
        """The entry, without marking it used."""
        return self._entries.get(key)

    def values(self) -> list[E]:
        """Every entry, least recently used first."""
        return list(self._entries.values())

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    # ---- changing -----------------------------------------------------------------------
    def touch(self, key: str) -> None:
        """Mark the entry used now (the last to be evicted)."""
        if key in self._entries:
            self._entries.move_to_end(key)

    def add(self, key: str, entry: E) -> None:
        """Keep ``entry`` as the most recently used, replacing one of the same key. The
        caller makes room first (:meth:`make_room`): the book does not evict by itself."""
        self.remove(key)
        self._entries[key] = entry
        self.bytes += entry.nbytes
        for position, block in enumerate(entry.block_keys):
            self._blocks[block] = (key, position)

    def remove(self, key: str) -> E | None:
        """Take the entry out (its blocks too, unless a newer entry holds them); None when absent."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry.nbytes
            for block in entry.block_keys:
                if self._blocks.get(block, (None,))[0] == key:
                    del self._blocks[block]
        return entry

    def make_room(self, nbytes: int, evictable: Callable[[E], bool] = lambda entry: True) -> list[str] | None:
        """Evict least recently used ``evictable`` entries until ``nbytes`` more fit; their
        keys, oldest first. None, evicting nothing, when even all of them would not do."""
        candidates = [key for key, entry in self._entries.items() if evictable(entry)]
        freeable = sum(self._entries[key].nbytes for key in candidates)
        if self.bytes + nbytes - freeable > self.capacity_bytes:
            return None
        evicted = []
        for key in candidates:
            if self.bytes + nbytes <= self.capacity_bytes:
                break
            self.remove(key)
            evicted.append(key)
        return evicted

    def clear(self) -> None:
        self._entries.clear()
        self._blocks.clear()
        self.bytes = 0


class Booked:
    """For a class that keeps its entries in an :class:`LRUBook` (``self._book``): its
    budget, the bytes held, how many, whether one is there, and marking one used."""

    _book: LRUBook

    @property
    def capacity_bytes(self) -> int:
        return self._book.capacity_bytes

    @property
    def bytes(self) -> int:
        return self._book.bytes

    def touch(self, chunk_key: str) -> None:
        """Mark the entry used now (the last to be evicted)."""
        self._book.touch(chunk_key)

    def __len__(self) -> int:
        return len(self._book)

    def __contains__(self, chunk_key: object) -> bool:
        return chunk_key in self._book


class BookedTier(Booked):
    """For a tier that keeps its chunks (or what stands for them: an entry with their
    ``block_keys`` and ``nbytes``) in an :class:`LRUBook`: the Tier protocol's lookups,
    identity and discard, answered from the book. A tier adds ``get``, ``put`` and ``check``."""

    def locate(self, block_key: str) -> tuple[str, int] | None:
        return self._book.locate(block_key)

    def locate_many(self, block_keys: list[str]) -> list[tuple[str, int] | None]:
        return [self._book.locate(key) for key in block_keys]

    def describe_many(self, chunk_keys: list[str]) -> list:
        """Each chunk as :meth:`get` gives it (it has its block keys and signature): a tier
        whose chunks are not in memory answers from their headers instead."""
        return [self.get(key) for key in chunk_keys]

    def identity(self, chunk_key: str) -> int | None:
        """The entry object's id: an entry put again under the key is another one."""
        entry = self._book.get(chunk_key)
        return None if entry is None else id(entry)

    def discard(self, chunk_key: str) -> None:
        self._book.remove(chunk_key)
