"""Telling layouts apart from what an engine hands over: shapes, strides and offsets.

``adopt`` takes the first layout the views match. Here: every layout they match, and
whether two matches give each byte the same meaning (then either is right) or not (the
LMCache #4463 class: identical views, different KV, and a connector that guesses moves
garbage). And the views of a hybrid model: layers whose views start at the same bytes as
a layer of another group are KV cache groups of one buffer (kvlab.cache.hybrid)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kvlab.cache.allocation import KVCache, address_labels, adoptions, allocate, allocations, view_parts
from kvlab.cache.fits import compatible_layouts
from kvlab.cache.geometry import ModelGeometry


@dataclass(frozen=True)
class Ambiguity:
    """Views of ``layout`` that ``other`` matches too; ``same_meaning``: every (layer, part,
    block, token, head) row at the same address in both, so either reading is right."""

    geometry: str
    layout: str
    other: str
    same_meaning: bool


def ambiguities(geometry: ModelGeometry, layouts: Sequence[str] | None = None, num_blocks: int = 4) -> list[Ambiguity]:
    """For each paged layout of ``layouts`` (default: every one that fits), the other
    layouts its views match, and whether they mean the same bytes."""
    names = list(layouts) if layouts is not None else compatible_layouts(geometry, chunk_formats=False)
    out = []
    for name in names:
        cache = allocate(name, geometry, num_blocks, fill="empty")
        for other in adoptions(dict(cache.layers), geometry, names, num_blocks):
            if other.layout.name != name:
                out.append(Ambiguity(geometry_label(geometry), name, other.layout.name, _rows(cache) == _rows(other)))
    return out


def geometry_label(geometry: ModelGeometry) -> str:
    """The model's name, and its KV format where quantized."""
    return geometry.name if geometry.quant is None else f"{geometry.name}, {geometry.quant.name}"


def _rows(cache: KVCache) -> dict[tuple[int, ...], tuple[int, int]]:
    """(layer, part, block, token, head) -> (address, bytes) of each row of the cache."""
    labels = address_labels(cache.layout, cache.geometry, cache.num_blocks)
    keys = torch.stack([labels[k] for k in ("layer", "part", "block", "token", "head")], 1).tolist()
    places = []
    for tensor, alloc in zip(cache.storage, allocations(cache.layout, cache.geometry, cache.num_blocks)):
        row = alloc.sizes[-1] * tensor.element_size()
        places += [(tensor.data_ptr() + i * row, row) for i in range(tensor.numel() // alloc.sizes[-1])]
    return dict(zip(map(tuple, keys), places))


@dataclass(frozen=True)
class ViewClass:
    """Layers handed over with one view signature: shape, strides and dtype."""

    layers: tuple[str, ...]
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype


def view_classes(layers: dict[str, torch.Tensor | Sequence[torch.Tensor]]) -> list[ViewClass]:
    """The layers grouped by view signature, in order of first appearance: an attention
    group and a Mamba group differ; a full-attention and a sliding-window group of one
    model do not (only vLLM's KV cache config tells them apart)."""
    found: dict[tuple, list[str]] = {}
    for name, view in layers.items():
        first = view_parts(view)[0]
        found.setdefault((tuple(first.shape), first.stride(), first.dtype), []).append(name)
    return [ViewClass(tuple(names), *key) for key, names in found.items()]


def overlays(layers: dict[str, torch.Tensor | Sequence[torch.Tensor]]) -> list[tuple[str, ...]]:
    """Sets of layers whose views start at the same byte of one buffer: KV cache groups laid
    over each other (a hybrid model), which no single layout describes; none for a cache
    of one group."""
    starts: dict[tuple[int, int], list[str]] = {}
    for name, view in layers.items():
        first = view_parts(view)[0]
        starts.setdefault((first.untyped_storage().data_ptr(), first.storage_offset() * first.element_size()),
                          []).append(name)
    return [tuple(names) for names in starts.values() if len(names) > 1]
