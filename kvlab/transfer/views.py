"""Strided views of a cache's blocks for the indexed copy methods (gather, compiled), and
staging through a device-side copy when a copy crosses devices."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from kvlab.cache.allocation import KVCache, allocations
from kvlab.transfer.common import device_of
from kvlab.transfer.plan import part_views

if TYPE_CHECKING:
    from kvlab.transfer.engine import Transfer


def block_rows(cache: KVCache, per_layer: bool = True, inner_layers: bool = False) -> list[tuple[int | None, torch.Tensor]]:
    """Each backing tensor as (layer, [outer, block, inner] view) pairs. With ``per_layer``
    and the layer axis outside the block axis, one pair per layer (an indexed copy then
    moves one layer's blocks); with ``inner_layers`` too when it is inside the block axis
    and each layer's part of a block is one run (BLHNC: a layer-by-layer copy then indexes
    those runs directly, not strided element views); else one pair for the whole tensor
    (layer None unless the tensor is a single layer's). Cut once per cache and reused."""
    key = ("block_rows", per_layer, inner_layers)
    if key in cache.views:
        return cache.views[key]
    out = []
    for alloc, tensor in zip(allocations(cache.layout, cache.geometry, cache.num_blocks), cache.storage):
        shaped = tensor.view(alloc.sizes)
        axes, k = alloc.axes, alloc.axes.index("B")
        inner = math.prod(alloc.sizes[k + 1:])
        if per_layer and inner_layers and "L" in axes[k + 1:]:
            rows = _inner_layer_rows(shaped, axes.index("L"), k, cache.num_blocks)
            if rows:
                out += rows
                continue
        if per_layer and "L" in axes[:k]:
            li = axes.index("L")
            for layer in range(alloc.sizes[li]):
                sub = shaped.select(li, layer).flatten(k)  # [*outer, block, inner], a view
                try:
                    out.append((layer, sub.view(-1, cache.num_blocks, inner)))
                except RuntimeError:  # outer axes not mergeable (the layer axis sat between them)
                    out += [(layer, sub[index].view(1, cache.num_blocks, inner))
                            for index in itertools.product(*map(range, sub.shape[:-2]))]
        else:
            out.append((alloc.index.get("L"), shaped.view(math.prod(alloc.sizes[:k]), cache.num_blocks, inner)))
    cache.views[key] = out
    return out


def _inner_layer_rows(shaped: torch.Tensor, li: int, k: int, num_blocks: int) -> list[tuple[int, torch.Tensor]]:
    """(layer, [outer, block, inner] view) per layer of a tensor whose layer axis ``li`` is
    inside its block axis ``k``; empty when a layer's part of a block is not one run."""
    rows = []
    for layer in range(shaped.shape[li]):
        sub = shaped.select(li, layer)
        try:  # view, never flatten: flatten copies what it cannot view, and a copy is written in vain
            rows.append((layer, sub.view(-1, num_blocks, math.prod(sub.shape[k + 1:]))))
        except RuntimeError:  # heads outside the layer axis (BHLNC): several runs per block
            return []
    return rows


def part_tensors(cache: KVCache, layers: Sequence[int]) -> list[list[torch.Tensor]]:
    """``[layer][part]`` as strided [block, token, head, element] views (no copy)."""
    views = part_views(cache.layout, cache.geometry, cache.num_blocks)
    g = cache.geometry
    out = []
    for layer in layers:
        row = []
        for v in views[layer]:
            flat = cache.storage[v.tensor].view(-1)
            row.append(flat.as_strided((cache.num_blocks, g.block_size, g.num_kv_heads, v.size), (*v.strides, 1), v.offset))
        out.append(row)
    return out


def index_pairs(t: Transfer, src: KVCache, dst: KVCache, gather: bool) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """(source view, destination view, block dim) pairs for one indexed copy each.

    Gathering into a packed buffer goes layer by layer (index_select straight into each
    layer's slice); scattering into a cache goes one index_copy_ per backing tensor over
    all its layers (measured faster on CPUs than one per layer)."""
    if src.layout.name == dst.layout.name:
        per_layer, inner = gather or t.layers is not None, t.layers is not None
        rows = list(zip(block_rows(src, per_layer, inner), block_rows(dst, per_layer, inner)))
        if t.layers is None:
            return [(s, d, 1) for (_, s), (_, d) in rows]
        if all(layer is not None for (layer, _), _ in rows):  # each layer has its own rows
            return [(s, d, 1) for (layer, s), (_, d) in rows if layer in t.layers]
    layers = range(src.geometry.num_layers) if t.layers is None else t.layers
    return [(s, d, 0) for rs, rd in zip(part_tensors(src, layers), part_tensors(dst, layers)) for s, d in zip(rs, rd)]


def layer_slices(cache: KVCache, layers: Sequence[int] | None) -> list[list[tuple[int, ...]]]:
    """For each backing tensor, the index tuples (into its shaped view) of the bytes that
    ``layers`` own: ``[()]`` for the whole tensor, ``[]`` for none. Staging a one-layer
    copy then moves that layer's bytes, not every layer's."""
    out = []
    for alloc in allocations(cache.layout, cache.geometry, cache.num_blocks):
        if layers is None:
            out.append([()])
        elif "L" in alloc.index:  # a tensor of one layer
            out.append([()] if alloc.index["L"] in layers else [])
        else:
            at = alloc.axes.index("L")
            out.append([(slice(None),) * at + (layer,) for layer in layers])
    return out


def _staged_copy(pairs: list[tuple[torch.Tensor, torch.Tensor]], slices: list[list[tuple[int, ...]]],
                 cache: KVCache, non_blocking: bool) -> None:
    """Copy ``slices`` of each (from, to) backing tensor pair."""
    for (a, b), alloc, parts in zip(pairs, allocations(cache.layout, cache.geometry, cache.num_blocks), slices):
        for index in parts:
            b.view(alloc.sizes)[index].copy_(a.view(alloc.sizes)[index], non_blocking=non_blocking)


def staged(t: Transfer, kernel: Callable[[KVCache, KVCache], None]) -> None:
    """Run a device-local kernel; across devices, through a device-side copy of the host
    side, of which only the layers the transfer moves cross (a layerwise load stages each
    layer once, not the whole buffer per layer)."""
    if not t.staged:
        kernel(t.src, t.dst)
        return
    non_blocking = t.device.type != "cpu"
    if device_of(t.src) == t.device:  # offload: kernel into a device copy of dst, then copy back
        # a destination the copy fills completely needs no upload; otherwise start from its
        # bytes, so blocks the kernel does not write survive the copy back
        slices = layer_slices(t.dst, t.layers)
        covered = t.layers is None and sorted(t.dst_blocks) == list(range(t.dst.num_blocks))
        stage = replace(t.dst, storage=[torch.empty_like(x, device=t.device) for x in t.dst.storage])
        if not covered:
            _staged_copy(list(zip(t.dst.storage, stage.storage)), slices, t.dst, non_blocking)
        kernel(t.src, stage)
        _staged_copy(list(zip(stage.storage, t.dst.storage)), slices, t.dst, non_blocking)
    else:
        stage = replace(t.src, storage=[torch.empty_like(x, device=t.device) for x in t.src.storage])
        _staged_copy(list(zip(t.src.storage, stage.storage)), layer_slices(t.src, t.layers), t.src, non_blocking)
        kernel(stage, t.dst)
