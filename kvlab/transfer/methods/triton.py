"""``triton``: kvlab's own Triton kernel over the plan's run table (kvlab.transfer.kernels),
on CUDA, or on the CPU under ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

from kvlab.cache.allocation import KVCache
from kvlab.transfer.common import accelerator
from kvlab.transfer.registry import CopyMethod, register

if TYPE_CHECKING:
    from kvlab.transfer.engine import Transfer


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def copy_triton(t: Transfer) -> None:
    from kvlab.transfer.kernels import copy_runs  # imports triton

    if t.plan.segments:
        copy_runs(*t.plan.addresses(t.src.storage, t.dst.storage), t.plan.length, t.device)


def unavailable(src: KVCache, dst: KVCache) -> str | None:
    where = accelerator(src, dst)
    if where == "cuda" or (where == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        return None if _triton_importable() else "triton is not installed"
    return f"triton kernels need a CUDA device (or TRITON_INTERPRET=1 on the CPU), not {where}"


register(CopyMethod("triton", copy_triton, colour="#56B4E9", unavailable=unavailable, rank=40, plan_runs=True))
