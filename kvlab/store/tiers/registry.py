"""The tiers a store can have, by name, in lookup order: ``register_tier(name, factory,
settings=...)``.

A tier owns its settings: a :class:`TierSettings` subclass parses and checks them, and a
factory is given them and the store (its ``stats`` and ``auth_key``) and returns the tier.
A store opens its memory tier and the tiers it is given, nothing else, in the order they
were registered; the connector's ``tiers`` key accepts their names, and reads each one's
settings from its own dictionary."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

from kvlab.store.tiers.protocol import Tier
from kvlab.store.tiers.settings import TierSettings

# (its settings, or None for a tier that takes none; the store) -> the tier
TierFactory = Callable[[Any, Any], Tier]
_NAME = re.compile(r"[a-z][a-z0-9_]*")


@dataclass(frozen=True)
class TierKind:
    """A registered tier: its name, how to open it, whether every process sees it, and the
    class of its settings (None: it takes none)."""

    name: str
    factory: TierFactory
    shared: bool
    settings: type[TierSettings] | None = None


_KINDS: dict[str, TierKind] = {}


def register_tier(name: str, factory: TierFactory, *, settings: type[TierSettings] | None = None,
                  shared: bool = True, replace: bool = False) -> None:
    """Make ``name`` a tier a store opens when told to (``factory(settings, store)``) and the
    connector's ``tiers`` accept, looked up after those registered before it; ``settings`` is
    the class of its settings. ValueError for a bad or taken name (unless ``replace``: then
    it keeps its place) or a flat key another tier has, TypeError for a factory that cannot
    be called or settings that are no TierSettings."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"a tier name is lower-case letters, digits and '_', starting with a letter; got {name!r}")
    if not callable(factory):
        raise TypeError(f"the factory of tier {name!r} must be callable, got {type(factory).__name__}")
    if settings is not None and not (isinstance(settings, type) and issubclass(settings, TierSettings)):
        raise TypeError(f"the settings of tier {name!r} must be a TierSettings dataclass, got {settings!r}")
    if name in _KINDS and not replace:
        raise ValueError(f"tier {name!r} is registered already (pass replace=True to replace it)")
    taken = {key: tier for key, (tier, _) in flat_keys().items() if tier != name}
    clash = sorted(set(settings.FLAT_KEYS if settings else ()) & set(taken))
    if clash:
        raise ValueError(f"tier {name!r}: the flat key(s) {clash} are the {taken[clash[0]]} tier's")
    _KINDS[name] = TierKind(name, factory, bool(shared), settings)


def unregister_tier(name: str) -> None:
    """Forget a registered tier (tests of a tier of their own)."""
    tier_kind(name)
    del _KINDS[name]


def tier_kind(name: str) -> TierKind:
    """The registered tier ``name``; ValueError listing them for another name."""
    if name not in _KINDS:
        raise ValueError(f"no tier {name!r} is registered; registered are {tier_names()}")
    return _KINDS[name]


def tier_names() -> tuple[str, ...]:
    """Every registered tier's name, in lookup order."""
    return tuple(_KINDS)


def shared_tier_names() -> tuple[str, ...]:
    """The registered tiers every process sees, in lookup order."""
    return tuple(kind.name for kind in _KINDS.values() if kind.shared)


def flat_keys() -> dict[str, tuple[str, str]]:
    """The connector's keys of old, before each tier had a dictionary of its own
    (``disk_path``): (tier, the setting each one is now)."""
    return {key: (kind.name, setting) for kind in _KINDS.values() if kind.settings
            for key, setting in kind.settings.FLAT_KEYS.items()}


def tier_settings(name: str, values: Mapping[str, Any] | TierSettings | None,
                  store_name: str = "default") -> TierSettings | None:
    """The settings of tier ``name`` that ``values`` give (its class's instance as it is,
    None or a mapping parsed by the class); ValueError naming the tier and what is wrong."""
    kind = tier_kind(name)
    if kind.settings is None:
        if values:
            raise ValueError(f"the {name} tier takes no settings, got {values!r}")
        return None
    if isinstance(values, kind.settings):
        return values
    try:
        return kind.settings.parse({} if values is None else values, store_name)
    except ValueError as error:
        raise ValueError(f"the {name} tier: {error}") from None


def open_tier(name: str, settings: TierSettings | None, store: Any) -> Tier:
    """Tier ``name`` opened with its settings (:func:`tier_settings`) for ``store``."""
    tier = tier_kind(name).factory(settings, store)
    if tier is None:
        raise ValueError(f"the factory of tier {name!r} opened nothing")
    return tier
