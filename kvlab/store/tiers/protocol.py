"""The protocol every tier of the store follows (kvlab.store.tiers.registry names them)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from kvlab.store.chunk import Chunk, Header


@runtime_checkable
class Tier(Protocol):
    """One place chunks live. ``locate`` answers from an index; ``describe_many`` reads
    what chunks say of themselves (their block keys and signature: a checked header, or
    the chunk) without their payload; ``get`` reads and checks.
    ``shared`` tiers are seen by every process that opens them (so a scheduler can look
    up what a worker wrote); the memory tier is its process's own. ``isinstance(x, Tier)``
    checks that ``x`` has every method (not their signatures). A tier may name its client's
    exceptions in ``errors``: faults of the store, never of kvlab (kvlab.store.faults)."""

    name: str
    shared: bool

    def locate(self, block_key: str) -> tuple[str, int] | None: ...
    def locate_many(self, block_keys: list[str]) -> list[tuple[str, int] | None]: ...  # one round trip
    def describe_many(self, chunk_keys: list[str]) -> list[Header | Chunk | None]: ...  # one round trip, no payload
    def get(self, chunk_key: str) -> Chunk | None: ...
    def put(self, chunk: Chunk) -> bool: ...
    def discard(self, chunk_key: str) -> None: ...
    def touch(self, chunk_key: str) -> None: ...  # used now: eviction follows use
    def identity(self, chunk_key: str) -> object | None: ...  # changes when the stored chunk does; None: gone
    def check(self) -> None: ...  # raises when the tier cannot be reached (start-up)
