"""The copy plan: the byte runs a transfer copies, merged where both sides are contiguous.
Every copy method moves these runs; they differ only in how many operations they issue."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from kvlab.cache.allocation import KVCache, allocations
from kvlab.cache.geometry import ModelGeometry
from kvlab.cache.layouts import Layout, get_layout
from kvlab.cache.segments import merge_runs


@dataclass(frozen=True)
class PartView:
    """Where one (layer, part) of a cache lives: a [block, token, head, element] grid of
    element offsets into one backing tensor; the element axis is always contiguous."""

    tensor: int
    offset: int
    strides: tuple[int, int, int]  # block, token, head
    size: int  # elements of this part per head


def part_views(layout: str | Layout, geometry: ModelGeometry, num_blocks: int) -> list[list[PartView]]:
    """``[layer][part]`` -> PartView for every layer and part (K/V, or MLA latent/rope)."""
    layout = get_layout(layout)
    packed_mla = geometry.is_mla and layout.packs_parts and not layout.is_tuple
    out: list[list[PartView | None]] = [[None] * len(geometry.parts) for _ in range(geometry.num_layers)]
    for index, alloc in enumerate(allocations(layout, geometry, num_blocks)):
        stride = dict(zip(alloc.axes, alloc.strides))
        layers = [alloc.index["L"]] if "L" in alloc.index else range(geometry.num_layers)
        parts = [alloc.index["S"]] if "S" in alloc.index else range(len(geometry.parts))
        for layer in layers:
            for part in parts:
                offset = layer * stride.get("L", 0)
                if packed_mla:  # latent and rope side by side in one 576-wide vector
                    offset += sum(geometry.parts[:part])
                else:
                    offset += part * stride.get("S", 0) if "S" in stride else 0
                out[layer][part] = PartView(
                    index, offset, (stride["B"], stride["N"], stride["H"]), geometry.parts[part]
                )
    return out  # type: ignore[return-value]


@dataclass(frozen=True)
class HeadSlice:
    """The kv heads a copy moves between two tensor-parallel shards of one model's cache
    (each rank holds a range of the heads; a chunk stored at another tensor-parallel size
    holds another range): ``count`` heads from head ``src_start`` of the source into head
    ``dst_start`` of the destination."""

    src_start: int
    dst_start: int
    count: int

    def check(self, src: ModelGeometry, dst: ModelGeometry) -> None:
        """Raise unless the two caches are shards of one model's KV that hold these heads."""
        if replace(src, name="", num_kv_heads=1) != replace(dst, name="", num_kv_heads=1):
            raise ValueError(f"source and destination are not shards of one model's KV: "
                             f"{src.describe()} vs {dst.describe()}")
        if src.is_mla or src.quant is not None:
            raise ValueError("an MLA latent is the same on every rank and a quantized row packs its scales: "
                             "neither is copied by head")
        if self.count < 1 or min(self.src_start, self.dst_start) < 0 \
                or self.src_start + self.count > src.num_kv_heads or self.dst_start + self.count > dst.num_kv_heads:
            raise ValueError(f"heads {self.src_start}..{self.src_start + self.count - 1} of {src.num_kv_heads} "
                             f"into heads {self.dst_start}..{self.dst_start + self.count - 1} of "
                             f"{dst.num_kv_heads}: out of range")


