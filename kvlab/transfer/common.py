"""What the copy engine and the copy methods share: the device of a cache, whether two
caches share memory, integer views that keep copies bitwise, and CPU copy threads."""

from __future__ import annotations

import contextvars
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch

from kvlab.cache.allocation import KVCache

SPLIT_BYTES = 8 << 20  # an indexed copy at least this big is split over the CPU's threads
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def device_of(cache: KVCache) -> torch.device:
    return cache.storage[0].device


def shared_memory(a: KVCache, b: KVCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pairs of backing tensors, one of ``a`` and one of ``b``, in one allocation (the same
    cache, or caches cut from one buffer): there a copy may read what it writes."""
    if device_of(a) != device_of(b) or device_of(a).type == "meta":
        return []

    spans = sorted(((m.data_ptr(), m.data_ptr() + m.nbytes(), side, x)
                    for side, cache in enumerate((a, b)) for x in cache.storage for m in [x.untyped_storage()]),
                   key=lambda span: span[0])
    pairs, open_spans = [], []
    for start, end, side, x in spans:  # a sweep by address: O(n log n) for caches of many tensors
        open_spans = [span for span in open_spans if span[1] > start]
        pairs += [(x, y) if side == 0 else (y, x) for _, _, other, y in open_spans if other != side]
        open_spans.append((start, end, side, x))
    return pairs


@functools.cache
def copy_stream(device: torch.device):
    """The dedicated copy stream of an accelerator (one per device, made on first use)."""
    return getattr(torch, device.type).Stream(device)


@functools.cache
def _cpu_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max(1, torch.get_num_threads()), thread_name_prefix="kvlab-copy")


def run_spread(jobs: list[Callable[[], None]], device: torch.device) -> None:
    """Run copy jobs; on the CPU spread them over torch's thread count (ops release the GIL)."""
    workers = torch.get_num_threads()
    if device.type != "cpu" or workers < 2 or len(jobs) < 2:
        for job in jobs:
            job()
        return
    shares = [jobs[i::workers] for i in range(workers)]
    for future in [_cpu_pool().submit(in_callers_mode(lambda s=s: [job() for job in s])) for s in shares]:
        future.result()


def in_callers_mode(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` for another thread, under the caller's inference mode (an engine's KV cache,
    made under torch.inference_mode, may only be written in that mode) and in a copy of the
    caller's context variables (a trace or recorder active in the caller sees the copy)."""
    inference = torch.is_inference_mode_enabled()
    context = contextvars.copy_context()

    def run() -> Any:
        with torch.inference_mode(inference):
            return context.copy().run(fn)

    return run


def widest_width(byte_counts: Sequence[int]) -> int:
    """The widest integer width (8, 4, 2 or 1 bytes) dividing every byte count."""
    return next(w for w in (8, 4, 2, 1) if all(n % w == 0 for n in byte_counts))


def widest_int_views(*views: torch.Tensor) -> list[torch.Tensor]:
    """The views reinterpreted as the widest integer type all of them allow (their last
    dim contiguous): copies stay bitwise, fp8 gets kernels it lacks, and CPU indexed
    copies run 2-3x faster on int32/int64 than on 16-bit types."""
    item = views[0].element_size()
    width = widest_width([n * item for x in views for n in (x.shape[-1], x.storage_offset(), *x.stride()[:-1])])
    return [x.view(INT_VIEW[item]).view(INT_VIEW[width]) for x in views]


def flat(storage: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each backing tensor as a flat tensor of same-width integers: copies stay bitwise."""
    return [t.view(-1).view(INT_VIEW[t.element_size()]) for t in storage]


def accelerator(src: KVCache, dst: KVCache) -> str:
    """The device type a copy between ``src`` and ``dst`` runs on ("cpu" when both are hosts)."""
    return next((d for d in (device_of(src).type, device_of(dst).type) if d != "cpu"), "cpu")
