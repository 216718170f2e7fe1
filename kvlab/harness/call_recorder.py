"""A recorder of KVLabConnector's calls in an engine process: both sides, in the order vLLM
makes them, each with the KV copies it made or handed to a thread of the connector's. What the
machinery diagrams (kvlab.connector.step_order, drawn by kvlab.plotting.machinery) are checked
against, on a real engine step (kvlab.harness.engine: ``EngineSpec(record_calls=True)``).

Every copy method is wrapped while it records, so a copy names the connector call it came from
(a context variable, which kvlab.transfer carries onto its threads) and the thread it ran on."""

from __future__ import annotations

import contextvars
import dataclasses
import itertools
import threading
from typing import Any, Iterable, Sequence

from kvlab.connector.step_order import PER_LAYER_CALLS, StepCall

_CALL: contextvars.ContextVar[int | None] = contextvars.ContextVar("kvlab_recorded_call", default=None)
# threads that copy for a call which waits for them (kvlab.transfer.run_all's pool): the call's own work
JOINED_THREADS = ("kvlab-transfers",)


class CallRecorder:
    """Record the calls ``names`` of KVLabConnector while installed, and every KV copy."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = tuple(names)
        self.events: list[dict] = []
        self._lock = threading.Lock()
        self._count = itertools.count()
        self._caches: list[Any] = []  # the registered caches: a copy into one is a load, out of one a save
        self._originals: dict[str, Any] = {}
        self._methods: dict[str, Any] = {}

    def install(self) -> None:
        from kvlab.connector.connector import KVLabConnector
        from kvlab.transfer.registry import ALL_METHODS, get_method, register

        if self._originals:
            return
        for name in self.names:
            self._originals[name] = KVLabConnector.__dict__.get(name)
            setattr(KVLabConnector, name, self._recorded(name, getattr(KVLabConnector, name)))
        for name in ALL_METHODS:
            method = self._methods[name] = get_method(name)
            register(dataclasses.replace(method, run=self._copying(method.run, lambda t: [t]),
                                         run_many=method.run_many and self._copying(method.run_many, list)),
                     replace=True)

    def uninstall(self) -> None:
        from kvlab.connector.connector import KVLabConnector
        from kvlab.transfer.registry import register

        for name, original in self._originals.items():
            if original is None:
                delattr(KVLabConnector, name)
            else:
                setattr(KVLabConnector, name, original)
        for method in self._methods.values():
            register(method, replace=True)
        self._originals.clear()
        self._methods.clear()

    def read(self) -> list[dict]:
        """The events since the last read, in order."""
        with self._lock:
            events, self.events = self.events, []
        return events

    def _add(self, event: dict) -> dict:
        with self._lock:
            self.events.append(event)
        return event

    def _recorded(self, name: str, method: Any) -> Any:
        from kvlab.hooks import driven_by_hooks

        recorder = self

        def recorded(connector: Any, *args: Any, **kwargs: Any) -> Any:
            worker = connector.worker is not None
            if worker and connector.cache is not None and not any(c is connector.cache for c in recorder._caches):
                recorder._caches.append(connector.cache)
            layer = args[0] if name in PER_LAYER_CALLS and args else kwargs.get("layer_name")
            event = recorder._add({"index": next(recorder._count), "call": name,
                                   "side": "worker" if worker else "scheduler", "layer": layer,
                                   "caller": "hooks" if driven_by_hooks(connector) else "vllm",
                                   "thread": threading.current_thread().name})
            token = _CALL.set(event["index"])
            try:
                return method(connector, *args, **kwargs)
            finally:
                _CALL.reset(token)
        return recorded

    def _copying(self, run: Any, transfers_of: Any) -> Any:
        recorder = self

        def copying(first: Any, *args: Any) -> Any:
            transfers = transfers_of(first)
            directions = {"load" if any(t.dst is c for c in recorder._caches) else
                          "save" if any(t.src is c for c in recorder._caches) else "other" for t in transfers}
            recorder._add({"copy": "+".join(sorted(directions)), "origin": _CALL.get(),
                           "thread": threading.current_thread().name})
            return run(first, *args)
        return copying


def forward_steps(events: Sequence[dict]) -> list[list[dict]]:
    """The engine steps of ``events`` that ran a forward (the per-layer calls), in order: a
    step ends with the scheduler's ``update_connector_output`` (or, where only the worker side
    was recorded, at the next ``bind_connector_metadata``); each copy goes with the step of the
    call it came from, wherever a thread of the connector's ran it."""
    cut: list[list[dict]] = [[]]
    for event in (e for e in events if "call" in e):
        ends = cut[-1] and cut[-1][-1]["call"] == "update_connector_output"
        again = event["call"] == "bind_connector_metadata" and any(e["call"] == event["call"] for e in cut[-1])
        if ends or again:
            cut.append([])
        cut[-1].append(event)
    step_of = {event["index"]: number for number, step in enumerate(cut) for event in step}
    for copy in (e for e in events if "copy" in e and e["origin"] in step_of):
        cut[step_of[copy["origin"]]].append(copy)
    return [step for step in cut if any(e.get("call") in PER_LAYER_CALLS for e in step)]


def recorded_calls(step: Sequence[dict]) -> list[StepCall]:
    """One recorded step as the diagrams' data: its calls in order, the per-layer ones once
    (checked to repeat alike for every layer), each with the copies it made in the call and
    those it handed to a thread of the connector's."""
    calls = {e["index"]: e for e in step if "call" in e}
    made: dict[int, set[str]] = {index: set() for index in calls}
    queued: dict[int, set[str]] = {index: set() for index in calls}
    for copy in (e for e in step if "copy" in e and e["origin"] in calls):
        own = copy["thread"] == calls[copy["origin"]]["thread"] or copy["thread"].startswith(JOINED_THREADS)
        (made if own else queued)[copy["origin"]].add(copy["copy"])
    shown: list[StepCall] = []
    layers: dict[str, list[StepCall]] = {}
    for index, event in calls.items():
        call = StepCall(event["side"], event["call"], per_layer=event["call"] in PER_LAYER_CALLS, caller=event["caller"],
                        copies=tuple(sorted(made[index])), queues=tuple(sorted(queued[index])))
        if not call.per_layer:
            shown.append(call)
            continue
        if not layers:
            shown.append(call)  # where the layers run: the first layer's calls stand for every layer's
        layers.setdefault(event["layer"], []).append(call)
    if layers:
        first, *others = layers.values()
        if any(others_calls != first for others_calls in others):
            raise ValueError(f"the layers' calls differ: {[[c.name for c in seen] for seen in layers.values()]}")
        where = next(i for i, call in enumerate(shown) if call.per_layer)
        shown[where:where + 1] = first
    return shown
