"""The stores of this process's connectors, by name (a scheduler-side and a worker-side
connector in one process share one), their counters, and experiment controls over them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvlab.connector.config import ConnectorConfig
from kvlab.store.store import KVStore

if TYPE_CHECKING:
    pass


@dataclass
class ConnectorStats:
    """What the connectors of one store did in this process (for notebooks and tests)."""

    lookups: int = 0
    hit_tokens: int = 0
    loaded_blocks: int = 0
    saved_blocks: int = 0
    load_segments: int = 0  # contiguous runs copied (one per block for a cross-layer cache)
    save_segments: int = 0
    load_seconds: float = 0.0
    save_seconds: float = 0.0
    load_errors: int = 0  # loads that failed; vLLM recomputes their blocks
    save_errors: int = 0  # saves that failed; nothing stored, the request unaffected
    layout: str | None = None


@dataclass
class _Shared:
    """One store and what the worker registered, shared by the scheduler-side and
    worker-side connector of an engine (they live in the same process)."""

    store: KVStore
    signature: str | None = None
    stats: ConnectorStats = field(default_factory=ConnectorStats)


_SHARED: dict[tuple, _Shared] = {}


def shared(config: ConnectorConfig) -> _Shared:
    """The store for ``config`` in this process, created on first use."""
    key = (config.store_name, config.store, config.disk_path, config.store_bytes, config.disk_bytes, config.verify)
    if key not in _SHARED:
        disk = Path(config.disk_path).expanduser() if config.store == "disk" else None
        _SHARED[key] = _Shared(KVStore(config.store_bytes, disk, config.disk_bytes, config.verify))
    return _SHARED[key]


def reset_stores() -> None:
    """Forget every in-process store (their disk folders stay)."""
    drop_memory_tiers()
    _SHARED.clear()


def drop_memory_tiers() -> None:
    """Empty every store's in-memory tier, so the next loads come from disk."""
    for entry in _SHARED.values():
        entry.store.clear()


def zero_memory_tiers() -> None:
    """Zero every store's in-memory chunks (KVStore.zero_memory): the engine checks'
    sensitivity control, called inside the engine process."""
    for entry in _SHARED.values():
        entry.store.zero_memory()


def all_stats() -> dict[str, dict]:
    """Connector and store counters of every store in this process, by store name."""
    return {key[0]: {**asdict(entry.stats), "store": asdict(entry.store.stats)} for key, entry in _SHARED.items()}
