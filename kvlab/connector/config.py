"""KVLabConnector's ``kv_connector_extra_config``: every key, its default, and a clear error
at start-up for anything else. A tier's own settings are its own dictionary, named after it
and parsed by its settings class (kvlab.store.tiers): this module names none of them."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from kvlab.store.secrets import read_auth_key
from kvlab.store.tiers import TierSettings, flat_keys, shared_tier_names, tier_kind, tier_names, tier_settings
from kvlab.transfer.registry import METHODS

logger = logging.getLogger("kvlab.connector")
CROSS_LAYER_LAYOUT = "BLHNC"
STORE_NAME = re.compile(r"(?!\.\.?$)[A-Za-z0-9._-]+")
# The tiers a server serves to whoever reaches it: auth_key is their only check of who wrote a chunk.
REMOTE_TIERS = ("redis", "mooncake")
BOOLEANS = ("enable_cross_layers_blocks", "layerwise", "hooks", "async_saves", "strict")
TEXTS = ("store_name", "store", "method", "verify", "auth_key")
_warned: set[str] = set()  # flat keys whose warning this process logged


@dataclass(frozen=True)
class ConnectorConfig:
    """``kv_connector_extra_config`` keys; anything else fails at start-up. Each tier in
    ``tiers`` takes its settings from a dictionary named after it, e.g. ``"disk": {"path":
    "/var/cache/kvlab", "bytes": 17179869184}``; they are ``tier_settings`` here."""

    enable_cross_layers_blocks: bool = False  # ask vLLM for a block-major cache (as the seed change did)
    layerwise: bool = False  # load each layer just before its attention, save it right after
    # layerwise through kvlab.hooks, called from kvlab's CPU attention backend as vllm-ascend's
    # attention calls them (non-dict metadata, (k, v) tuples); vLLM's own per-layer calls are ignored
    hooks: bool = False
    # lookup order, of the tiers kvlab.store.tiers registers; default from `store`
    tiers: tuple[str, ...] | None = None
    store: str = "cpu"  # shorthand for tiers: "cpu" = memory; "disk" = memory, then disk
    store_bytes: int = 2 << 30  # each worker's memory budget, kept by the scheduler; least recently used chunks go first
    chunk_size: int | None = None  # tokens per stored chunk; default 256 rounded to blocks
    method: str = "auto"  # a kvlab.transfer copy method; "auto": the most preferred that runs here (CopyMethod.preference)
    verify: str = "disk"  # "disk": CRC of every chunk read from a shared tier; "always": also in memory
    async_saves: bool = True  # saves run beside the forward; a request's blocks are held until saved
    # "file:/path" or "env:VARIABLE" naming a secret of 16+ bytes: every chunk of a shared tier then
    # carries an HMAC-SHA256 under it, and one without a valid MAC is never loaded (docs/reliability.md)
    auth_key: str | None = None
    store_name: str = "default"  # names the shared-memory folder and this process's counters
    # raise, instead of recomputing, an error of a load or a save that is not the store's fault
    # (kvlab.store.faults: a bug must not look like a recompute); kvlab.harness's engines and driver set it
    strict: bool = False
    # each tier's settings (kvlab.store.tiers.TierSettings, None for a tier that takes none), from its dictionary
    tier_settings: Mapping[str, TierSettings | None] = field(default_factory=dict, hash=False)

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        if extra is not None and not isinstance(extra, Mapping):
            raise ValueError(f"KVLabConnector: kv_connector_extra_config must be a mapping of keys to values, "
                             f"got {type(extra).__name__}")
        own, given, origin = _split(dict(extra or {}))
        config = cls(**_checked(own))
        tiers = config.tier_names
        known = tier_names()
        if any(t not in known for t in tiers) or len(set(tiers)) != len(tiers):
            raise ValueError(f"KVLabConnector: tiers must name each of {list(known)} at most once, got {list(tiers)}")
        unnamed = sorted(given.keys() - set(tiers))
        if unnamed:
            raise ValueError(f"KVLabConnector: {origin[unnamed[0]]} is a setting of the {unnamed[0]} tier, which "
                             f"tiers ({list(tiers)}) does not name")
        settings = {}
        for tier in tiers:
            try:
                settings[tier] = tier_settings(tier, given.get(tier, {}), config.store_name)
            except ValueError as error:
                raise ValueError(f"KVLabConnector: {error}") from None
        config = replace(config, tier_settings=settings)
        config._check(given)
        return config

    def _check(self, given: Mapping[str, Mapping[str, Any]]) -> None:
        """What no single key tells: keys that contradict each other, budgets no machine
        holds (given by hand; the defaults adapt: ENOSPC)."""
        if self.hooks and not self.layerwise:
            raise ValueError("KVLabConnector: hooks: true drives a layerwise connector from the attention hooks, "
                             "but layerwise is false; set \"layerwise\": true too")
        if self.store not in ("cpu", "disk"):
            raise ValueError(f"KVLabConnector: store must be 'cpu' or 'disk', got {self.store!r}")
        for tier, settings in self.tier_settings.items():
            budget = settings.BUDGET if settings is not None else None
            room = settings.room() if budget in given.get(tier, {}) else None
            if room and getattr(settings, budget) > room[0]:
                raise ValueError(f"KVLabConnector: the {tier} tier's {budget} ({getattr(settings, budget):,} bytes) "
                                 f"is more than {room[1]} holds ({room[0]:,} bytes)")
        if self.auth_key is not None:
            if not self.shared_tiers:
                raise ValueError("KVLabConnector: auth_key signs the shared tiers' chunks; tiers are "
                                 f"{list(self.tier_names)}, none of them shared")
            try:
                read_auth_key(self.auth_key)
            except ValueError as error:
                raise ValueError(f"KVLabConnector: {error}") from None
        if self.method not in METHODS and self.method != "auto":
            raise ValueError(f"KVLabConnector: method must be 'auto' or one of {list(METHODS)}, got {self.method!r}")
        if self.verify not in ("always", "disk"):
            raise ValueError(f"KVLabConnector: verify must be 'always' or 'disk', got {self.verify!r}")

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

    def check_budgets(self, chunk_bytes: int) -> None:
        """Raise ValueError naming the key when a tier in use has a budget smaller than one
        chunk of ``chunk_bytes``: it would skip every write (known once the engine's geometry is)."""
        budgets = {tier: (f"{tier}.{s.BUDGET}", getattr(s, s.BUDGET))
                   for tier, s in self.tier_settings.items() if s is not None and s.BUDGET}
        if "memory" in self.tier_names:
            budgets["memory"] = ("store_bytes", self.store_bytes)
        for tier, (key, budget) in budgets.items():
            if budget < chunk_bytes:
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

    def store_options(self) -> dict[str, Any]:
        """KVStore options for the shared tiers this config names: each with its settings."""
        return {"tiers": {tier: self.tier_settings[tier] for tier in self.shared_tiers}, "verify": self.verify,
                "auth_key": read_auth_key(self.auth_key) if self.auth_key else None}


def _split(extra: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]], dict[str, str]]:
    """``extra`` as the config's own keys, each tier's dictionary of settings (the flat keys
    of old folded in, with a warning naming the new form) and, by tier, the key its settings
    came from (for errors). ValueError for an unknown key."""
    keys = [f.name for f in fields(ConnectorConfig) if f.name != "tier_settings"]
    flat = flat_keys()
    unknown = sorted((k for k in extra if k not in keys and k not in tier_names() and k not in flat), key=str)
    if unknown:
        raise ValueError(f"KVLabConnector: unknown kv_connector_extra_config key(s) {unknown}; known keys are "
                         f"{keys} and a dictionary of settings per tier, named after it: {list(tier_names())}")
    own = {key: value for key, value in extra.items() if key in keys}
    given: dict[str, dict[str, Any]] = {}
    origin: dict[str, str] = {}
    for tier in (k for k in extra if k in tier_names()):
        values = extra[tier]
        if not isinstance(values, Mapping):
            raise ValueError(f"KVLabConnector: {tier} must be a mapping of the {tier} tier's settings "
                             f"{list(tier_kind(tier).settings.keys()) if tier_kind(tier).settings else []}, "
                             f"got {values!r}")
        given[tier], origin[tier] = dict(values), tier
    for key in (k for k in extra if k in flat):
        tier, setting = flat[key]
        if setting in given.get(tier, {}):
            raise ValueError(f"KVLabConnector: give {tier}.{setting} once: as {key} or in {tier}, not both")
        given.setdefault(tier, {})[setting] = extra[key]
        origin.setdefault(tier, key)
        if key not in _warned:
            _warned.add(key)
            logger.warning("KVLabConnector: %s is the old form of {\"%s\": {\"%s\": ...}}; it still works, but each "
                           "tier takes its settings in a dictionary of its own", key, tier, setting)
    return own, given, origin


