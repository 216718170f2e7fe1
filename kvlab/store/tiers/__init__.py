"""The store's tiers behind one protocol (:class:`Tier`), one file per backend (the tier,
its settings and how to open it), in a registry (:func:`register_tier`) that
:class:`kvlab.store.KVStore` and the connector's ``tiers`` key read: host memory within a
byte budget (``memory``); a disk folder that outlives the process and may be shared by
several processes at once (``disk``); the same folder in host-shared memory (``shm``, mapped
without copying: every process and engine on a host); a Redis server or cluster (``redis``:
other hosts); a Mooncake Store (``mooncake``: other hosts, the store vLLM's and LMCache's
Mooncake connectors use). Every fault of a tier is absorbed, counted in :class:`StoreStats`
and logged once; a shared tier that failed pauses with one back-off
(kvlab.store.tiers.backoff)."""

from kvlab.store.tiers.backoff import RETRY_FIRST_S, RETRY_MAX_S, Backoff
from kvlab.store.tiers.disk import DiskSettings, DiskTier, open_disk
from kvlab.store.tiers.folders import STALE_TMP_S
from kvlab.store.tiers.lru import BookedTier, LRUBook
from kvlab.store.tiers.memory import MemoryTier, open_memory
from kvlab.store.tiers.mooncake import MooncakeSettings, MooncakeTier, open_mooncake
from kvlab.store.tiers.protocol import Tier
from kvlab.store.tiers.redis import RedisSettings, RedisTier, open_redis
from kvlab.store.tiers.registry import (
    TierKind,
    flat_keys,
    open_tier,
    register_tier,
    shared_tier_names,
    tier_kind,
    tier_names,
    tier_settings,
    unregister_tier,
)
from kvlab.store.tiers.settings import TierSettings
from kvlab.store.tiers.shm import SharedMemorySettings, SharedMemoryTier, open_shm
from kvlab.store.tiers.stats import StoreStats

# The built-in tiers, in lookup order: the process's own memory first, then the shared ones
# from the nearest to the farthest.
for _name, _factory, _settings, _shared in (
        ("memory", open_memory, None, False), ("shm", open_shm, SharedMemorySettings, True),
        ("disk", open_disk, DiskSettings, True), ("redis", open_redis, RedisSettings, True),
        ("mooncake", open_mooncake, MooncakeSettings, True)):
    if _name not in tier_names():  # a reload keeps the registry as it is
        register_tier(_name, _factory, settings=_settings, shared=_shared)
del _name, _factory, _settings, _shared

__all__ = [
    "RETRY_FIRST_S", "RETRY_MAX_S", "STALE_TMP_S", "Backoff", "BookedTier", "DiskSettings", "DiskTier", "LRUBook",
    "MemoryTier", "MooncakeSettings", "MooncakeTier", "RedisSettings", "RedisTier", "SharedMemorySettings",
    "SharedMemoryTier", "StoreStats", "Tier", "TierKind", "TierSettings", "flat_keys", "open_tier", "register_tier",
    "shared_tier_names", "tier_kind", "tier_names", "tier_settings", "unregister_tier",
]
