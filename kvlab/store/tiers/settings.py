"""A tier's own settings (``register_tier(name, factory, settings=...)``): a frozen dataclass
whose fields are the keys of the tier's dictionary, in the connector's
``kv_connector_extra_config`` (``{"disk": {"path": "/var/cache/kvlab"}}``) and in a
:class:`kvlab.store.KVStore`'s ``tiers``, each checked when made. A new tier with a URL, a
folder or a budget is then one module: nothing else names its settings."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

from kvlab.store.safe_paths import system_folder


@dataclass(frozen=True)
class TierSettings:
    """A tier's settings: a subclass is a frozen dataclass of its keys that checks them in
    ``__post_init__`` (ValueError naming the key). It may declare ``FLAT_KEYS``, the
    connector's keys of old (``"disk_path"``) and the field each one is now, which still
    work with a warning, and ``BUDGET``, the field bounding the tier's bytes: checked against
    one chunk, and against :meth:`room` when given."""

    FLAT_KEYS: ClassVar[Mapping[str, str]] = {}
    BUDGET: ClassVar[str | None] = None

    @classmethod
    def parse(cls, values: Mapping[str, Any], store_name: str = "default") -> TierSettings:
        """The settings ``values`` give, the others at their defaults; ValueError naming a key
        that is not one, or one without a default that is missing. ``store_name`` names a
        store's own places (the shm tier's default folder)."""
        if not isinstance(values, Mapping):
            raise ValueError(f"its settings must be a mapping of {sorted(cls.keys())} to values, got {values!r}")
        unknown = sorted(set(values) - set(cls.keys()), key=str)
        if unknown:
            raise ValueError(f"unknown setting(s) {unknown}; its settings are {sorted(cls.keys())}")
        missing = [f.name for f in fields(cls)
                   if f.default is MISSING and f.default_factory is MISSING and f.name not in values]
        if missing:
            raise ValueError(f"{', '.join(missing)} must be given (no default)")
        return cls(**values)

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def room(self) -> tuple[int, str] | None:
        """The most bytes the tier could ever hold here, and what bounds it; None where that
        cannot be told (a server bounds its own)."""
        return None


def check_bytes(name: str, value: object, least: int = 1) -> None:
    """ValueError unless ``value`` is a whole number of bytes, at least ``least``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be a {'positive' if least else 'non-negative'} integer (bytes), got {value!r}")


def check_text(name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")


def check_folder(name: str, value: object, example: str) -> str:
    """``value`` as a folder's absolute path (every process of a store must mean the same
    one), and not a system folder: kvlab evicts chunk files there."""
    if isinstance(value, Path):
        value = str(value)
    check_text(name, value)
    if not os.path.isabs(value) or "\0" in value:
        raise ValueError(f"{name} must be an absolute path, got {value!r}")
    if system_folder(os.path.realpath(value)):
        raise ValueError(f"{name} must be a folder of kvlab's own (it evicts chunk files there), not the "
                         f"system's {value!r}: e.g. {example}")
    return value


def filesystem_room(folder: str) -> tuple[int, str] | None:
    """The size of the filesystem of ``folder`` (or of the nearest folder above it that
    exists); None where it cannot be told."""
    path = Path(folder)
    try:
        while not path.exists():
            path = path.parent
        stats = os.statvfs(path)
    except (OSError, AttributeError):  # no statvfs (Windows)
        return None
    return stats.f_frsize * stats.f_blocks, f"the filesystem of {path}"
