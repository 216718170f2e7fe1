"""kvlab's own Triton copy kernel: every run of a copy plan in one launch.

Each run is (source address, destination address, length in bytes). Addresses are raw
pointers, so one launch covers runs in any number of tensors, and a CUDA kernel can read
or write pinned host memory directly (unified addressing). With ``TRITON_INTERPRET=1``
the same kernel runs on the CPU, which is how the tests exercise it without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_WIDTH_TYPES = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}


@triton.jit
def _copy_runs_kernel(src_ptrs, dst_ptrs, lengths, ELEMENT: tl.constexpr, TILE: tl.constexpr):
    run = tl.program_id(0)
    share = tl.program_id(1)
    shares = tl.num_programs(1)
    src = tl.load(src_ptrs + run).to(tl.pointer_type(ELEMENT))
    dst = tl.load(dst_ptrs + run).to(tl.pointer_type(ELEMENT))
    count = tl.load(lengths + run)
    for start in range(share * TILE, count, shares * TILE):
        index = start + tl.arange(0, TILE)
        mask = index < count
        tl.store(dst + index, tl.load(src + index, mask=mask), mask=mask)


def copy_runs(src: torch.Tensor, dst: torch.Tensor, lengths: torch.Tensor, device: torch.device) -> None:
    """Copy ``lengths[i]`` bytes from address ``src[i]`` to ``dst[i]`` for every i, in one launch
    (on the current stream of ``device``)."""
    if not lengths.numel():
        return
    # The widest element that divides every address and length: 8-byte moves where possible.
    width = next(w for w in (8, 4, 2, 1) if not bool(((src | dst | lengths) % w).any()))
    interpreted = device.type == "cpu"
    tile = 4096 if interpreted else 1024
    longest = int(lengths.max()) // width
    # Enough programs per run to fill the device, but never more than a run has tiles.
    shares = 1 if interpreted else max(1, min(triton.cdiv(longest, tile), triton.cdiv(1024, lengths.numel())))
    _copy_runs_kernel[(lengths.numel(), shares)](
        src.to(device), dst.to(device), (lengths // width).to(device), ELEMENT=_WIDTH_TYPES[width], TILE=tile
    )
