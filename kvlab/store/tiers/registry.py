"""The tiers a store can have, by name, in lookup order: ``register_tier(name, factory)``.

A factory is given the store's settings (a :class:`kvlab.store.KVStore`: its budgets,
folders, URL, ``stats`` and ``auth_key``) and returns the tier, or None where those
settings do not ask for it. KVStore opens every registered tier its settings ask for, in
the order they were registered; the connector's ``tiers`` key accepts their names."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from kvlab.store.tiers.protocol import Tier

TierFactory = Callable[[Any], "Tier | None"]
_NAME = re.compile(r"[a-z][a-z0-9_]*")


@dataclass(frozen=True)
class TierKind:
    """A registered tier: its name, whether every process sees it, and how to open it."""

    name: str
    factory: TierFactory
    shared: bool


_KINDS: dict[str, TierKind] = {}


def register_tier(name: str, factory: TierFactory, *, shared: bool = True, replace: bool = False) -> None:
    """Make ``name`` a tier stores open (with ``factory``) and the connector's ``tiers`` accept,
    looked up after those registered before it. ValueError for a bad or taken name (unless
    ``replace``: then it keeps its place), TypeError for a factory that cannot be called."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"a tier name is lower-case letters, digits and '_', starting with a letter; got {name!r}")
    if not callable(factory):
        raise TypeError(f"the factory of tier {name!r} must be callable, got {type(factory).__name__}")
    if name in _KINDS and not replace:
        raise ValueError(f"tier {name!r} is registered already (pass replace=True to replace it)")
    _KINDS[name] = TierKind(name, factory, bool(shared))


def unregister_tier(name: str) -> None:
    """Forget a registered tier (tests of a tier of their own)."""
    if name not in _KINDS:
        raise ValueError(f"no tier {name!r} is registered; registered are {tier_names()}")
    del _KINDS[name]


def tier_names() -> tuple[str, ...]:
    """Every registered tier's name, in lookup order."""
    return tuple(_KINDS)


def shared_tier_names() -> tuple[str, ...]:
    """The registered tiers every process sees, in lookup order."""
    return tuple(kind.name for kind in _KINDS.values() if kind.shared)


def open_tiers(settings: Any) -> list[Tier]:
    """Every registered tier ``settings`` asks for, opened, in lookup order."""
    tiers = []
    for kind in list(_KINDS.values()):
        tier = kind.factory(settings)
        if tier is not None:
            tiers.append(tier)
    return tiers
