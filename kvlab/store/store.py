"""Where KVLabConnector keeps offloaded KV: :class:`KVStore` composes the tiers (its memory,
then those it is given of host-shared memory, disk, Redis, Mooncake and any other tier
kvlab.store.tiers registers) and is the connector's one way in. A chunk that fails its checksum, whose file header does not parse,
or that was written for another model or layout is a miss (and is dropped), never loaded. A
full store evicts least recently *used* chunks; a tier that fails (a full or read-only disk)
is logged once, counted and paused; no error of a tier ever reaches a request.
docs/reliability.md says what the store promises."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from kvlab.store.chunk import Chunk, Header, Placement
from kvlab.store.faults import FAULTS
from kvlab.store.keys import holds, shard_key, valid_key
from kvlab.store.tiers import (
    DiskTier,
    MemoryTier,
    StoreStats,
    Tier,
    open_tier,
    shared_tier_names,
    tier_names,
    tier_settings,
)

# (rank, workers): the shard of each block a worker writes to and reads from the shared tiers.
WHOLE = (0, 1)


@dataclass(frozen=True)
class Fetched:
    """What :meth:`KVStore.fetch` found: the checked chunk (None on a miss or a delivery into
    the cache), the tier that gave it, every tier tried that could not, and whether the
    memory tier's copy failed its check and was dropped."""

    chunk: Chunk | None
    tier: str | None = None
    missed: tuple[str, ...] = ()
    dropped: bool = False
    delivered: Header | None = None  # the checked header of a chunk read straight into the cache: no chunk


@dataclass(frozen=True)
class Stored:
    """What :meth:`KVStore.put` kept: in memory or not, and the shared tiers that took it.
    True when any tier did."""

    memory: bool
    shared: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return self.memory or bool(self.shared)


