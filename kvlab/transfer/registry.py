"""The copy methods, found by name. Each lives in its own module under
``kvlab/transfer/methods/`` and registers a :class:`CopyMethod`: how it runs a transfer,
why it cannot run between two caches here, and how figures show it.

``METHODS`` (kvlab's own) and ``PEERS`` (other projects' copy functions, timed beside
them) are live views of the registry, in figure order: a method registered later (a new
module, or a notebook cell) appears in the bench, the round trips, the connector's
choices and the figures at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from kvlab.cache.allocation import KVCache


def _runs_anywhere(src: KVCache, dst: KVCache) -> str | None:
    return None


@dataclass(frozen=True)
class CopyMethod:
    """One way of copying a transfer's blocks."""

    name: str
    run: Callable[[Any], None]  # issue the copy of a kvlab.transfer.Transfer (on its device and stream)
    colour: str  # in every figure
    label: str = ""  # in figure legends; the name when empty
    unavailable: Callable[[KVCache, KVCache], str | None] = _runs_anywhere  # why not here, or None
    peer: bool = False  # another project's copy function, timed beside kvlab's
    # issue several independent transfers in one go on so many host threads (a connector's
    # load of several chunks); None: kvlab.transfer.run_all runs them one by one
    run_many: Callable[[Any, int], None] | None = None
    rank: int = 100  # position in tables and figures
    # where method="auto" (the connector's default) tries it, lowest first; None: "auto" never picks it
    preference: int | None = None
    # it moves the copy plan's runs (kvlab.transfer.plan), so it copies any plan: also the
    # heads of one tensor-parallel shard into another's (a chunk stored at another size)
    plan_runs: bool = False

    @property
    def legend(self) -> str:
        return self.label or self.name


_REGISTRY: dict[str, CopyMethod] = {}


def register(method: CopyMethod, *, replace: bool = False) -> CopyMethod:
    """Make ``method`` available by its name (``replace`` a registered one on purpose)."""
    if method.name in _REGISTRY and not replace:
        raise ValueError(f"a copy method named {method.name!r} is registered already (replace=True to swap it)")
    _REGISTRY[method.name] = method
    return method


def unregister(name: str) -> None:
    """Forget a method (one registered for an experiment)."""
    get_method(name)
    del _REGISTRY[name]


def get_method(name: str) -> CopyMethod:
    if name not in _REGISTRY:
        raise ValueError(f"unknown method {name!r}; choose one of {list(ALL_METHODS)}")
    return _REGISTRY[name]


class _Names(Sequence[str]):
    """The registered names of kvlab's own methods, of the peers, or of both (``peer``
    None: own first), in figure order, read when used."""

    def __init__(self, peer: bool | None) -> None:
        self._peer = peer

    def _names(self) -> tuple[str, ...]:
        chosen = [m for m in _REGISTRY.values() if self._peer is None or m.peer == self._peer]
        return tuple(m.name for m in sorted(chosen, key=lambda m: (m.peer, m.rank)))

    def __getitem__(self, index):
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __add__(self, other: Sequence[str]) -> tuple[str, ...]:
        return self._names() + tuple(other)

    def __radd__(self, other: Sequence[str]) -> tuple[str, ...]:
        return tuple(other) + self._names()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and tuple(other) == self._names()

    def __repr__(self) -> str:
        return repr(self._names())


METHODS = _Names(peer=False)
PEERS = _Names(peer=True)
ALL_METHODS = _Names(peer=None)


def preferred_methods() -> list[str]:
    """kvlab's methods that method="auto" may pick, most preferred first (CopyMethod.preference)."""
    chosen = [m for m in _REGISTRY.values() if m.preference is not None and not m.peer]
    return [m.name for m in sorted(chosen, key=lambda m: m.preference)]


def method_status(method: str, src: KVCache, dst: KVCache) -> str | None:
    """Why ``method`` cannot copy between these two here, or None when it can."""
    return get_method(method).unavailable(src, dst)


def available_methods(src: KVCache, dst: KVCache, peers: bool = False) -> list[str]:
    """Methods that can copy between these two caches on this machine."""
    return [m for m in METHODS + (PEERS if peers else ()) if method_status(m, src, dst) is None]


def method_colours() -> dict[str, str]:
    """Every method's colour, in figure order (kvlab's own, then the peers)."""
    return {name: _REGISTRY[name].colour for name in ALL_METHODS}
