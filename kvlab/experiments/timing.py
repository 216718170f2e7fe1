"""Timing shared by the transfer sweep and the layerwise experiments: a clock for one call
(events on an accelerator's copy stream, the wall clock on the CPU), several calls timed
in turn, and the positive-integer checks their arguments go through."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch

from kvlab.cache.devices import synchronize
from kvlab.transfer.common import copy_stream


class Clock:
    """Seconds one call takes: events on the copy stream of an accelerator (what a copy
    costs on the device), the wall clock on the CPU. ``whole_device`` times everything
    queued on the device (several streams) between two synchronisations instead."""

    def __init__(self, device: torch.device, whole_device: bool = False) -> None:
        self.device = device
        self.whole_device = whole_device

    def __call__(self, fn: Callable[[], Any]) -> float:
        if self.device.type == "cpu" or self.whole_device:
            synchronize(self.device)
            start = time.perf_counter()
            fn()
            synchronize(self.device)
            return time.perf_counter() - start
        module = getattr(torch, self.device.type)
        stream = copy_stream(self.device)
        synchronize(self.device)
        begin, end = module.Event(enable_timing=True), module.Event(enable_timing=True)
        begin.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        return begin.elapsed_time(end) / 1e3


def interleaved(fns: Sequence[Callable[[], Any]], clock: Callable[[Callable[[], Any]], float], repeats: int,
                warmup: int = 2) -> list[list[float]]:
    """Seconds of each of ``fns`` (a transfer and its ceilings), taken in turn within each
    repeat so all see the same machine state."""
    for _ in range(warmup):
        for fn in fns:
            clock(fn)
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            out.append(clock(fn))
    return times


def repeated(fn: Callable[[], Any], repeats: int, reset: Callable[[], Any] | None = None) -> list[float]:
    """Wall-clock seconds of each of ``repeats`` calls of ``fn``, ``reset`` (untimed) before
    each: the samples a row keeps beside its median, so a reading can state the spread."""
    check_positive_int("repeats", repeats)
    times = []
    for _ in range(repeats):
        if reset is not None:
            reset()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def check_positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_pace_sizes(total_bytes: int, object_bytes: Sequence[int], repeats: int) -> None:
    """ValueError unless a pace sweep's sizes and repeats are positive integers."""
    check_positive_int("total_bytes", total_bytes)
    check_positive_int("repeats", repeats)
    if not object_bytes:
        raise ValueError("object_bytes must name at least one object size")
    for size in object_bytes:
        check_positive_int("each of object_bytes", size)
