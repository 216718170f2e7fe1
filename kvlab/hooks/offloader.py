"""A torch-only layerwise connector for the tiny attention stack: loads go through
kvlab.transfer.LayerwiseLoad, saves are one-layer Transfers, on a CPU, a GPU or an NPU."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from kvlab.cache.allocation import KVCache, layer_name
from kvlab.hooks.trace import active_trace
from kvlab.transfer.engine import Transfer, host_buffer
from kvlab.transfer.layerwise import LayerwiseLoad


@dataclass(frozen=True)
class OffloadPlan:
    """The connector metadata of one forward pass: cache blocks to load from the host
    buffer before their layer's attention, and cache blocks to save after it."""

    load_blocks: Sequence[int] = ()
    load_from: Sequence[int] | None = None  # buffer blocks; default 0, 1, ...
    save_blocks: Sequence[int] = ()
    save_to: Sequence[int] | None = None  # buffer blocks; default 0, 1, ...


class LayerwiseOffloader:
    """A minimal layerwise connector between a kvlab cache and a host buffer, with the
    worker-side method names of vLLM's v1 connectors, so the hooks drive it as vLLM would
    drive one. Every copy goes through kvlab.transfer: loads as a
    :class:`~kvlab.transfer.LayerwiseLoad`, saves as one-layer :class:`~kvlab.transfer.Transfer`\\ s.
    """

    def __init__(self, cache: KVCache, num_buffer_blocks: int, method: str = "gather") -> None:
        self.cache = cache
        self.buffer = host_buffer(cache, num_buffer_blocks)
        self.method = method
        self._layer_index = {layer_name(i): i for i in range(cache.geometry.num_layers)}
        self._plan: OffloadPlan | None = None
        self._load: LayerwiseLoad | None = None
        self._saves: list[Transfer] = []

    def bind_connector_metadata(self, plan: OffloadPlan) -> None:
        self._plan = plan

    def has_connector_metadata(self) -> bool:
        return self._plan is not None

    def clear_connector_metadata(self) -> None:
        self._plan = None

    def start_load_kv(self) -> None:
        """Issue every layer's load, in layer order, without waiting for any."""
        plan = self._plan
        if plan is not None and plan.load_blocks:
            self._load = LayerwiseLoad(self.buffer, self.cache, plan.load_blocks, plan.load_from, self.method).start()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._load is not None:
            self._load.wait(self._layer_index[layer_name])

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        """Issue the copy of this layer's planned blocks to the buffer (asynchronous on an
        accelerator, where it waits for the attention that wrote them)."""
        plan = self._plan
        if plan is not None and plan.save_blocks:
            transfer = Transfer(self.cache, plan.save_blocks, self.buffer, plan.save_to, self.method,
                                layers=[self._layer_index[layer_name]], blocking=False)
            self._saves.append(transfer.run())

    def wait_for_save(self) -> None:
        """Block until every issued save and load is done (the end of a forward pass)."""
        for transfer in self._saves:
            transfer.wait()
        self._saves.clear()
        if self._load is not None:
            self._load.finish()
            trace = active_trace()
            for i, span in enumerate(self._load.layer_spans if trace is not None else ()):
                trace.record_span(layer_name(i), "load", *span)
            self._load = None

    @contextlib.contextmanager
    def step(self, plan: OffloadPlan) -> Iterator[LayerwiseOffloader]:
        """One forward pass under ``plan``: bind it and start loading; afterwards wait for
        the copies and unbind it."""
        self.bind_connector_metadata(plan)
        try:
            self.start_load_kv()
            yield self
        finally:
            self.wait_for_save()
            self.clear_connector_metadata()
