"""Allocating a layout on any device, cutting each layer's view out of it (what a
connector's ``register_kv_caches`` receives), wrapping memory someone else allocated, and
recognising the layout of views an engine hands over (``adopt``)."""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from functools import lru_cache
from math import prod
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from kvlab.cache.devices import can_pin_memory, check_fits, resolve_device
from kvlab.cache.geometry import ModelGeometry, dtype_name
from kvlab.cache.fits import check_compatible, compatible_layouts
from kvlab.cache.layouts import LAYOUTS, Layout, get_layout


@dataclass(frozen=True)
class Allocation:
    """One backing tensor of a layout: its fixed split-axis indices and its axes."""

    index: dict[str, int]
    axes: str
    sizes: tuple[int, ...]

    @property
    def strides(self) -> tuple[int, ...]:
        """Element strides of a contiguous tensor with these sizes."""
        out, step = [], 1
        for size in reversed(self.sizes):
            out.append(step)
            step *= size
        return tuple(reversed(out))

    @property
    def numel(self) -> int:
        return prod(self.sizes)


def axis_sizes(layout: Layout, geometry: ModelGeometry, num_blocks: int, part: int | None = None) -> dict[str, int]:
    """Size of each axis for this geometry; ``part`` picks one part of a split tuple."""
    packed = layout.packs_parts and not layout.is_tuple
    if geometry.is_mla and packed:
        parts, dim = 1, geometry.content_size
    elif part is not None:
        parts, dim = len(geometry.parts), geometry.parts[part]
    else:
        parts, dim = 2, geometry.row_size
    return {"L": geometry.num_layers, "B": num_blocks, "S": parts, "N": geometry.block_size,
            "H": geometry.num_kv_heads, "D": dim}


def check_num_blocks(geometry: ModelGeometry, num_blocks: int) -> None:
    """Refuse a block count that is not a positive integer, or that makes a cache larger
    than the int64 byte offsets every copy plan and segment computes with."""
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
        raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
    if num_blocks * geometry.block_bytes >= 2**63:
        raise ValueError(
            f"{num_blocks:,} blocks of {geometry.block_bytes:,} bytes make a cache of "
            f"{num_blocks * geometry.block_bytes:,} bytes, beyond 64-bit byte offsets (2**63)"
        )


def allocations(layout: str | Layout, geometry: ModelGeometry, num_blocks: int) -> list[Allocation]:
    """The backing tensors of a layout, in the order their addresses are laid out."""
    layout = get_layout(layout)
    check_compatible(layout, geometry)
    check_num_blocks(geometry, num_blocks)
    return list(_allocations(layout, geometry, num_blocks))


@lru_cache(maxsize=1024)
def _allocations(layout: Layout, geometry: ModelGeometry, num_blocks: int) -> tuple[Allocation, ...]:
    """:func:`allocations`, worked out once per shape (every chunk read back asks)."""
    kept = "".join(a for a in layout.order if a not in layout.split)
    split_axes = [a for a in layout.order if a in layout.split]
    sizes = axis_sizes(layout, geometry, num_blocks)
    combos: list[dict[str, int]] = [{}]
    for axis in split_axes:
        combos = [{**c, axis: i} for c in combos for i in range(sizes[axis])]
    out = []
    for combo in combos:
        part_sizes = axis_sizes(layout, geometry, num_blocks, combo.get("S"))
        out.append(Allocation(combo, kept, tuple(part_sizes[a] for a in kept)))
    return tuple(out)


def _group_size(group: str, sizes: dict[str, int]) -> int:
    return prod(sizes[a] for a in group)


def _view(permuted: torch.Tensor, layout: Layout, sizes: dict[str, int]) -> torch.Tensor:
    """View a permuted layer as the layout's view shape, without copying.

    When each shape entry merges neighbouring axes, a merged dim takes the stride of its
    innermost axis, so size-1 dims get the strides vLLM gives them; otherwise (the CPU
    backend's [2*BS, D] page shown as [BS, 2D]) it is a plain reshape of the page.
    """
    shape = [_group_size(g, sizes) for g in layout.view_shape]
    view = permuted.view(shape)
    if "".join(layout.view_shape) != layout.view_order:
        return view
    strides = [permuted.stride(layout.view_order.index(g[-1])) for g in layout.view_shape]
    return permuted.as_strided(shape, strides, permuted.storage_offset())


