"""What a store did: every fault a tier absorbed is counted in :class:`StoreStats`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StoreStats:
    """What a store did; every fault it absorbed is counted here."""

    stored: int = 0
    dropped: int = 0  # larger than the memory tier
    evicted: int = 0
    corrupt: int = 0  # checksum, payload, header or MAC failed: a miss
    forged: int = 0  # of those, chunks without a valid MAC for the store's auth_key
    mismatched: int = 0  # another model, dtype or layout: a miss
    disk_reads: int = 0  # chunks read from each shared tier (checked or not)
    shm_reads: int = 0
    redis_reads: int = 0
    mooncake_reads: int = 0
    read_into_cache: int = 0  # of those, chunks a file tier read straight into the cache (no buffer between)
    bad_headers: int = 0  # files skipped because their header failed the schema
    read_errors: int = 0  # a file that could not be read (I/O error): a miss
    write_errors: int = 0  # a chunk a shared tier could not write (full, read-only, server down, ...)
    delete_errors: int = 0  # a file the store could not remove (read-only folder)
    disk_skipped: int = 0  # chunks the disk or shm tier did not write: larger than its budget, or paused
    stale_tmp_removed: int = 0  # partial files of writers that died
    redis_skipped: int = 0  # chunks the Redis tier did not write: paused after a failure
    mooncake_skipped: int = 0  # chunks the Mooncake tier did not write: paused after a failure
    mooncake_full: int = 0  # chunks the Mooncake store had no room for yet (its master evicts)

    def read_from(self, tier: str) -> None:
        """Count a chunk read from the shared tier named ``tier``."""
        self._add(f"{tier}_reads")

    def _add(self, name: str) -> None:
        if not hasattr(self, name):  # a registered tier without counters of its own
            return
        setattr(self, name, getattr(self, name) + 1)
