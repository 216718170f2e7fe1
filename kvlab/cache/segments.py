"""Segment arithmetic: which contiguous byte runs moving some blocks or tokens touches.

A copy engine that issues one copy per contiguous run pays a fixed cost per run, so the
number of runs (and their size) is what separates a cheap layout from an expensive one.
Runs of one backing tensor that touch are merged; separate tensors never merge.
"""

from __future__ import annotations

import operator
import random
from collections import Counter
from dataclasses import dataclass
from math import prod
from typing import Any, Sequence

import torch

from kvlab.cache.allocation import allocations, axis_sizes, check_num_blocks, view_parts
from kvlab.cache.geometry import ModelGeometry
from kvlab.cache.layouts import Layout, get_layout

# The arithmetic lists every run before merging and builds block tables in Python: these
# bounds keep one call within seconds (on a 2-core CPU about 7 s at either bound).
MAX_RUNS = 1 << 24
MAX_TABLE_BLOCKS = 1 << 20


@dataclass(frozen=True)
class Segments:
    """Contiguous byte runs, each as (backing tensor index, byte offset in it, length)."""

    tensor: torch.Tensor
    start: torch.Tensor
    length: torch.Tensor

    @property
    def count(self) -> int:
        return int(self.length.numel())

    @property
    def total_bytes(self) -> int:
        return int(self.length.sum())

    @property
    def size_counts(self) -> dict[int, int]:
        """Segment size in bytes -> how many segments have it, largest first."""
        counts = Counter(self.length.tolist())
        return dict(sorted(counts.items(), reverse=True))

    def summary(self) -> dict[str, Any]:
        return {
            "segments": self.count,
            "bytes": self.total_bytes,
            "segment_sizes": self.size_counts,
            "mean_segment_bytes": self.total_bytes / self.count if self.count else 0,
        }


def check_block_ids(block_ids: Sequence[int], num_blocks: int) -> list[int]:
    """Block ids as a list of ints, refusing non-integers, out-of-range and duplicated ids."""
    try:
        ids = [operator.index(b) for b in block_ids]
    except TypeError:
        raise ValueError(f"block ids must be integers, got {list(block_ids)[:8]}") from None
    bad = [b for b in ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"block ids {bad[:8]} out of range: the cache has blocks 0..{num_blocks - 1}")
    dup = sorted(b for b, c in Counter(ids).items() if c > 1)
    if dup:
        raise ValueError(f"block ids {dup[:8]} appear more than once; each block moves once")
    return ids


