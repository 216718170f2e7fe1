"""``memcpy``: every run of the plan in one call into kvlab's C batch copy
(``kvlab/transfer/native/copy_runs.c``), which splits the bytes evenly over the CPU's copy
threads: no per-run Python, no indexed kernel, the GIL released throughout. Host memory
only; the C file is compiled on first use with the machine's C compiler and cached."""

from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING

import torch

from kvlab.cache.allocation import KVCache
from kvlab.cache.devices import last_level_cache_bytes
from kvlab.transfer import native
from kvlab.transfer.common import accelerator
from kvlab.transfer.plan import batch_run_addresses
from kvlab.transfer.registry import CopyMethod, register

if TYPE_CHECKING:
    from kvlab.transfer.engine import Transfer


@functools.cache
def native_library() -> ctypes.CDLL | str:
    """The compiled batch copy, or why there is none (no C compiler, a failed build)."""
    library = native.library("copy_runs", "batch copy")
    if not isinstance(library, str):
        library.kvlab_copy_runs.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int, ctypes.c_int64]
        library.kvlab_copy_runs.restype = ctypes.c_int
    return library


def copy_addresses(src: torch.Tensor, dst: torch.Tensor, length: torch.Tensor, threads: int | None = None,
                   streaming: bool | None = None) -> None:
    """Copy ``length[i]`` bytes from host address ``src[i]`` to ``dst[i]`` (contiguous int64
    tensors) for every i, in one call on ``threads`` threads (torch's count by default);
    with streaming stores (``streaming``) by default where the bytes outgrow the last-level
    cache: they could not stay cached, and a plain store reads each line before it writes it."""
    streaming_from = last_level_cache_bytes() if streaming is None else int(bool(streaming))
    status = native_library().kvlab_copy_runs(src.data_ptr(), dst.data_ptr(), length.data_ptr(), length.numel(),
                                              threads or torch.get_num_threads(), streaming_from)
    if status:
        raise RuntimeError("kvlab's batch copy could not start its threads (the copy finished on one)")


def copy_memcpy(t: Transfer) -> None:
    if not t.plan.segments:
        return
    copy_addresses(*t.prepared("memcpy", t.run_table))


def copy_many(transfers: list[Transfer], workers: int) -> None:
    """Every run of every transfer in one call, each planned block by block without merging
    (a connector's load: each chunk is planned once and copied once): no thread started per
    chunk, no plan merged that is used once."""
    src, dst, length = batch_run_addresses([(t.src, t.src_blocks, t.dst, t.dst_blocks, t.layers, t.heads)
                                             for t in transfers])
    if length.numel():
        copy_addresses(src, dst, length, threads=max(workers, torch.get_num_threads()))


def unavailable(src: KVCache, dst: KVCache) -> str | None:
    if accelerator(src, dst) != "cpu":
        return f"kvlab's batch copy moves host memory; a {accelerator(src, dst)} device has its own copy engines"
    library = native_library()
    return library if isinstance(library, str) else None


# method="auto" tries it first: one C call per transfer moves batched runs at the memory's pace
# (0.89-1.01 of the copy ceiling in notebook 02 on this project's CPUs), host memory only
register(CopyMethod("memcpy", copy_memcpy, colour="#CC79A7", unavailable=unavailable, rank=15, run_many=copy_many,
                    preference=10, plan_runs=True))
