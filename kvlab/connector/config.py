"""KVLabConnector's ``kv_connector_extra_config``: every key, its default, and a clear error
at start-up for anything else."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kvlab.store.safe_paths import system_folder
from kvlab.store.secrets import check_redis_url, read_auth_key
from kvlab.store.tiers import shared_tier_names, tier_names
from kvlab.store.tiers.mooncake import parse_mooncake_url
from kvlab.transfer.registry import METHODS

CROSS_LAYER_LAYOUT = "BLHNC"
STORE_NAME = re.compile(r"(?!\.\.?$)[A-Za-z0-9._-]+")
# Where chunks can live, in the order a lookup tries them: the worker's own memory, files
# in a host-shared memory folder, files on disk, a Redis server (kvlab.store.tiers' registry,
# read again at every parse: a tier registered later is accepted too).
TIERS = tier_names()
# The key bounding each tier's bytes (the Redis server bounds its own).
BUDGETS = {"memory": "store_bytes", "shm": "shm_bytes", "disk": "disk_bytes"}
# The tiers a server serves to whoever reaches it: auth_key is their only check of who wrote a chunk.
REMOTE_TIERS = ("redis", "mooncake")


def _room(tier: str, config: ConnectorConfig) -> tuple[int, str] | None:
    """The most bytes ``tier`` could ever hold here, and what bounds it: the machine's memory,
    or the size of the filesystem of its folder (or of the nearest folder above it that
    exists); None where that cannot be told."""
    try:
        if tier == "memory":
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's memory"
        folder = Path(config.disk_path if tier == "disk" else config.shm_folder)
        while not folder.exists():
            folder = folder.parent
        stats = os.statvfs(folder)
    except (ValueError, OSError, AttributeError):  # no such sysconf name, no statvfs (Windows)
        return None
    return stats.f_frsize * stats.f_blocks, f"the filesystem of {folder}"


@dataclass(frozen=True)
class ConnectorConfig:
    """``kv_connector_extra_config`` keys; anything else fails at start-up."""

    enable_cross_layers_blocks: bool = False  # ask vLLM for a block-major cache (as the seed change did)
    layerwise: bool = False  # load each layer just before its attention, save it right after
    # layerwise through kvlab.hooks, called from kvlab's CPU attention backend as vllm-ascend's
    # attention calls them (non-dict metadata, (k, v) tuples); vLLM's own per-layer calls are ignored
    hooks: bool = False
    tiers: tuple[str, ...] | None = None  # lookup order, from TIERS; default from `store`
    store: str = "cpu"  # shorthand for tiers: "cpu" = memory; "disk" = memory, then disk
    disk_path: str | None = None
    shm_path: str | None = None  # default /dev/shm/kvlab-<store_name>
    # e.g. redis://127.0.0.1:6379/0; a password by name, kept out of vLLM's logs of its arguments:
    # redis://127.0.0.1:6379/0?password_file=/path/file (its first line) or ?password_env=VARIABLE
    # (kvlab.store.secrets); redis://:password@127.0.0.1:6379/0 works too, but vLLM logs it;
    # redis-cluster://127.0.0.1:7000?password_file=... : a Redis Cluster, by any one of its nodes
    redis_url: str | None = None
    # mooncake://host:port?metadata_port=P: a Mooncake Store's master and its HTTP metadata server
    # (kvlab.runtime.mooncake starts one); each worker lends it mooncake_segment_bytes of memory (0:
    # the store's own segment processes hold everything)
    mooncake_url: str | None = None
    mooncake_segment_bytes: int = 0
    store_bytes: int = 2 << 30  # each worker's memory budget; least recently used chunks go first
    disk_bytes: int = 16 << 30
    shm_bytes: int = 4 << 30
    chunk_size: int | None = None  # tokens per stored chunk; default 256 rounded to blocks
    method: str = "auto"  # a kvlab.transfer copy method; "auto": the most preferred that runs here (CopyMethod.preference)
    verify: str = "disk"  # "disk": CRC of every chunk read from a shared tier; "always": also in memory
    async_saves: bool = True  # saves run beside the forward; a request's blocks are held until saved
    # "file:/path" or "env:VARIABLE" naming a secret of 16+ bytes: every chunk of a shared tier then
    # carries an HMAC-SHA256 under it, and one without a valid MAC is never loaded (docs/reliability.md)
    auth_key: str | None = None
    store_name: str = "default"  # names the shared-memory folder and this process's counters

    @classmethod
    def parse(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        if extra is not None and not isinstance(extra, Mapping):
            raise ValueError(f"KVLabConnector: kv_connector_extra_config must be a mapping of keys to values, "
                             f"got {type(extra).__name__}")
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known), key=str)
        if unknown:
            raise ValueError(f"KVLabConnector: unknown kv_connector_extra_config key(s) {unknown}; "
                             f"known keys are {sorted(known)}")
        for name in ("enable_cross_layers_blocks", "layerwise", "hooks", "async_saves"):
            if name in extra and not isinstance(extra[name], bool):
                raise ValueError(f"KVLabConnector: {name} must be true or false, got {extra[name]!r}")
        for name in ("store_bytes", "disk_bytes", "shm_bytes", "chunk_size"):
            if name not in extra or (name == "chunk_size" and extra[name] is None):  # None: the default chunk
                continue
            value = extra[name]
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVLabConnector: {name} must be a positive integer, got {value!r}")
        if "mooncake_segment_bytes" in extra:
            value = extra["mooncake_segment_bytes"]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"KVLabConnector: mooncake_segment_bytes must be a non-negative integer, got {value!r}")
        for name in ("disk_path", "shm_path", "redis_url", "mooncake_url", "store_name", "store", "method", "verify", "auth_key"):
            if name in extra and (not isinstance(extra[name], str) or not extra[name]):
                raise ValueError(f"KVLabConnector: {name} must be a non-empty string, got {extra[name]!r}")
        for name in ("disk_path", "shm_path"):  # every vLLM process must mean the same folder
            if name in extra and (not os.path.isabs(extra[name]) or "\0" in extra[name]):
                raise ValueError(f"KVLabConnector: {name} must be an absolute path, got {extra[name]!r}")
        for name, example in (("disk_path", "/var/cache/kvlab"), ("shm_path", "/dev/shm/kvlab-<name>")):
            if extra.get(name) and system_folder(os.path.realpath(extra[name])):
                raise ValueError(f"KVLabConnector: {name} must be a folder of kvlab's own (it evicts chunk files "
                                 f"there), not the system's {extra[name]!r}: e.g. {example}")
        if "store_name" in extra and not STORE_NAME.fullmatch(extra["store_name"]):
            raise ValueError(f"KVLabConnector: store_name names a folder (/dev/shm/kvlab-<store_name>): letters, "
                             f"digits, '.', '_' and '-' only, got {extra['store_name']!r}")
        if "tiers" in extra:
            if "store" in extra:
                raise ValueError("KVLabConnector: give either store (a shorthand) or tiers, not both")
            tiers = extra["tiers"]
            if not isinstance(tiers, (list, tuple)) or not tiers or not all(isinstance(t, str) for t in tiers):
                raise ValueError(f"KVLabConnector: tiers must be a list of tier names from {list(tier_names())}, "
                                 f"got {tiers!r}")
            extra["tiers"] = tuple(tiers)
        config = cls(**extra)
        if config.hooks and not config.layerwise:
            raise ValueError("KVLabConnector: hooks: true drives a layerwise connector from the attention hooks, "
                             "but layerwise is false; set \"layerwise\": true too")
        if config.store not in ("cpu", "disk"):
            raise ValueError(f"KVLabConnector: store must be 'cpu' or 'disk', got {config.store!r}")
        tiers = config.tier_names
        known = tier_names()
        bad = [t for t in tiers if t not in known]
        if bad or len(set(tiers)) != len(tiers):
            raise ValueError(f"KVLabConnector: tiers must name each of {list(known)} at most once, got {list(tiers)}")
        if "disk" in tiers and not config.disk_path:
            raise ValueError("KVLabConnector: the disk tier (store 'disk') needs disk_path (a folder)")
        if config.disk_path and "disk" not in tiers:
            raise ValueError("KVLabConnector: disk_path is only used with the disk tier (store 'disk')")
        if "redis" in tiers and not config.redis_url:
            raise ValueError("KVLabConnector: the redis tier needs redis_url (e.g. redis://127.0.0.1:6379/0)")
        if "mooncake" in tiers and not config.mooncake_url:
            raise ValueError("KVLabConnector: the mooncake tier needs mooncake_url "
                             "(mooncake://127.0.0.1:50051?metadata_port=8080)")
        for key, tier in (("redis_url", "redis"), ("shm_path", "shm"), ("mooncake_url", "mooncake")):
            if getattr(config, key) and tier not in tiers:
                raise ValueError(f"KVLabConnector: {key} is only used with the {tier} tier; tiers are {list(tiers)}")
        if config.redis_url:
            try:
                check_redis_url(config.redis_url)
            except ValueError as error:
                raise ValueError(f"KVLabConnector: {error}") from None
        if config.mooncake_url:
            try:
                parse_mooncake_url(config.mooncake_url)
            except ValueError as error:
                raise ValueError(f"KVLabConnector: {error}") from None
        for tier, key in BUDGETS.items():  # an absurd budget given by hand; the defaults adapt (ENOSPC)
            room = _room(tier, config) if key in extra and tier in tiers else None
            if room and getattr(config, key) > room[0]:
                raise ValueError(f"KVLabConnector: {key} ({getattr(config, key):,} bytes) is more than {room[1]} "
                                 f"holds ({room[0]:,} bytes)")
        if config.auth_key is not None:
            if not config.shared_tiers:
                raise ValueError("KVLabConnector: auth_key signs the shared tiers' chunks; tiers are "
                                 f"{list(tiers)}, none of them shared")
            try:
                read_auth_key(config.auth_key)
            except ValueError as error:
                raise ValueError(f"KVLabConnector: {error}") from None
        if config.method not in METHODS and config.method != "auto":
            raise ValueError(f"KVLabConnector: method must be 'auto' or one of {list(METHODS)}, got {config.method!r}")
        if config.verify not in ("always", "disk"):
            raise ValueError(f"KVLabConnector: verify must be 'always' or 'disk', got {config.verify!r}")
        return config

    @property
    def tier_names(self) -> tuple[str, ...]:
        if self.tiers is not None:
            return self.tiers
        return ("memory", "disk") if self.store == "disk" else ("memory",)

    @property
    def shared_tiers(self) -> tuple[str, ...]:
        """The tiers every process sees (a scheduler looks them up itself)."""
        shared = shared_tier_names()
        return tuple(t for t in self.tier_names if t in shared)

    @property
    def shm_folder(self) -> str:
        return self.shm_path or f"/dev/shm/kvlab-{self.store_name}"

    def check_budgets(self, chunk_bytes: int) -> None:
        """Raise ValueError naming the key when a tier in use has a budget smaller than one
        chunk of ``chunk_bytes``: it would skip every write (known once the engine's geometry is)."""
        for tier, key in BUDGETS.items():
            budget = getattr(self, key)
            if tier in self.tier_names and budget < chunk_bytes:
                raise ValueError(f"KVLabConnector: {key} ({budget:,} bytes) is smaller than one chunk of this model's "
                                 f"KV ({chunk_bytes:,} bytes), so the {tier} tier would keep nothing; raise {key} "
                                 f"or lower chunk_size")

    def chunk_blocks(self, block_size: int) -> int:
        if self.chunk_size is None:
            return max(1, 256 // block_size)
        if self.chunk_size % block_size:
            raise ValueError(f"KVLabConnector: chunk_size {self.chunk_size} is not a multiple of the "
                             f"block size {block_size}")
        return self.chunk_size // block_size

    def shared_store_options(self) -> dict[str, Any]:
        """KVStore options for the shared tiers this config names."""
        tiers = self.tier_names
        return {"disk_path": self.disk_path if "disk" in tiers else None, "disk_capacity_bytes": self.disk_bytes,
                "shm_path": self.shm_folder if "shm" in tiers else None, "shm_capacity_bytes": self.shm_bytes,
                "redis_url": self.redis_url if "redis" in tiers else None, "verify": self.verify,
                "mooncake_url": self.mooncake_url if "mooncake" in tiers else None,
                "mooncake_segment_bytes": self.mooncake_segment_bytes,
                "auth_key": read_auth_key(self.auth_key) if self.auth_key else None}