@dataclass(frozen=True)
class CopyPlan:
    """The runs a transfer copies, merged where both sides are contiguous, in bytes.

    Columns are int64 tensors of equal length: source tensor index and byte offset,
    destination tensor index and byte offset, run length. The two-sided twin of
    kvlab.cache.segments.Segments (where one selection's bytes lie in one cache): both
    come out of merge_runs, but a copy's runs merge only where source and destination
    both continue, so its count is not the source's Segments count, and what each
    carries (addresses, the fused kernels' unit; a size histogram) is its own.
    """

    src_tensor: torch.Tensor
    src_offset: torch.Tensor
    dst_tensor: torch.Tensor
    dst_offset: torch.Tensor
    length: torch.Tensor

    @property
    def segments(self) -> int:
        return int(self.length.numel())

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    @functools.cached_property
    def lists(self) -> list[list[int]]:
        """The columns as Python lists (what a per-segment loop iterates)."""
        return [c.tolist() for c in (self.src_tensor, self.src_offset, self.dst_tensor, self.dst_offset, self.length)]

    def addresses(self, src: list[torch.Tensor], dst: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each run's raw source and destination address, given the backing tensors."""
        src_base = torch.tensor([x.data_ptr() for x in src], dtype=torch.int64)
        dst_base = torch.tensor([x.data_ptr() for x in dst], dtype=torch.int64)
        return src_base[self.src_tensor] + self.src_offset, dst_base[self.dst_tensor] + self.dst_offset

    @functools.cached_property
    def unit(self) -> int:
        """The largest byte count dividing every offset and length: the row of the
        fused kernels."""
        return math.gcd(*{int(x) for x in torch.cat([self.src_offset, self.dst_offset, self.length]).unique()} | {0})


def copy_plan(
    src: KVCache, src_blocks: Sequence[int], dst: KVCache, dst_blocks: Sequence[int], layers: Sequence[int] | None = None,
    heads: HeadSlice | None = None,
) -> CopyPlan:
    """Byte runs that copy blocks ``src_blocks`` of ``src`` to ``dst_blocks`` of ``dst`` (the
    ``heads`` of one tensor-parallel shard into another's; every head by default): one
    block's runs (:func:`_block_runs`, worked out once per pair of layouts and shapes) moved
    to each block pair, then merged across blocks."""
    src_t, src_o, dst_t, dst_o, length = block_runs(src, src_blocks, dst, dst_blocks, layers, heads)
    if not length.numel():
        return CopyPlan(src_t, src_o, dst_t, dst_o, length)
    ((src_t, src_o), (dst_t, dst_o)), merged = merge_runs([(src_t, src_o), (dst_t, dst_o)], length)
    return CopyPlan(src_t, src_o, dst_t, dst_o, merged)


Copy = tuple[KVCache, Sequence[int], KVCache, Sequence[int], Sequence[int] | None, HeadSlice | None]


def batch_run_addresses(copies: Sequence[Copy]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Source addresses, destination addresses and lengths of every (src, src_blocks, dst,
    dst_blocks, layers, heads) copy in order, each block's runs apart (not merged across
    blocks: a batch copy takes a few more runs for a plan that costs a few tensor
    operations), worked out together for copies that differ only in their buffers and
    destination blocks (a connector's load of several chunks of one shape): a few tensor
    operations for the batch, not a few per chunk."""
    groups: dict[tuple, list[int]] = {}
    for i, (src, src_blocks, dst, dst_blocks, layers, heads) in enumerate(copies):
        shape = (*_pair(src, dst, layers, heads), tuple(src_blocks), len(dst_blocks))
        groups.setdefault(shape, []).append(i)
    parts: list[tuple[torch.Tensor, ...]] = [()] * len(copies)
    for (*pair, src_blocks, _), members in groups.items():
        src_t, src_o, dst_t, dst_o, length = _moved_runs(tuple(pair), src_blocks, [copies[i][3] for i in members])
        src_base = torch.tensor([[x.data_ptr() for x in copies[i][0].storage] for i in members], dtype=torch.int64)
        dst_base = torch.tensor([[x.data_ptr() for x in copies[i][2].storage] for i in members], dtype=torch.int64)
        src_at, dst_at = src_base[:, src_t] + src_o[None, :], dst_base[:, dst_t] + dst_o
        for row, i in enumerate(members):
            parts[i] = (src_at[row], dst_at[row], length)
    if not copies:
        empty = torch.zeros(0, dtype=torch.int64)
        return empty, empty, empty
    return tuple(torch.cat(column) for column in zip(*parts))  # type: ignore[return-value]


def block_runs(src: KVCache, src_blocks: Sequence[int], dst: KVCache, dst_blocks: Sequence[int],
               layers: Sequence[int] | None = None, heads: HeadSlice | None = None) -> tuple[torch.Tensor, ...]:
    """The columns of :class:`CopyPlan` for every block pair, block 0's runs moved by each
    pair's block strides, not merged across blocks: a few tensor operations, no storage
    read (``src`` may be a meta-device cache that only describes a layout)."""
    src_t, src_o, dst_t, dst_o, length = _moved_runs(_pair(src, dst, layers, heads), tuple(src_blocks), [dst_blocks])
    return src_t, src_o, dst_t, dst_o[0], length


def _pair(src: KVCache, dst: KVCache, layers: Sequence[int] | None, heads: HeadSlice | None) -> tuple:
    """What decides one block's runs (:func:`_block_runs`' arguments): both layouts and
    shapes, the layers, the heads."""
    return (src.layout.name, src.num_blocks, dst.layout.name, dst.num_blocks, src.geometry,
            None if layers is None else tuple(layers), dst.geometry, heads)


def _moved_runs(pair: tuple, src_blocks: tuple[int, ...], dst_rows: list[Sequence[int]]) -> tuple[torch.Tensor, ...]:
    """Block 0's runs (:func:`_block_runs` of ``pair``) moved to each source block and, per
    row of ``dst_rows``, to its destination blocks: source tensors and offsets, destination
    tensors, destination offsets (one row per row given), lengths."""
    if any(len(row) != len(src_blocks) for row in dst_rows):
        raise ValueError(f"a copy moves each source block to one destination block: got source blocks "
                         f"{list(src_blocks)} for destination blocks {[list(row) for row in dst_rows]}")
    (src_t, src_o, dst_t, dst_o, length), (src_step, dst_step) = _block_runs(*pair)
    sb = torch.tensor(src_blocks, dtype=torch.int64)
    db = torch.tensor([list(row) for row in dst_rows], dtype=torch.int64).reshape(len(dst_rows), len(src_blocks))
    src_o = (src_o[None, :] + sb[:, None] * src_step[src_t][None, :]).flatten()
    dst_o = (dst_o[None, None, :] + db[:, :, None] * dst_step[dst_t][None, None, :]).flatten(1)
    blocks = len(src_blocks)
    return src_t.repeat(blocks), src_o, dst_t.repeat(blocks), dst_o, length.repeat(blocks)


@functools.lru_cache(maxsize=256)
def _block_runs(src_layout: str, src_num_blocks: int, dst_layout: str, dst_num_blocks: int, geometry: ModelGeometry,
                layers: tuple[int, ...] | None, dst_geometry: ModelGeometry, heads: HeadSlice | None
                ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, torch.Tensor]]:
    """The merged runs that copy block 0 of a source to block 0 of a destination (every
    head, or the ``heads`` of one shard into another's), and each backing tensor's block
    stride in bytes on either side: block b's runs are block 0's moved by b strides (a
    tensor's block stride is the same for all its layers and parts, so runs that merge in
    one block merge in every block)."""
    itemsize = geometry.itemsize
    src_views = part_views(src_layout, geometry, src_num_blocks)
    dst_views = part_views(dst_layout, dst_geometry, dst_num_blocks)
    heads = heads or HeadSlice(0, 0, geometry.num_kv_heads)
    steps = []
    for views in (src_views, dst_views):
        step: dict[int, int] = {}
        for row in views:
            for view in row:
                step[view.tensor] = view.strides[0] * itemsize
        steps.append(torch.tensor([step.get(i, 0) for i in range(max(step, default=-1) + 1)], dtype=torch.int64))
    tokens = torch.arange(geometry.block_size)
    moved = torch.arange(heads.count)
    columns: list[list[torch.Tensor]] = [[], [], [], [], []]
    for layer in range(geometry.num_layers) if layers is None else layers:
        for s, d in zip(src_views[layer], dst_views[layer]):
            grid = []
            for view, start in ((s, heads.src_start), (d, heads.dst_start)):
                _, n, h = view.strides
                grid.append((view.offset + tokens[:, None] * n + (start + moved[None, :]) * h).flatten() * itemsize)
            count = grid[0].numel()
            columns[0].append(torch.full((count,), s.tensor))
            columns[1].append(grid[0])
            columns[2].append(torch.full((count,), d.tensor))
            columns[3].append(grid[1])
            columns[4].append(torch.full((count,), s.size * itemsize))
    if not columns[0]:
        empty = torch.zeros(0, dtype=torch.int64)
        return (empty,) * 5, (steps[0], steps[1])
    src_t, src_o, dst_t, dst_o, length = (torch.cat(c) for c in columns)
    ((src_t, src_o), (dst_t, dst_o)), merged = merge_runs([(src_t, src_o), (dst_t, dst_o)], length)
    return (src_t, src_o, dst_t, dst_o, merged), (steps[0], steps[1])
