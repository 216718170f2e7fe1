"""Where offloaded KV is kept: checked chunks (kvlab.store.chunk) under chained keys
(kvlab.store.keys), in tiers behind one protocol and a registry (kvlab.store.tiers: memory,
shm, disk, redis (a server or a Redis Cluster) and mooncake (a Mooncake Store), each with its
settings) composed by :class:`KVStore`. Needs torch only, plus redis-py for the redis tier and
Mooncake's client for the mooncake tier; docs/reliability.md says what it promises."""

from kvlab.store.chunk import Chunk, ForgedChunk, checksum, from_bytes, to_bytes
from kvlab.store.faults import FailedCheck, StoreFault, is_store_fault
from kvlab.store.keys import block_hashes, folder_fingerprint, shard_key, signature, valid_key
from kvlab.store.store import Fetched, KVStore, Stored
from kvlab.store.tiers import (
    RETRY_FIRST_S,
    RETRY_MAX_S,
    STALE_TMP_S,
    BookedTier,
    DiskTier,
    MemoryTier,
    RedisTier,
    SharedMemoryTier,
    StoreStats,
    Tier,
    TierSettings,
    register_tier,
    tier_names,
    unregister_tier,
)

__all__ = [
    "RedisTier", "SharedMemoryTier",
    "shard_key",
    "valid_key", "block_hashes", "signature", "folder_fingerprint", "checksum", "Chunk", "RETRY_FIRST_S",
    "RETRY_MAX_S", "STALE_TMP_S", "StoreStats", "Tier", "MemoryTier", "DiskTier", "KVStore", "Fetched", "Stored",
    "register_tier", "tier_names", "unregister_tier", "TierSettings", "BookedTier", "ForgedChunk", "from_bytes", "to_bytes",
    "FailedCheck", "StoreFault", "is_store_fault",
]