@dataclass
class KVCache:
    """A KV cache laid out as ``layout``: the backing tensors and each layer's view.

    ``layers`` maps vLLM-style layer names to what a connector's ``register_kv_caches``
    receives: a tensor, or a ``(k, v)`` / ``(nope, rope)`` tuple for Ascend layouts.
    ``cross_layer_tensor`` is what vLLM 0.12-0.28 passes to
    ``register_cross_layers_kv_cache`` (the block-major storage), else None.
    """

    layout: Layout
    geometry: ModelGeometry
    num_blocks: int
    storage: list[torch.Tensor]
    layers: Mapping[str, torch.Tensor | tuple[torch.Tensor, ...]] = field(default_factory=dict)
    # views of the storage that copy engines cut once and reuse (kvlab.transfer)
    views: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def cross_layer_tensor(self) -> torch.Tensor | None:
        return self.storage[0] if self.layout.is_cross_layer else None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.storage)

    def __repr__(self) -> str:
        """A line, not the tensors: what, where, how big."""
        t = self.storage[0]
        pinned = ", pinned" if t.device.type == "cpu" and t.is_pinned() else ""
        return (f"KVCache({self.layout.name}, {self.geometry.name}, {self.num_blocks} blocks, "
                f"{len(self.storage)} tensor{'s' * (len(self.storage) != 1)}, {self.nbytes / 2**20:,.1f} MiB "
                f"{dtype_name(self.geometry.dtype)} on {t.device}{pinned})")


def layer_name(index: int) -> str:
    return f"model.layers.{index}.self_attn.attn"