@dataclass
class KVStore:
    """Chunks by key in host memory (LRU within ``capacity_bytes``), written through to the
    shared tiers ``tiers`` names, each with its settings (kvlab.store.tiers.registry: a
    mapping of its keys, or its settings class's instance), looked up in the registry's
    order: e.g. ``KVStore(tiers={"shm": {}, "disk": {"path": "/var/cache/kvlab"}})`` adds a
    host-shared memory folder (``/dev/shm/kvlab-default``) and a disk folder (LRU by last use
    within its ``bytes``); ``redis`` (a server or a Redis Cluster) and ``mooncake`` (a
    Mooncake Store) take a ``url``. No other tier opens.

    ``verify`` is "disk" (check the CRC of every chunk read from a shared tier; trust
    chunks this process sealed in memory) or "always" (also at every memory hit, ~4 ms per
    46 MB). ``promote`` keeps chunks read from a shared tier in memory (off where another
    process decides what the memory tier holds). ``auth_key`` (at least 16 bytes, e.g.
    ``os.urandom(32)``, the same in every process of the store) signs every chunk written to
    a shared tier with an HMAC-SHA256 and refuses one read without a valid MAC (``forged``):
    a CRC stops damage, not a writer who recomputes it; a writer without the key, the same
    user included, cannot forge a chunk.

    Thread-safe: one lock guards the memory tier. The shared tiers' reads and writes run
    outside it (each is safe for several processes at once, and guards what it keeps in
    memory with a lock of its own), so a memory hit never waits for a disk or Redis write.
    """

    capacity_bytes: int = 2 << 30
    tiers: Mapping[str, Any] = field(default_factory=dict)
    verify: str = "disk"
    stats: StoreStats = field(default_factory=StoreStats)
    promote: bool = True
    auth_key: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.capacity_bytes, bool) or not isinstance(self.capacity_bytes, int) or self.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be a positive number of bytes, got {self.capacity_bytes!r}")
        if self.verify not in ("always", "disk"):
            raise ValueError(f"verify must be 'always' or 'disk', got {self.verify!r}")
        if self.auth_key is not None and (not isinstance(self.auth_key, bytes) or len(self.auth_key) < 16):
            raise ValueError("auth_key must be at least 16 bytes (e.g. os.urandom(32)), or None")
        if not isinstance(self.tiers, Mapping) or not all(isinstance(name, str) for name in self.tiers):
            raise ValueError(f"tiers must map tier names to their settings, got {self.tiers!r}")
        unknown = [name for name in self.tiers if name not in tier_names()]
        if unknown or "memory" in self.tiers:
            raise ValueError(f"tiers names the shared tiers to open, of {list(shared_tier_names())} (every store has "
                             f"its memory, within capacity_bytes); got {list(self.tiers)}")
        self.tiers = {name: tier_settings(name, self.tiers[name]) for name in tier_names() if name in self.tiers}
        self._lock = threading.RLock()
        self._memory: MemoryTier = open_tier("memory", None, self)
        self._shared: tuple[Tier, ...] = tuple(open_tier(name, settings, self) for name, settings in self.tiers.items())
        own = [tier.name for tier in (self._memory, *self._shared) if not tier.shared]
        if own != ["memory"]:
            raise ValueError(f"a store needs exactly one tier of its process's own, 'memory'; its tiers opened {own}")
        self._shared_names = tuple(tier.name for tier in self._shared)

    # ---- what it is made of (read-only) ------------------------------------------------
    @property
    def shared(self) -> tuple[Tier, ...]:
        """The shared tiers, in lookup order."""
        return self._shared

    @property
    def shared_names(self) -> tuple[str, ...]:
        """Their names, in lookup order (a scheduler asks this for every block it looks up)."""
        return self._shared_names

    @property
    def faults(self) -> tuple[type[BaseException], ...]:
        """The errors that are this store's faults, not kvlab's (kvlab.store.faults): OSError,
        StoreFault, and the errors each of its tiers names as its own."""
        return (*FAULTS, *(kind for tier in (self._memory, *self._shared) for kind in getattr(tier, "errors", ())))

    @property
    def disk(self) -> DiskTier | None:
        """The disk tier, if there is one."""
        return next((tier for tier in self._shared if tier.name == "disk"), None)

    def tier(self, name: str) -> Tier:
        """A tier by name ("memory", "shm", "disk", "redis", "mooncake")."""
        for tier in (self._memory, *self._shared):
            if tier.name == name:
                return tier
        raise ValueError(f"this store has no {name!r} tier; it has {[t.name for t in (self._memory, *self._shared)]}")

    @property
    def bytes(self) -> int:
        """Bytes held in memory."""
        return self._memory.bytes

    # ---- reads -------------------------------------------------------------------------
    def fetch(self, chunk_key: str, expect: str | None = None, *, tier: str = "memory",
              blocks: Mapping[int, str] | None = None, shard: tuple[int, int] = WHOLE,
              into: Placement | None = None) -> Fetched:
        """The chunk from ``tier``, else from the next shared tier that holds it (a file
        another process evicted, a damaged copy), checked: intact (a shared tier's always,
        memory's with ``verify="always"``: a damaged one is dropped), of signature ``expect``
        when given, and holding at each position the block ``blocks`` names there (in a
        shared tier: the ``shard`` (rank, workers) of it). A chunk read from a shared tier is
        marked used, and kept in memory with ``promote`` if it fits. With ``into``, a tier
        that can (a file's, into a host cache: ``can_read_into``) reads the blocks straight
        into the cache instead, checked as they arrive: then ``delivered`` and no chunk; a
        tier whose read fails its check leaves those blocks to the next tier or to vLLM."""
        names = [t.name for t in (self._memory, *self._shared)]
        if tier not in names:
            raise ValueError(f"this store has no {tier!r} tier; it has {names}")
        first = self._memory if tier == "memory" else self.tier(tier)
        order = [first, *(t for t in self._shared if t is not first)]
        missed, dropped = [], False
        for source in order:
            if source is self._memory:
                chunk, dropped = self._from_memory(chunk_key)
                wanted = blocks
            else:
                wanted = blocks if shard == WHOLE else {p: shard_key(k, *shard) for p, k in (blocks or {}).items()}
                if into is not None and valid_key(chunk_key) and _reads_into(source, into):
                    header = source.read_into(chunk_key, into, lambda header: self._fits(header, expect, wanted))
                    if header is not None:
                        source.touch(chunk_key)
                        self.stats.read_into_cache += 1
                        return Fetched(None, source.name, tuple(missed), dropped, delivered=header)
                    missed.append(source.name)
                    continue
                chunk = source.get(chunk_key) if valid_key(chunk_key) else None
            if chunk is not None and self._fits(chunk, expect, wanted):
                if source is not self._memory:
                    source.touch(chunk_key)  # eviction follows use, not write time
                    self._promote(chunk, shard)
                return Fetched(chunk, source.name, tuple(missed), dropped)
            missed.append(source.name)
        return Fetched(None, None, tuple(missed), dropped)

    def _fits(self, found: Chunk | Header, expect: str | None, wanted: Mapping[int, str] | None) -> bool:
        """Whether a chunk (or a chunk's checked header) is of signature ``expect`` (a
        mismatch is counted) and holds at each position the block ``wanted`` names there."""
        if expect is not None and found.signature != expect:
            self.stats.mismatched += 1
            return False
        return all(holds(found.block_keys, p, k) for p, k in (wanted or {}).items())

    # ---- what a scheduler asks of the shared tiers, without loading ---------------------
    def check_shared(self) -> None:
        """Raise when a shared tier cannot be reached (a connector's start-up)."""
        for tier in self._shared:
            tier.check()

    def locate_shared(self, block_keys: list[str]) -> dict[str, list[tuple[str, int] | None]]:
        """Where each shared tier holds each block, as (chunk key, position): one call per
        tier (one round trip to a remote one) for all of them."""
        return {tier.name: tier.locate_many(block_keys) for tier in self._shared}

    def identity(self, tier: str, chunk_key: str) -> object | None:
        """What changes when the chunk ``tier`` stores under ``chunk_key`` does; None: gone."""
        return self.tier(tier).identity(chunk_key)

    def describe(self, tier: str, chunk_keys: list[str]) -> list[Header | Chunk | None]:
        """What each chunk ``tier`` holds says of itself, its block keys and signature (a
        checked header), without its payload, in one call: what a scheduler reads before it
        promises a worker the chunk. The worker checks the payload when it loads it."""
        valid = [key for key in chunk_keys if valid_key(key)]
        found = dict(zip(valid, self.tier(tier).describe_many(valid))) if valid else {}
        return [found.get(key) for key in chunk_keys]

    def get(self, chunk_key: str, expect: str | None = None, *, tier: str = "memory",
            blocks: Mapping[int, str] | None = None, shard: tuple[int, int] = WHOLE) -> Chunk | None:
        """:meth:`fetch`'s chunk: checked, None on a miss."""
        return self.fetch(chunk_key, expect, tier=tier, blocks=blocks, shard=shard).chunk

    def _from_memory(self, chunk_key: str) -> tuple[Chunk | None, bool]:
        """The memory tier's chunk, checked with ``verify="always"``; (None, True) when it
        was damaged and dropped."""
        with self._lock:
            chunk = self._memory.get(chunk_key)
            if chunk is not None and self.verify == "always" and not chunk.intact():
                self.stats.corrupt += 1
                self._memory.discard(chunk_key)
                return None, True
            return chunk, False

    def _promote(self, chunk: Chunk, shard: tuple[int, int]) -> None:
        if self.promote and shard == WHOLE and chunk.nbytes <= self._memory.capacity_bytes:
            with self._lock:
                self._memory.put(chunk)

    # ---- updates -----------------------------------------------------------------------
    def put(self, chunk: Chunk) -> bool:
        """Keep a sealed chunk in memory and write it through to every shared tier
        (:meth:`save`); False when no tier took it."""
        return bool(self.save(chunk))

    def save(self, chunk: Chunk, *, memory: bool = True, shared: bool = True, shard: tuple[int, int] = WHOLE) -> Stored:
        """Keep a sealed chunk in memory (``memory``: evicting least recently used chunks)
        and write it through to every shared tier (``shared``: its ``shard`` (rank, workers),
        under the shard's keys); what took it. Never raises for a tier's fault: a full or
        failing store never fails a request."""
        rank, workers = shard
        if not (isinstance(rank, int) and isinstance(workers, int) and 0 <= rank < workers):
            raise ValueError(f"shard must be (rank, workers) with 0 <= rank < workers, got {shard!r}")
        with self._lock:
            kept = memory and self._memory.put(chunk)
        written: tuple[str, ...] = ()
        if shared and self._shared:
            copy = chunk if shard == WHOLE else Chunk([shard_key(k, rank, workers) for k in chunk.block_keys],
                                                      chunk.buffer, chunk.signature, chunk.crc)
            written = tuple([tier.name for tier in self._shared if tier.put(copy)])
        stored = Stored(kept, written)
        self.stats.stored += bool(stored)
        return stored

    def discard(self, chunk_key: str, disk: bool = True) -> None:
        """Forget a chunk (and its copies in the shared tiers, unless ``disk`` is False)."""
        with self._lock:
            self._memory.discard(chunk_key)
        if disk and valid_key(chunk_key):
            for tier in self._shared:
                tier.discard(chunk_key)

    def evict(self, chunk_keys: Iterable[str]) -> int:
        """Let these chunks leave memory (what the scheduler evicted; the shared tiers keep
        theirs), counted in ``evicted``; how many were held."""
        with self._lock:
            held = [key for key in chunk_keys if key in self._memory]
            for key in held:
                self._memory.discard(key)
            self.stats.evicted += len(held)
        return len(held)

    def clear(self) -> None:
        """Empty the memory tier (the shared tiers stay): the next loads come from them."""
        with self._lock:
            self._memory.clear()

    def memory_chunks(self) -> list[Chunk]:
        """The chunks held in memory (least recently used first)."""
        with self._lock:
            return self._memory.chunks()

    def __len__(self) -> int:
        return len(self._memory)

    def __contains__(self, chunk_key: str) -> bool:
        return chunk_key in self._memory


def _reads_into(tier: Tier, into: Placement) -> bool:
    """Whether ``tier`` reads a chunk straight into the cache ``into`` names (an optional
    part of the tier protocol: ``can_read_into``, and ``read_into`` returning the chunk's
    checked header, or None for a miss, as the disk tier has)."""
    can = getattr(tier, "can_read_into", None)
    return can is not None and can(into.cache)
