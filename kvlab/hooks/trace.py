"""A tracer of the hooks: per layer, when its load was copied, when the load wait started
and ended, when attention ran, when the save was issued (kvlab.plotting draws it as a timeline)."""

from __future__ import annotations

import contextlib
import contextvars
import time
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple

import torch

from kvlab.cache.devices import synchronize


class TraceEvent(NamedTuple):
    layer: str
    event: str  # "load" (the layer's copy), "load_wait", "attention" or "save" (the save being issued)
    start: float  # seconds since the trace began
    end: float


@dataclass
class LayerTrace:
    """Per-layer timestamps of loads, load waits, attention and save issues, while active.

    Times are host ``time.perf_counter`` seconds from the trace's start. On an accelerator
    the host runs ahead of the device; pass ``sync`` (a device) to synchronize it at every
    timestamp, so spans show device work at the cost of the overlap being measured.
    """

    sync: str | torch.device | None = None
    events: list[TraceEvent] = field(default_factory=list)
    _origin: float = field(default=0.0, init=False, repr=False)
    _token: contextvars.Token | None = field(default=None, init=False, repr=False)

    def _clock(self) -> float:
        if self.sync is not None:
            synchronize(torch.device(self.sync))
        return time.perf_counter()

    def now(self) -> float:
        """Seconds since the trace began."""
        return self._clock() - self._origin

    def __enter__(self) -> LayerTrace:
        self._origin = self._clock()
        self._token = _ACTIVE_TRACE.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _ACTIVE_TRACE.reset(self._token)

    def record_span(self, layer: str, event: str, start: float, end: float) -> None:
        """Record ``event`` of ``layer`` that ran from ``start`` to ``end`` (time.perf_counter
        seconds, as another thread measured them: a layerwise load's copies)."""
        self.events.append(TraceEvent(layer, event, start - self._origin, end - self._origin))

    def rows(self) -> list[dict]:
        """One dict per event (layer, event, start, end), in the order they began."""
        return [event._asdict() for event in sorted(self.events, key=lambda e: e.start)]


_ACTIVE_TRACE: contextvars.ContextVar[LayerTrace | None] = contextvars.ContextVar("kvlab_layer_trace", default=None)


def active_trace() -> LayerTrace | None:
    """The trace recording now, if any."""
    return _ACTIVE_TRACE.get()


@contextlib.contextmanager
def traced(layer: str, event: str) -> Iterator[None]:
    """Record the enclosed code as ``event`` of ``layer`` in the active trace, if any."""
    trace = _ACTIVE_TRACE.get()
    if trace is None:
        yield
        return
    start = trace.now()
    yield
    trace.events.append(TraceEvent(layer, event, start, trace.now()))
