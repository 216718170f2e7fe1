"""``gather``: batched indexed copies on integer views of the bytes: index_select per layer
into a buffer, index_copy_ over the block axis of each backing tensor back into a cache
(for a cross-layer layout, one op moves whole blocks of every layer)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from kvlab.cache.allocation import KVCache
from kvlab.transfer.common import SPLIT_BYTES, device_of, run_spread, widest_int_views
from kvlab.transfer.registry import CopyMethod, register
from kvlab.transfer.views import index_pairs, staged

if TYPE_CHECKING:
    from kvlab.transfer.engine import Transfer


def copy_gather(t: Transfer) -> None:
    def kernel(src: KVCache, dst: KVCache) -> None:
        device = device_of(src)
        sb = torch.as_tensor(t.src_blocks, dtype=torch.int64, device=device)
        db = torch.as_tensor(t.dst_blocks, dtype=torch.int64, device=device)
        # the packed fast paths hand torch a source and a destination view of one tensor when
        # blocks move inside one memory, which it refuses: there the index_select makes a copy
        packed = not t.one_memory and t.dst_blocks == list(range(t.dst_blocks[0], t.dst_blocks[0] + len(t.dst_blocks)))
        loaded = not t.one_memory and t.src_blocks == list(range(t.src_blocks[0], t.src_blocks[0] + len(t.src_blocks)))
        jobs = []
        pairs = t.prepared("gather", lambda: [(*widest_int_views(s, d), dim)
                                              for s, d, dim in index_pairs(t, src, dst, bool(packed))], src, dst)
        # fewer pairs than CPU workers (a cross-layer cache is one pair): split the blocks,
        # when the copy is big enough to pay for handing work to another thread
        pieces = 1
        if device.type == "cpu" and t.nbytes >= SPLIT_BYTES and all(d.shape[0] == 1 for _, d, _ in pairs):
            pieces = max(1, -(-torch.get_num_threads() // len(pairs)))
        step = -(-len(sb) // pieces)
        for s, d, dim in pairs:
            for lo in range(0, len(sb), step):
                hi = min(lo + step, len(sb))
                if packed and dim == 1 and d.shape[0] == 1:  # gather straight into a packed destination
                    first = t.dst_blocks[0]
                    jobs.append(functools.partial(torch.index_select, s[0], 0, sb[lo:hi], out=d[0, first + lo:first + hi]))
                elif loaded:  # scatter from a packed source
                    first = t.src_blocks[0]
                    jobs.append(functools.partial(d.index_copy_, dim, db[lo:hi], s.narrow(dim, first + lo, hi - lo)))
                else:
                    jobs.append(lambda s=s, d=d, dim=dim, i=sb[lo:hi], j=db[lo:hi]: d.index_copy_(dim, j, s.index_select(dim, i)))
        run_spread(jobs, device)

    if t.src_blocks:
        staged(t, kernel)


# method="auto" falls back to it: it runs everywhere, devices too
register(CopyMethod("gather", copy_gather, colour="#0072B2", rank=20, preference=20))
