"""Where KVLabConnector keeps offloaded KV: :class:`KVStore` composes the tiers (memory,
then host-shared memory, disk and Redis). A chunk that fails its checksum, whose file header does not parse, or that was
written for another model or layout is a miss (and is dropped), never loaded. A full
store evicts least recently *used* chunks, a prompt's tail before its head; a tier that
fails (a full or read-only disk) is logged once, counted and paused; no error of a tier
ever reaches a request. docs/reliability.md says what the store promises."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from kvlab.store.chunk import Chunk
from kvlab.store.keys import holds, valid_key
from kvlab.store.tiers import DiskTier, MemoryTier, RedisTier, SharedMemoryTier, StoreStats, Tier


@dataclass
class KVStore:
    """Chunks by key in host memory (LRU within ``capacity_bytes``), written through to
    the shared tiers given: a host-shared memory folder (``shm_path``), a disk folder
    (``disk_path``, LRU by last use within ``disk_capacity_bytes``) and a Redis server
    (``redis_url``), looked up in that order.

    ``verify`` is "disk" (check the CRC of every chunk read from a shared tier; trust
    chunks this process sealed in memory) or "always" (also at every memory hit, ~4 ms per
    46 MB). ``promote`` keeps chunks read from a shared tier in memory (off where another
    process decides what the memory tier holds). ``auth_key`` (at least 16 bytes, e.g.
    ``os.urandom(32)``, the same in every process of the store) signs every chunk written to
    a shared tier with an HMAC-SHA256 and refuses one read without a valid MAC (``forged``):
    a CRC stops damage, not a writer who recomputes it; a writer without the key, the same
    user included, cannot forge a chunk.
    """

    capacity_bytes: int = 2 << 30
    disk_path: str | Path | None = None
    disk_capacity_bytes: int = 16 << 30
    verify: str = "disk"
    stats: StoreStats = field(default_factory=StoreStats)
    shm_path: str | Path | None = None
    shm_capacity_bytes: int = 4 << 30
    redis_url: str | None = None
    promote: bool = True
    auth_key: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("capacity_bytes", "disk_capacity_bytes", "shm_capacity_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive number of bytes, got {value!r}")
        if self.verify not in ("always", "disk"):
            raise ValueError(f"verify must be 'always' or 'disk', got {self.verify!r}")
        if self.auth_key is not None and (not isinstance(self.auth_key, bytes) or len(self.auth_key) < 16):
            raise ValueError("auth_key must be at least 16 bytes (e.g. os.urandom(32)), or None")
        self._lock = threading.RLock()
        self.memory = MemoryTier(self.capacity_bytes, self.stats)
        self.shared: list[Tier] = []
        if self.shm_path is not None:
            self.shm_path = Path(self.shm_path)
            self.shared.append(SharedMemoryTier(self.shm_path, self.shm_capacity_bytes, self.stats, self.auth_key))
        if self.disk_path is not None:
            self.disk_path = Path(self.disk_path)
            self.shared.append(DiskTier(self.disk_path, self.disk_capacity_bytes, self.stats, self.auth_key))
        if self.redis_url is not None:
            self.shared.append(RedisTier(self.redis_url, self.stats, auth_key=self.auth_key))

    @property
    def disk(self) -> DiskTier | None:
        """The disk tier, if there is one."""
        return next((tier for tier in self.shared if tier.name == "disk"), None)

    def tier(self, name: str) -> Tier:
        """A tier by name ("memory", "shm", "disk", "redis")."""
        for tier in [self.memory, *self.shared]:
            if tier.name == name:
                return tier
        raise ValueError(f"this store has no {name!r} tier; it has {[t.name for t in [self.memory, *self.shared]]}")

    @property
    def bytes(self) -> int:
        """Bytes held in memory."""
        return self.memory.bytes

    # ---- lookups -------------------------------------------------------------------
    def locate(self, block_key: str) -> tuple[str, int] | None:
        """(chunk key, position in the chunk) of a stored block, in the first tier that has it."""
        with self._lock:
            for tier in [self.memory, *self.shared]:
                found = tier.locate(block_key)
                if found is not None:
                    return found
            return None

    def get(self, chunk_key: str, expect: str | None = None) -> Chunk | None:
        """The chunk, checked (checksum and, when given, signature); None on a miss.
        A chunk found only in a shared tier is read, checked and (``promote``) kept in
        memory if it fits."""
        with self._lock:
            chunk = self.memory.get(chunk_key)
            if chunk is not None:
                if self.verify == "always" and not chunk.intact():
                    self.stats.corrupt += 1
                    self.discard(chunk_key)
                    return None
            elif valid_key(chunk_key):
                for tier in self.shared:  # a chunk's header names it: a swapped file is a miss
                    chunk = tier.get(chunk_key)
                    if chunk is not None:
                        break
                if chunk is None:
                    return None
                if self.promote and chunk.nbytes <= self.memory.capacity_bytes:
                    self.memory.put(chunk)
            else:
                return None
            if expect is not None and chunk.signature != expect:
                self.stats.mismatched += 1
                return None
            return chunk

    def matched_blocks(self, block_keys: Sequence[str], expect: str | None = None) -> list[tuple[Chunk, int]]:
        """The leading run of ``block_keys`` the store can deliver, as (chunk, position)
        per block; every chunk it touches is checked once. Holding the chunks keeps
        their bytes alive until they are loaded, even if the store evicts them. The
        chunks are marked used from the last to the first, so a prompt's head outlives
        its tail, as vLLM's own prefix cache frees blocks."""
        out: list[tuple[Chunk, int]] = []
        checked: dict[str, Chunk | None] = {}
        with self._lock:
            for key in block_keys:
                found = self.locate(key)
                if found is None:
                    break
                chunk_key, position = found
                if chunk_key not in checked:
                    checked[chunk_key] = self.get(chunk_key, expect)
                chunk = checked[chunk_key]
                if chunk is None or not holds(chunk.block_keys, position, key):
                    break
                out.append((chunk, position))
            self._mark_used([c for c in dict.fromkeys(c.key for c, _ in out)][::-1])
        return out

    # ---- updates -------------------------------------------------------------------
    def put(self, chunk: Chunk) -> bool:
        """Keep a sealed chunk in memory (evicting least recently used chunks) and write
        it through to disk. Returns False when no tier took it; never raises for a tier's
        fault: a full or failing store never fails a request."""
        with self._lock:
            kept = self.memory.put(chunk)
            written = [tier.put(chunk) for tier in self.shared]
            self.stats.stored += kept or any(written)
            return kept or any(written)

    def discard(self, chunk_key: str, disk: bool = True) -> None:
        """Forget a chunk (and its copies in the shared tiers, unless ``disk`` is False)."""
        with self._lock:
            self.memory.discard(chunk_key)
            if disk and valid_key(chunk_key):
                for tier in self.shared:
                    tier.discard(chunk_key)

    def clear(self) -> None:
        """Empty the memory tier (the disk tier stays): the next loads come from disk."""
        with self._lock:
            for chunk in self.memory.chunks():
                self.memory.discard(chunk.key)

    def memory_chunks(self) -> list[Chunk]:
        """The chunks held in memory (least recently used first)."""
        with self._lock:
            return self.memory.chunks()

    def __len__(self) -> int:
        return len(self.memory)

    def __contains__(self, chunk_key: str) -> bool:
        return chunk_key in self.memory

    def _mark_used(self, chunk_keys: Sequence[str]) -> None:
        for key in chunk_keys:
            self.memory.get(key)
            for tier in self.shared:
                tier.touch(key)
