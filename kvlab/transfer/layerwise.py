"""Layerwise loading: a request's blocks loaded one layer at a time, so layer i can be used
while later layers are still on their way (what a layerwise connector's
``wait_for_layer_load`` waits on)."""

from __future__ import annotations

import threading
import time
from typing import Sequence

from kvlab.cache.allocation import KVCache
from kvlab.transfer.common import in_callers_mode
from kvlab.transfer.engine import Transfer
from kvlab.transfer.plan import HeadSlice

Source = tuple[KVCache, Sequence[int], Sequence[int], HeadSlice | None]  # buffer, its blocks, cache blocks, heads


class LayerwiseLoad:
    """Load a request's blocks one layer at a time, so layer i can be used while later
    layers are still on their way (what a layerwise connector's wait_for_layer_load
    waits on).

    ``start()`` issues every layer's copy in order: on an accelerator on the copy stream,
    one event per layer; on the CPU in a background thread. ``wait(i)`` returns once
    layer ``i`` is in place (on an accelerator it makes the compute stream wait instead
    of blocking the host).
    """

    def __init__(self, buffer: KVCache, cache: KVCache, block_ids: Sequence[int],
                 buffer_blocks: Sequence[int] | None = None, method: str = "gather") -> None:
        buffer_blocks = list(range(len(block_ids))) if buffer_blocks is None else buffer_blocks
        self._setup(cache, [(buffer, buffer_blocks, block_ids, None)], method)

    @classmethod
    def from_sources(cls, cache: KVCache, sources: Sequence[Source], method: str = "gather") -> LayerwiseLoad:
        """One layerwise load from several buffers, each given as (buffer, buffer blocks,
        cache blocks, heads: None, or the heads of a shard another tensor-parallel size
        stored): layer i of every source lands before layer i + 1 of any."""
        load = cls.__new__(cls)
        load._setup(cache, sources, method)
        return load

    def _setup(self, cache: KVCache, sources: Sequence[Source], method: str) -> None:
        self.transfers = [
            [Transfer(buffer, list(buffer_blocks), cache, list(block_ids), method, layers=[i], blocking=False,
                      heads=heads)
             for buffer, buffer_blocks, block_ids, heads in sources]
            for i in range(cache.geometry.num_layers)
        ]
        self._done = [threading.Event() for _ in self.transfers]
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.work_seconds = 0.0  # issuing (on a CPU: doing) every copy
        # per layer, when its copies began and ended (time.perf_counter; on an accelerator: were issued)
        self.layer_spans: list[tuple[float, float] | None] = [None] * len(self.transfers)

    def start(self) -> LayerwiseLoad:
        for done in self._done:
            done.clear()

        def issue() -> None:
            start = time.perf_counter()
            try:
                for i, (layer, done) in enumerate(zip(self.transfers, self._done)):
                    began = time.perf_counter()
                    for transfer in layer:
                        transfer.run()
                    ended = time.perf_counter()
                    self.layer_spans[i] = (began, ended)
                    self.work_seconds = ended - start
                    done.set()
            except BaseException as error:  # surfaced by wait()
                self._error = error
                for done in self._done:
                    done.set()

        if self.transfers[0][0].device.type != "cpu":  # queued on the copy stream: returns at once
            issue()
        else:
            # not a daemon: a program that ends mid-load waits for it (a daemon killed inside a
            # torch copy at exit aborts the interpreter: "terminate called without an active exception")
            self._thread = threading.Thread(target=in_callers_mode(issue), name="kvlab-layerwise")
            self._thread.start()
        return self

    def wait(self, layer: int) -> None:
        self._done[layer].wait()
        if self._error is not None:
            raise RuntimeError("layerwise load failed") from self._error
        for transfer in self.transfers[layer]:
            transfer.stream_wait()

    def finish(self) -> None:
        """Wait for every layer, on the host."""
        for i, layer in enumerate(self.transfers):
            self.wait(i)
            for transfer in layer:
                transfer.wait()
        if self._thread is not None:
            self._thread.join()
