"""``vllm`` (a peer): vLLM's ``swap_blocks_batch`` over the plan's runs, between a CUDA
device and host memory (vLLM's CPU build ships no such kernel). Imports vLLM only when
asked for."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvlab.cache.allocation import KVCache
from kvlab.transfer.common import accelerator
from kvlab.transfer.registry import CopyMethod, register

if TYPE_CHECKING:
    from kvlab.transfer.engine import Transfer


def unavailable(src: KVCache, dst: KVCache) -> str | None:
    try:
        import vllm._custom_ops  # noqa: F401
    except Exception as error:
        return f"vLLM is not importable here ({type(error).__name__}: {error})"
    if not hasattr(torch.ops._C_cache_ops, "swap_blocks_batch"):
        return "this vLLM build has no swap_blocks_batch kernel (vLLM's CPU build ships none)"
    if accelerator(src, dst) != "cuda":
        return "vLLM's swap_blocks_batch copies between a CUDA device and host memory"
    return None


def copy_vllm(t: Transfer) -> None:
    from vllm import _custom_ops as ops

    ops.swap_blocks_batch(*t.plan.addresses(t.src.storage, t.dst.storage), t.plan.length.clone())


register(CopyMethod("vllm", copy_vllm, colour="#000000", unavailable=unavailable, peer=True, rank=60,
                    plan_runs=True))