def scattered_block_ids(count: int, num_blocks: int, seed: int = 0) -> list[int]:
    """``count`` block ids, no two adjacent, in a seeded random order: the worst case."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if 2 * count - 1 > num_blocks:
        raise ValueError(f"{count} non-adjacent blocks need at least {2 * count - 1} blocks, got {num_blocks}")
    rng = random.Random(seed)
    picks = sorted(rng.sample(range(num_blocks - count + 1), count))
    ids = [p + i for i, p in enumerate(picks)]
    rng.shuffle(ids)
    return ids


def contiguous_block_ids(count: int, start: int = 0) -> list[int]:
    """``count`` consecutive block ids: the best case."""
    return list(range(start, start + count))


def token_spans(block_table: Sequence[int], start: int, end: int, block_size: int) -> list[tuple[int, int, int]]:
    """(block id, first token, end token) inside each block for tokens [start, end)."""
    if not 0 <= start < end:
        raise ValueError(f"token range [{start}, {end}) is empty or negative")
    if end > len(block_table) * block_size:
        raise ValueError(
            f"token range [{start}, {end}) needs {-(-end // block_size)} blocks, "
            f"the block table has {len(block_table)}"
        )
    spans = []
    for index in range(start // block_size, -(-end // block_size)):
        first = max(start - index * block_size, 0)
        last = min(end - index * block_size, block_size)
        spans.append((int(block_table[index]), first, last))
    return spans


def span_segments(
    layout: str | Layout,
    geometry: ModelGeometry,
    num_blocks: int,
    spans: Sequence[tuple[int, int, int]],
) -> Segments:
    """Merged byte runs that the tokens ``spans`` (block id, first, end) touch in every layer."""
    layout = get_layout(layout)
    check_block_ids([b for b, _, _ in spans], num_blocks)
    bad = [s for s in spans if not 0 <= s[1] < s[2] <= geometry.block_size]
    if bad:
        raise ValueError(
            f"token spans {bad[:4]} are not (block, first, end) with 0 <= first < end <= "
            f"block size {geometry.block_size}"
        )
    # Whole blocks are selected by the block axis alone (far fewer runs to enumerate);
    # partial blocks need the token axis too.
    whole = [b for b, s, e in spans if (s, e) == (0, geometry.block_size)]
    partial = [(b, s, e) for b, s, e in spans if (s, e) != (0, geometry.block_size)]
    if partial and layout.scales == "regions":
        raise ValueError(
            f"{layout.name} moves whole blocks only: a token's NVFP4 values and scales sit in separate regions "
            f"of the page, and FlashInfer interleaves V's scales across 4 tokens (its #3042); got partial blocks "
            f"{partial[:4]}"
        )
    _check_runs(layout, geometry, len(whole), sum(e - s for _, s, e in partial))
    picks = []
    if whole:
        picks.append(("B", torch.tensor(whole, dtype=torch.int64), torch.zeros(len(whole), dtype=torch.int64)))
    if partial:
        picks.append(("BN", torch.cat([torch.full((e - s,), b, dtype=torch.int64) for b, s, e in partial]),
                      torch.cat([torch.arange(s, e, dtype=torch.int64) for _, s, e in partial])))
    itemsize = geometry.itemsize
    tensors, starts, lengths = [], [], []
    for index, alloc in enumerate(allocations(layout, geometry, num_blocks)):
        axes, strides = alloc.axes, alloc.strides
        run_starts, run_lengths = [torch.zeros(0, dtype=torch.int64)], [torch.zeros(0, dtype=torch.int64)]
        for selected, blocks, tokens in picks:
            inner = max(axes.index(a) for a in selected)
            offsets = torch.zeros(1, dtype=torch.int64)
            for axis, size, stride in zip(axes[: inner + 1], alloc.sizes, strides):
                if axis not in selected:
                    offsets = (offsets[:, None] + torch.arange(size) * stride).flatten()
            picked = blocks * strides[axes.index("B")] + tokens * strides[axes.index("N")]
            run_starts.append((offsets[:, None] + picked[None, :]).flatten() * itemsize)
            run_lengths.append(torch.full_like(run_starts[-1], prod(alloc.sizes[inner + 1:]) * itemsize))
        run_starts = torch.cat(run_starts)
        tensors.append(torch.full_like(run_starts, index))
        starts.append(run_starts)
        lengths.append(torch.cat(run_lengths))
    ((tensor, start),), length = merge_runs([(torch.cat(tensors), torch.cat(starts))], torch.cat(lengths))
    return Segments(tensor, start, length)


def _check_runs(layout: Layout, geometry: ModelGeometry, whole_blocks: int, partial_tokens: int) -> None:
    """Refuse what would list more than MAX_RUNS runs: per backing tensor, one for each
    whole block and each token of a partial block times every combination of the axes
    outside them; counted without listing the tensors (a layer count can be absurd)."""
    sizes = axis_sizes(layout, geometry, 1)
    kept = [a for a in layout.order if a not in layout.split]

    def outside(axis: str) -> int:
        return prod(sizes[a] for a in kept[:kept.index(axis)] if a != "B")

    runs = prod(sizes[a] for a in layout.split) * (outside("B") * whole_blocks + outside("N") * partial_tokens)
    if runs > MAX_RUNS:
        raise ValueError(
            f"{layout.name} cuts {whole_blocks:,} whole blocks and {partial_tokens:,} more tokens of {geometry.name} "
            f"({geometry.num_layers:,} layers, {geometry.num_kv_heads:,} kv heads) into {runs:,} runs before merging, "
            f"more than the segment arithmetic lists ({MAX_RUNS:,}): ask for fewer tokens"
        )


def merge_runs(sides: Sequence[tuple[torch.Tensor, torch.Tensor]], length: torch.Tensor
               ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """The one segment model: byte runs given as (tensor index, byte offset) on each side
    (one side: the runs a selection touches; two: a copy's source and destination), merged
    where a run continues the one before it on every side. Returns the merged runs' sides
    and lengths, ordered by the first side. Every segment count in kvlab comes from here:
    the CLI and atlas (span_segments), transfers' copy plans and the connector's stats."""
    if length.numel() == 0:
        return [(t, o) for t, o in sides], length
    first_tensor, first_offset = sides[0]
    order = torch.sort(first_offset, stable=True).indices
    order = order[torch.sort(first_tensor[order], stable=True).indices]
    sides = [(t[order], o[order]) for t, o in sides]
    length = length[order]
    new = torch.ones_like(length, dtype=torch.bool)
    same = torch.ones_like(length[1:], dtype=torch.bool)
    for tensor, offset in sides:
        same &= (tensor[1:] == tensor[:-1]) & (offset[1:] == offset[:-1] + length[:-1])
    new[1:] = ~same
    run = torch.cumsum(new.to(torch.int64), 0) - 1
    merged = torch.zeros(int(run[-1]) + 1, dtype=torch.int64).index_add_(0, run, length)
    return [(t[new], o[new]) for t, o in sides], merged


def block_segments(layout: str | Layout, geometry: ModelGeometry, num_blocks: int, block_ids: Sequence[int]) -> Segments:
    """Merged byte runs that moving whole blocks ``block_ids`` (all layers) touches."""
    bs = geometry.block_size
    return span_segments(layout, geometry, num_blocks, [(b, 0, bs) for b in block_ids])


def token_segments(
    layout: str | Layout,
    geometry: ModelGeometry,
    num_blocks: int,
    block_table: Sequence[int],
    start: int,
    end: int,
) -> Segments:
    """Merged byte runs that moving tokens [start, end) of a request touches."""
    return span_segments(layout, geometry, num_blocks, token_spans(block_table, start, end, geometry.block_size))


def transfer_cost(
    layout: str | Layout,
    geometry: ModelGeometry,
    tokens: int,
    *,
    block_ids: str | Sequence[int] = "scattered",
    num_blocks: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """What moving the first ``tokens`` tokens of a request costs: bytes and segments; for
    a quantized cache also its bytes by kind (``payload_bytes``, ``scale_bytes``,
    ``padding_bytes``: the scales and padding move inside the same segments).

    ``block_ids`` is the request's block table, or ``"scattered"`` (seeded, no two
    adjacent) or ``"contiguous"``.
    """
    layout = get_layout(layout)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
        raise ValueError(f"tokens must be a positive integer, got {tokens!r}")
    needed = -(-tokens // geometry.block_size)
    if needed > MAX_TABLE_BLOCKS:
        raise ValueError(
            f"{tokens:,} tokens need {needed:,} blocks of {geometry.block_size}: the block table is bounded at "
            f"{MAX_TABLE_BLOCKS:,} blocks ({MAX_TABLE_BLOCKS * geometry.block_size:,} tokens at this block size)"
        )
    _check_runs(layout, geometry, tokens // geometry.block_size, tokens % geometry.block_size)
    num_blocks = max(4 * needed, 64) if num_blocks is None else num_blocks
    check_num_blocks(geometry, num_blocks)
    if layout.is_chunk_format:
        if not isinstance(block_ids, str):
            raise ValueError(
                f"block ids apply to paged layouts only: {layout.name} is an LMCache chunk, which holds its "
                f"tokens in order, with no block table"
            )
        # A stored chunk holds exactly these tokens, in order.
        block_ids, num_blocks = "chunk", needed
        table = contiguous_block_ids(needed)
    elif block_ids == "scattered":
        table = scattered_block_ids(needed, num_blocks, seed)
    elif block_ids == "contiguous":
        table = contiguous_block_ids(needed)
    elif isinstance(block_ids, str):
        raise ValueError(f"block_ids must be 'scattered', 'contiguous' or a list of ids, got {block_ids!r}")
    else:
        table = check_block_ids(block_ids, num_blocks)
    segments = token_segments(layout, geometry, num_blocks, table, 0, tokens)
    quantized = {} if geometry.quant is None else {
        f"{kind}_bytes": tokens * geometry.num_layers * geometry.num_kv_heads * 2 * size
        for kind, size in geometry.quant.split(geometry.head_size).items()}
    return {
        "layout": layout.name,
        "tokens": tokens,
        "blocks": needed,
        "num_blocks": num_blocks,
        "block_ids": block_ids if isinstance(block_ids, str) else "given",
        "bytes_moved": tokens * geometry.token_bytes,
        **quantized,
        **segments.summary(),
    }


def sweep(
    layouts: Sequence[str | Layout],
    geometry: ModelGeometry,
    tokens: Sequence[int],
    block_sizes: Sequence[int],
    block_ids: str = "scattered",
    seed: int = 0,
) -> list[dict[str, Any]]:
    """transfer_cost for every layout x block size x token count, as rows."""
    rows = []
    for layout in layouts:
        for block_size in block_sizes:
            sized = geometry.with_(block_size=block_size)
            for count in tokens:
                rows.append({"block_size": block_size, **transfer_cost(layout, sized, count, block_ids=block_ids, seed=seed)})
    return rows


def layout_table(layouts: Sequence[str | Layout], geometry: ModelGeometry, num_blocks: int = 8) -> list[dict[str, Any]]:
    """The stride table: how each layout hands a layer to a connector, and what a block costs."""
    from kvlab.cache.allocation import allocate
    from kvlab.cache.fits import compatible_layouts

    fitting = compatible_layouts(geometry)
    rows = []
    for layout in map(get_layout, layouts):
        if layout.name not in fitting:
            continue
        cache = allocate(layout, geometry, num_blocks, device="meta")
        first = list(cache.layers.values())[:2]
        views = [view_parts(v) for v in first]
        one_block = block_segments(layout, geometry, num_blocks, [1])
        rows.append({
            "layout": layout.name,
            "family": layout.family,
            "tensors": len(cache.storage),
            "layer view shape": " | ".join(str(tuple(t.shape)) for t in views[0]),
            "layer view strides": " | ".join(str(t.stride()) for t in views[0]),
            "layer 1 offset": views[1][0].storage_offset() if len(views) > 1 else None,
            "cross-layer": layout.is_cross_layer,
            "runs per block": one_block.count,
            "run bytes": one_block.total_bytes // one_block.count,
        })
    return rows