def view_parts(view: torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """A layer's tensors: its ``(k, v)`` tuple (Ascend; a list too, as some engines pass it),
    or its only tensor."""
    return tuple(view) if isinstance(view, (tuple, list)) else (view,)


def allocate(
    layout: str | Layout,
    geometry: ModelGeometry,
    num_blocks: int,
    device: str | torch.device = "cpu",
    *,
    fill: str = "zeros",
    pin_memory: bool = False,
    mapped: bool = False,
) -> KVCache:
    """Allocate ``layout`` for ``geometry`` on ``device`` (cpu, cuda, npu, meta or auto)
    and cut each layer's view out of it.

    ``fill`` is ``"zeros"``, ``"empty"`` or ``"arange"`` (each element's value is its
    position in the layout's logical order, handy to see where things land).
    ``pin_memory`` page-locks a host allocation so an accelerator can copy it asynchronously.
    ``mapped`` gives a host allocation a memory mapping of its own (zeroed), handed back to
    the system when the buffer goes: buffers that come and go in any order (a store's
    chunks) then leave no holes in the allocator's heap for the process to keep resident.
    """
    layout = get_layout(layout)
    device = resolve_device(device)
    if fill not in ("zeros", "empty", "arange"):
        raise ValueError(f"fill must be 'zeros', 'empty' or 'arange', got {fill!r}")
    if pin_memory and (device.type != "cpu" or not can_pin_memory()):
        raise ValueError(f"pin_memory needs a host (cpu) allocation on a machine with cuda or npu, not {device}")
    allocs = allocations(layout, geometry, num_blocks)
    check_fits(num_blocks * geometry.block_bytes, device,
               f"a {layout.name} cache of {num_blocks:,} blocks of {geometry.name}")
    if mapped and (device.type != "cpu" or pin_memory):
        raise ValueError(f"mapped is for unpinned host (cpu) allocations, not {device} (pin_memory={pin_memory})")
    make = _mapped_zeros if mapped else torch.zeros if fill == "zeros" else torch.empty
    storage = [make(a.sizes, dtype=geometry.dtype, device=device, pin_memory=pin_memory) for a in allocs]
    if fill == "arange":
        for alloc, tensor in zip(allocs, storage):
            tensor.copy_(torch.arange(alloc.numel, device=device).reshape(alloc.sizes).to(geometry.dtype))
    return _wrap(layout, geometry, num_blocks, allocs, storage)


def _mapped_zeros(sizes: tuple[int, ...], dtype: torch.dtype, **_: object) -> torch.Tensor:
    """Zeroed host memory in an anonymous mapping of its own, unmapped when the tensor goes."""
    nbytes = prod(sizes) * dtype.itemsize
    if not nbytes:
        return torch.zeros(sizes, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(sizes)


class LayerViews(Mapping):
    """Each layer's view of a cache, by vLLM-style layer name, cut from the backing tensors
    the first time one is asked for: a chunk read back from a tier is copied from its
    backing tensors and seldom needs them (cutting 30 layers' views costs ~0.8 ms)."""

    def __init__(self, cut: Callable[[], dict[str, Any]]) -> None:
        self._cut: Callable[[], dict[str, Any]] | None = cut
        self._views: dict[str, Any] = {}

    def _all(self) -> dict[str, Any]:
        if self._cut is not None:
            self._views, self._cut = self._cut(), None
        return self._views

    def __getitem__(self, name: str) -> Any:
        return self._all()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


def _wrap(layout: Layout, geometry: ModelGeometry, num_blocks: int, allocs: list[Allocation],
          storage: list[torch.Tensor]) -> KVCache:
    """The cache backing tensors shaped as ``allocs`` make; its layers' views are cut when
    first asked for."""
    layers = LayerViews(lambda: _layer_views(layout, geometry, num_blocks, allocs, storage))
    shaped = storage
    if layout.storage_shape:
        shaped = [
            t.view([_group_size(g, axis_sizes(layout, geometry, num_blocks, a.index.get("S")))
                    for g in layout.storage_shape if g not in layout.split])
            for a, t in zip(allocs, storage)
        ]
    return KVCache(layout, geometry, num_blocks, shaped, layers)


def _layer_views(layout: Layout, geometry: ModelGeometry, num_blocks: int, allocs: list[Allocation],
                 storage: list[torch.Tensor]) -> dict[str, Any]:
    """Cut each layer's view out of backing tensors shaped as ``allocs``."""
    views: dict[str, list[torch.Tensor]] = {}
    for alloc, tensor in zip(allocs, storage):
        sizes = axis_sizes(layout, geometry, num_blocks, alloc.index.get("S"))
        if "L" in alloc.index:
            per_layer = [(alloc.index["L"], tensor)]
        else:
            per_layer = [(i, tensor.select(alloc.axes.index("L"), i)) for i in range(geometry.num_layers)]
        for index, layer in per_layer:
            axes = alloc.axes.replace("L", "")
            permuted = layer.permute([axes.index(a) for a in layout.view_order])
            views.setdefault(layer_name(index), []).append(_view(permuted, layout, sizes))
    return {name: (tuple(v) if layout.is_tuple else v[0]) for name, v in views.items()}


def from_storage(layout: str | Layout, geometry: ModelGeometry, num_blocks: int,
                 storage: list[torch.Tensor]) -> KVCache:
    """Wrap backing tensors someone else allocated (e.g. the cross-layer tensor vLLM
    0.12-0.28 passes to ``register_cross_layers_kv_cache``) as a KVCache, without copying."""
    layout = get_layout(layout)
    allocs = allocations(layout, geometry, num_blocks)
    if len(storage) != len(allocs):
        raise ValueError(f"{layout.name} is backed by {len(allocs)} tensor(s), got {len(storage)}")
    shaped = []
    for alloc, tensor in zip(allocs, storage):
        if tensor.dtype != geometry.dtype:
            raise ValueError(f"{layout.name} storage has dtype {tensor.dtype}, the geometry says {geometry.dtype}")
        if tensor.numel() != alloc.numel or not tensor.is_contiguous():
            raise ValueError(
                f"{layout.name} for {num_blocks} blocks needs a contiguous tensor of {alloc.numel} elements "
                f"{alloc.sizes}, got shape {tuple(tensor.shape)} with strides {tensor.stride()}"
            )
        shaped.append(tensor.view(alloc.sizes))
    return _wrap(layout, geometry, num_blocks, allocs, shaped)


def _root(t: torch.Tensor) -> torch.Tensor:
    return t if t._base is None else t._base


def _adopt_as(layout: Layout, geometry: ModelGeometry, num_blocks: int,
              given: list[tuple[torch.Tensor, ...]]) -> KVCache | None:
    """``given`` wrapped as ``layout`` if every view has the layout's shape, strides and
    relative offsets and each backing tensor fits inside the given memory; else None."""
    ref = allocate(layout, geometry, num_blocks, "meta")
    roots = [_root(s) for s in ref.storage]
    bases: list[tuple[torch.Tensor, int] | None] = [None] * len(roots)
    itemsize = geometry.itemsize
    for ref_view, real_view in zip(ref.layers.values(), given):
        if len(view_parts(ref_view)) != len(real_view):
            return None
        for ref_part, real in zip(view_parts(ref_view), real_view):
            if ref_part.shape != real.shape or ref_part.stride() != real.stride() or real.dtype != geometry.dtype:
                return None
            index = next(i for i, r in enumerate(roots) if r is _root(ref_part))
            base = real.data_ptr() - ref_part.storage_offset() * itemsize
            if bases[index] is None:
                bases[index] = (real, base)
            elif bases[index][1] != base:
                return None
    storage = []
    allocs = allocations(layout, geometry, num_blocks)
    for alloc, (real, base) in zip(allocs, bases):
        memory = real.untyped_storage()
        start = base - memory.data_ptr()
        if start < 0 or start % itemsize or start + alloc.numel * itemsize > memory.nbytes():
            return None
        storage.append(torch.empty(0, dtype=real.dtype, device=real.device).set_(memory, start // itemsize, alloc.sizes))
    return _wrap(layout, geometry, num_blocks, allocs, storage)


def adopt(layers: dict[str, torch.Tensor | tuple[torch.Tensor, ...]], geometry: ModelGeometry,
          candidates: list[str] | None = None, num_blocks: int | None = None) -> KVCache:
    """Recognise the layout of per-layer KV views an engine hands over (vLLM's
    ``register_kv_caches``) and wrap their memory as a KVCache, without copying.

    The first of ``candidates`` (default: every paged layout that fits the geometry) whose
    views match shape, strides and relative offsets wins; layer names are kept. Views of
    one block-major buffer (vLLM >= 0.29 BL* layouts) come back as a cross-layer cache.
    """
    cache = next(adoptions(layers, geometry, candidates, num_blocks), None)
    if cache is None:
        first = view_parts(next(iter(layers.values())))
        raise ValueError(
            f"no kvlab layout among {candidates or compatible_layouts(geometry, chunk_formats=False)} matches these "
            f"KV views (layer 0: shapes {[tuple(p.shape) for p in first]}, strides {[p.stride() for p in first]}, "
            f"dtype {first[0].dtype}) for {geometry.name}"
        )
    return cache


def adoptions(layers: dict[str, torch.Tensor | tuple[torch.Tensor, ...]], geometry: ModelGeometry,
               candidates: list[str] | None, num_blocks: int | None) -> Iterator[KVCache]:
    """The views wrapped as each candidate layout they match, in the candidates' order
    (more than one: shapes, strides and offsets cannot tell those layouts apart)."""
    if len(layers) != geometry.num_layers:
        raise ValueError(f"got KV for {len(layers)} layers, the geometry has {geometry.num_layers}")
    given = [view_parts(v) for v in layers.values()]
    sizes = [num_blocks] if num_blocks else sorted(set(given[0][0].shape))
    for name in candidates or compatible_layouts(geometry, chunk_formats=False):
        for size in sizes:
            try:
                cache = _adopt_as(get_layout(name), geometry, size, given)
            except ValueError:
                cache = None
            if cache is not None:
                cache.layers = dict(zip(layers, cache.layers.values()))
                yield cache
                break


def address_labels(layout: str | Layout, geometry: ModelGeometry, num_blocks: int) -> dict[str, torch.Tensor]:
    """Who owns each head vector (the D innermost elements) of the cache, in address order.

    Returns equal-length int tensors ``tensor, layer, block, part, token, head``: entry i
    describes the i-th head vector when the backing tensors are laid end to end.
    """
    layout = get_layout(layout)
    columns: dict[str, list[torch.Tensor]] = {k: [] for k in ("tensor", "layer", "block", "part", "token", "head")}
    for index, alloc in enumerate(allocations(layout, geometry, num_blocks)):
        sizes = dict(zip(alloc.axes, alloc.sizes))
        grids = torch.meshgrid(*[torch.arange(sizes[a]) for a in alloc.axes[:-1]], indexing="ij")
        by_axis = {a: g.flatten() for a, g in zip(alloc.axes[:-1], grids)}
        count = prod(alloc.sizes[:-1])
        for column, axis in (("layer", "L"), ("block", "B"), ("part", "S"), ("token", "N"), ("head", "H")):
            fixed = alloc.index.get(axis, 0)
            columns[column].append(by_axis.get(axis, torch.full((count,), fixed)))
        columns["tensor"].append(torch.full((count,), index))
    return {k: torch.cat(v) for k, v in columns.items()}


def allocate_chunk(
    layout: str | Layout,
    geometry: ModelGeometry,
    chunk_size: int,
    device: str | torch.device = "cpu",
    *,
    pin_memory: bool = False,
) -> KVCache:
    """An LMCache stored chunk of ``chunk_size`` tokens (a whole number of blocks)."""
    layout = get_layout(layout)
    if not layout.is_chunk_format:
        chunk_formats = [n for n, l in LAYOUTS.items() if l.is_chunk_format]
        raise ValueError(f"{layout.name} is a paged cache layout; chunk formats are {chunk_formats}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    if chunk_size % geometry.block_size:
        raise ValueError(
            f"chunk_size {chunk_size} is not a multiple of the block size {geometry.block_size}: "
            f"LMCache needs whole blocks per chunk (e.g. {geometry.block_size * max(1, chunk_size // geometry.block_size)})"
        )
    return allocate(layout, geometry, chunk_size // geometry.block_size, device, pin_memory=pin_memory)