def _checked(own: dict[str, Any]) -> dict[str, Any]:
    """The config's own keys, each of the type it must be (ValueError naming it)."""
    for name in (n for n in BOOLEANS if n in own):
        if not isinstance(own[name], bool):
            raise ValueError(f"KVLabConnector: {name} must be true or false, got {own[name]!r}")
    for name in (n for n in ("store_bytes", "chunk_size") if n in own):
        value = own[name]
        if name == "chunk_size" and value is None:  # the default chunk
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"KVLabConnector: {name} must be a positive integer, got {value!r}")
    for name in (n for n in TEXTS if n in own):
        if not isinstance(own[name], str) or not own[name]:
            raise ValueError(f"KVLabConnector: {name} must be a non-empty string, got {own[name]!r}")
    memory = _machine_memory() if "store_bytes" in own else None  # a budget given by hand; the default adapts
    if memory and own["store_bytes"] > memory:
        raise ValueError(f"KVLabConnector: store_bytes ({own['store_bytes']:,} bytes) is more than this machine's "
                         f"memory holds ({memory:,} bytes)")
    if "store_name" in own and not STORE_NAME.fullmatch(own["store_name"]):
        raise ValueError(f"KVLabConnector: store_name names a folder (/dev/shm/kvlab-<store_name>): letters, "
                         f"digits, '.', '_' and '-' only, got {own['store_name']!r}")
    if "tiers" in own:
        if "store" in own:
            raise ValueError("KVLabConnector: give either store (a shorthand) or tiers, not both")
        tiers = own["tiers"]
        if not isinstance(tiers, (list, tuple)) or not tiers or not all(isinstance(t, str) for t in tiers):
            raise ValueError(f"KVLabConnector: tiers must be a list of tier names from {list(tier_names())}, "
                             f"got {tiers!r}")
        own["tiers"] = tuple(tiers)
    return own


def _machine_memory() -> int | None:
    """This machine's memory in bytes; None where that cannot be told."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no such sysconf name (Windows)
        return None
