"""This process's connector state, by store name: the counters of its connectors and, in a
worker process, the worker's tiers. vLLM builds each connector itself, so the scheduler and
worker sides of one process find their shared counters here; a harness reads them in the
process that holds them (``LLM.collective_rpc`` reaches a worker in another process)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from kvlab.connector.config import ConnectorConfig
from kvlab.store.store import KVStore
from kvlab.store.tiers import StoreStats

# A worker's memory tier holds what the scheduler tells it to: the scheduler keeps the budget.
UNBOUNDED = 1 << 62


@dataclass
class ConnectorStats:
    """What the connectors of one store did in this process (for notebooks and tests)."""

    lookups: int = 0  # requests vLLM admitted after a lookup
    hit_tokens: int = 0
    preemptions: int = 0  # requests vLLM preempted (their blocks reused; loaded again when resumed)
    loaded_blocks: int = 0
    saved_blocks: int = 0
    load_segments: int = 0  # contiguous runs copied (one per block for a cross-layer cache)
    save_segments: int = 0
    load_seconds: float = 0.0  # the model runner blocked in loads
    load_work_seconds: float = 0.0  # the loads' own copying (layerwise: on a thread, beside the layers; a file
    # tier's reads straight into the cache: from the first one's start to the last one's end)
    load_wait_seconds: float = 0.0  # layerwise: the model runner waiting for a layer's copy (not hidden)
    save_seconds: float = 0.0  # the model runner blocked in saves (queuing them, with async saves)
    save_work_seconds: float = 0.0  # the saves' own work, beside the forward with async saves
    load_errors: int = 0  # loads that failed; vLLM recomputes their blocks
    save_errors: int = 0  # saves that failed; nothing stored, the request unaffected
    cancelled_saves: int = 0  # saves of blocks a failed load left wrong: nothing stored
    fallback_loads: int = 0  # chunks loaded from another tier than the one first named
    layout: str | None = None


@dataclass
class _Shared:
    stats: ConnectorStats = field(default_factory=ConnectorStats)
    store_stats: StoreStats = field(default_factory=StoreStats)  # of every store opened in this process
    store: KVStore | None = None  # a worker's tiers


_SHARED: dict[str, _Shared] = {}


def shared(config: ConnectorConfig) -> _Shared:
    """This process's state for ``config``'s store name, created on first use."""
    return _SHARED.setdefault(config.store_name, _Shared())


def worker_store(config: ConnectorConfig) -> KVStore:
    """This process's worker tiers for ``config``'s store name, opened on first use."""
    entry = shared(config)
    if entry.store is None:
        entry.store = new_worker_store(config, entry.store_stats)
    return entry.store


def new_worker_store(config: ConnectorConfig, stats: StoreStats | None = None) -> KVStore:
    """A worker's tiers: its memory (kept as the scheduler says) and the shared tiers."""
    return KVStore(UNBOUNDED, promote=False, stats=stats or StoreStats(), **config.store_options())


def lookup_store(config: ConnectorConfig) -> KVStore | None:
    """The shared tiers as a scheduler looks them up (None when there are none)."""
    if not config.shared_tiers:
        return None
    return KVStore(promote=False, stats=shared(config).store_stats, **config.store_options())


def reset_stores() -> None:
    """Forget every in-process store (their shared tiers stay)."""
    for entry in _SHARED.values():
        if entry.store is not None:
            entry.store.clear()
    _SHARED.clear()


def worker_stores() -> list[KVStore]:
    """Every worker's tiers opened in this process."""
    return [entry.store for entry in _SHARED.values() if entry.store is not None]


def all_stats() -> dict[str, dict]:
    """Connector and store counters of every store in this process, by store name."""
    return {name: {**asdict(entry.stats), "store": asdict(entry.store_stats)} for name, entry in _SHARED.items()}
