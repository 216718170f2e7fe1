"""``dma``: every run of the plan in one ``cudaMemcpyBatchAsync`` call (CUDA >= 12.8), so the
copy engines (DMA) move the runs with no kernel and one driver call, as vLLM's
``swap_blocks_batch`` does since vLLM #38460. Bound through ctypes to the CUDA runtime torch
already loaded; it says why not where that runtime lacks the call."""

from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING

import torch

from kvlab.cache.allocation import KVCache
from kvlab.transfer.common import accelerator, device_of
from kvlab.transfer.registry import CopyMethod, register

if TYPE_CHECKING:
    from kvlab.transfer.engine import Transfer

_SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream: the source is read in stream order


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    """cudaMemcpyAttributes: one applies to every copy of the batch; hints left empty."""

    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation), ("dstLocHint", _MemLocation),
                ("flags", ctypes.c_uint)]


@functools.cache
def _runtime() -> tuple[ctypes.CDLL, int] | str:
    """(the CUDA runtime library, its version), or why there is none with the batch call."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    torch.cuda.init()  # loads the runtime torch was built with
    major = (torch.version.cuda or "0").split(".")[0]
    for name in (f"libcudart.so.{major}", "libcudart.so"):
        try:
            library = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        return f"no CUDA runtime library libcudart.so.{major} could be opened"
    version = ctypes.c_int()
    if library.cudaRuntimeGetVersion(ctypes.byref(version)) != 0:
        return "cudaRuntimeGetVersion failed"
    if version.value < 12080 or not hasattr(library, "cudaMemcpyBatchAsync"):
        return f"CUDA runtime {version.value // 1000}.{version.value % 1000 // 10} has no cudaMemcpyBatchAsync (needs 12.8)"
    return library, version.value


def unavailable(src: KVCache, dst: KVCache) -> str | None:
    if accelerator(src, dst) != "cuda":
        return f"cudaMemcpyBatchAsync drives a CUDA device's copy engines, not {accelerator(src, dst)}"
    if any(device_of(c).type == "cpu" and not c.storage[0].is_pinned() for c in (src, dst)):
        return "the copy engines read and write pinned host memory only (allocate the host side pinned)"
    runtime = _runtime()
    return runtime if isinstance(runtime, str) else None


def _descriptors(t: Transfer) -> tuple[list[ctypes.Array], list[torch.Tensor]]:
    """The batch call's destination, source and size arrays: int64 tensors seen as C arrays
    (returned with them, so the tensors stay alive as long as their arrays)."""
    src, dst, length = t.run_table()
    columns = [dst, src, length]
    arrays = [(kind * t.plan.segments).from_buffer(c.numpy()) for kind, c in
              zip((ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t), columns)]
    return arrays, columns


def copy_dma(t: Transfer) -> None:
    count = t.plan.segments
    if not count:
        return
    library, version = _runtime()
    (dsts, srcs, sizes), _ = t.prepared("dma", lambda: _descriptors(t))
    attributes = _MemcpyAttributes(_SRC_ACCESS_ORDER_STREAM)
    first = ctypes.c_size_t(0)  # the attributes apply from copy 0 on
    stream = ctypes.c_void_p(torch.cuda.current_stream(t.device).cuda_stream)  # the copy stream (Transfer.run)
    if version >= 13000:
        status = library.cudaMemcpyBatchAsync(dsts, srcs, sizes, ctypes.c_size_t(count), ctypes.byref(attributes),
                                              ctypes.byref(first), ctypes.c_size_t(1), stream)
    else:  # 12.8-12.9 also report the index of a failed copy
        failed = ctypes.c_size_t(count)
        status = library.cudaMemcpyBatchAsync(dsts, srcs, sizes, ctypes.c_size_t(count), ctypes.byref(attributes),
                                              ctypes.byref(first), ctypes.c_size_t(1), ctypes.byref(failed), stream)
    if status != 0:
        library.cudaGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"cudaMemcpyBatchAsync of {count} runs failed: {library.cudaGetErrorString(status).decode()}")


register(CopyMethod("dma", copy_dma, colour="#F0E442", unavailable=unavailable, rank=45, plan_runs=True))
