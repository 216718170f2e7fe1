"""``segments``: one copy per contiguous run of bytes, what a simple connector does; its
cost grows with the number of runs a layout cuts a transfer into."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvlab.transfer.common import flat
from kvlab.transfer.registry import CopyMethod, register

if TYPE_CHECKING:
    from kvlab.transfer.engine import Transfer


def copy_segments(t: Transfer) -> None:
    src, dst = flat(t.src.storage), flat(t.dst.storage)
    itemsize = src[0].element_size()
    non_blocking = t.device.type != "cpu"
    for st, so, dt, do, n in zip(*t.plan.lists):
        so, do, n = so // itemsize, do // itemsize, n // itemsize
        dst[dt][do:do + n].copy_(src[st][so:so + n], non_blocking=non_blocking)


register(CopyMethod("segments", copy_segments, colour="#D55E00", rank=10, plan_runs=True))
