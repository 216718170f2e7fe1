"""The layout atlas: every KV cache layout that matters, each described once, as data.

A layout is a physical order of six axes, outermost first, plus how each layer's view
is cut out of it (the style of vLLM's ``KVCacheLayout``: a stride permutation and a few
named properties):

    L layer, B block, S part (K/V, or MLA's latent/rope), N token in block,
    H kv head, D element of a head's part (always innermost).

``S`` directly before ``D`` means the parts are packed side by side per token and head
(vLLM's content axis ``C = 2*D``, or MLA's 576-wide latent). Axes named in ``split`` are
separate tensors: ``"L"`` for the per-layer tensors of vLLM <= 0.28, ``"LS"`` for
vllm-ascend's ``(k_cache, v_cache)`` tuples.

A view is ``(axis order, shape)``: the allocation minus its layer index, permuted to the
axis order, then viewed (never copied) as the shape. Shape entries are axis groups whose
sizes multiply: ``"SD"`` is vLLM's C, ``"BN"`` LMCache's T, ``"HD"`` LMCache's hidden dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Any

import torch

from kvlab.devices import can_pin_memory, check_fits, resolve_device
from kvlab.geometry import ModelGeometry

AXES = "LBSNHD"


@dataclass(frozen=True)
class Layout:
    """One KV cache layout: a physical axis order and how a connector sees each layer."""

    name: str
    family: str
    order: str
    view_order: str
    view_shape: tuple[str, ...]
    shape_text: str
    note: str
    split: str = ""
    storage_shape: tuple[str, ...] = ()
    requires: str | None = None  # "kv" or "mla"
    backends: str = ""

    def __post_init__(self) -> None:
        assert sorted(self.order) == sorted(AXES) and self.order[-1] == "D", self.name
        kept = "".join(a for a in self.order if a not in "L" + self.split)
        assert sorted(self.view_order) == sorted(kept), self.name

    @property
    def packs_parts(self) -> bool:
        """K and V (or latent and rope) side by side in one content axis."""
        return self.order.endswith("SD")

    @property
    def is_cross_layer(self) -> bool:
        """All layers of a block in one run: the block axis outside the layer axis."""
        return "L" not in self.split and self.order.index("B") < self.order.index("L")

    @property
    def is_layer_compact(self) -> bool:
        """Each layer owns one contiguous region (the layer axis outermost or its own tensor)."""
        return self.order[0] == "L" or "L" in self.split

    @property
    def is_tuple(self) -> bool:
        """Each layer is handed over as a tuple of tensors, one per part."""
        return "S" in self.split

    @property
    def is_chunk_format(self) -> bool:
        """A stored chunk (LMCache), not a paged cache: blocks are consecutive tokens."""
        return self.family.startswith("LMCache")

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "family": self.family,
            "shape": self.shape_text,
            "physical_order": self.order,
            "cross_layer": self.is_cross_layer,
            "layer_compact": self.is_layer_compact,
            "tuple": self.is_tuple,
            "requires": self.requires or "any",
            "backends": self.backends,
            "note": self.note,
        }


def _vllm_v29(name: str, note: str) -> Layout:
    """One of vLLM >= 0.29's ``KVCacheLayout`` orders over logical [L, B, H, N, C]."""
    logical = ("L", "B", "H", "N", "SD")
    order = "".join(logical[i] for i in _V29_PERMUTATIONS[name])
    return Layout(
        name, "vLLM >= 0.29", order, "BHNSD", ("B", "H", "N", "SD"),
        f"per-layer [B, H, N, C] views of one {name} buffer", note,
        backends="FLASH_ATTN, FLASHINFER, TRITON_ATTN (C = K|V per token and head)",
    )


# vllm/v1/kv_cache_layout.py::KVCacheLayout values, checked against the installed vLLM.
_V29_PERMUTATIONS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}

_LAYOUTS: list[Layout] = [
    _vllm_v29("LBHNC", "the default: each layer contiguous, head-major pages (HND)"),
    _vllm_v29("LBNHC", "each layer contiguous, token-major pages (NHD)"),
    _vllm_v29("LHBNC", "each layer contiguous, heads outside blocks: a block is H runs"),
    _vllm_v29("BLHNC", "cross-layer: a block holds every layer's HND page in one run"),
    _vllm_v29("BLNHC", "cross-layer: a block holds every layer's NHD page in one run"),
    _vllm_v29("BHLNC", "cross-layer per head: a block is one run, heads outermost inside it"),
    Layout(
        "CPU_LBHNC", "vLLM >= 0.29", "LBHSND", "BHSND", ("B", "H", "N", "SD"),
        "per-layer [B, H, N, 2D] views of one LBHNC buffer",
        "CPU_ATTN reads each (block, head) page as [2*BS, D]: all K rows, then all V rows",
        backends="CPU_ATTN (the only layout it supports)", requires="kv",
    ),
    # vLLM 0.12 to 0.28: one tensor per layer (CPU_ATTN's packed page; see _GENERATIONS).
    Layout(
        "cpu_attn_v0.23", "vLLM 0.23-0.28", "LBHSND", "BHSND", ("B", "H", "N", "SD"),
        "(NB, H, BS, 2D) per layer", "CPU_ATTN reads each (block, head) page as [2*BS, D]",
        split="L", requires="kv", backends="CPU_ATTN",
    ),
    # vllm-ascend: each layer a (k_cache, v_cache) tuple of separate tensors.
    Layout(
        "ascend_kv_tuple", "vllm-ascend", "LSBNHD", "BNHD", ("B", "N", "H", "D"),
        "(k_cache, v_cache), each (NB, BS, H, D), per layer",
        "K and V are separate allocations: no run ever spans both",
        split="LS", requires="kv", backends="Ascend attention",
    ),
    Layout(
        "ascend_mla_tuple", "vllm-ascend", "LSBNHD", "BNHD", ("B", "N", "H", "D"),
        "(nope_cache (NB, BS, 1, kv_lora_rank), rope_cache (NB, BS, 1, rope)) per layer",
        "the MLA latent and its rope part in two allocations",
        split="LS", requires="mla", backends="Ascend MLA attention",
    ),
    # LMCache 0.5.6 stored chunk formats (lmcache.v1.memory_management.MemoryFormat).
    Layout(
        "KV_2LTD", "LMCache chunk", "SLBNHD", "SBNHD", ("S", "BN", "HD"), "[2, L, T, H*D]",
        "LMCache's stored object per chunk (non-layerwise)",
        storage_shape=("S", "L", "BN", "HD"), requires="kv",
    ),
    Layout(
        "KV_T2D", "LMCache chunk", "LBNSHD", "BNSHD", ("BN", "S", "HD"), "[T, 2, H*D] per layer",
        "LMCache's layerwise object: one per chunk and layer",
        split="L", storage_shape=("BN", "S", "HD"), requires="kv",
    ),
    Layout(
        "KV_MLA_FMT", "LMCache chunk", "LBNHSD", "BNHSD", ("BN", "SD"), "[1, L, T, C]",
        "LMCache's stored MLA chunk: one latent per token and layer",
        storage_shape=("H", "L", "BN", "SD"), requires="mla",
    ),
]


@dataclass(frozen=True)
class _Generation:
    """A vLLM 0.12-0.28 backend generation: its logical per-layer shape and stride orders.

    The runner stored ``logical`` permuted by the stride order and handed each layer the
    inverse permutation; cross-layer caches did the same with a layer axis in front.
    """

    name: str
    family: str
    backends: str
    logical: tuple[str, ...]
    per_layer: dict[str, tuple[int, ...]]
    cross_layer: dict[str, tuple[int, ...]]
    requires: str = "kv"


_SHAPE_SYMBOLS = {"L": "L", "B": "NB", "S": "2", "N": "BS", "H": "H", "D": "D", "SD": "2D", "HSD": "C"}


def _shape_text(tokens: tuple[str, ...]) -> str:
    return "(" + ", ".join(_SHAPE_SYMBOLS[t] for t in tokens) + ")"


# get_kv_cache_shape and get_kv_cache_stride_order(include_num_layers_dimension=False/True)
# of vLLM 0.12-0.28, as executed from the release wheels
# (tests/fixtures/vllm_kv_shapes_0.12-0.28.json). "SD" is K|V packed per token (2*D);
# "HSD" is MLA's one-head latent. NHD was the default cache layout.
_GENERATIONS = [
    _Generation(
        "flash_attn_v0.12", "vLLM 0.12-0.22", "FLASH_ATTN", ("S", "B", "N", "H", "D"),
        {"NHD": (0, 1, 2, 3, 4), "HND": (0, 1, 3, 2, 4)},
        {"NHD": (2, 0, 1, 3, 4, 5), "HND": (2, 4, 0, 1, 3, 5)},
    ),
    _Generation(
        "flash_attn_v0.23", "vLLM 0.23-0.25", "FLASH_ATTN, TRITON_ATTN 0.23-0.25", ("B", "S", "N", "H", "D"),
        {"NHD": (0, 1, 2, 3, 4), "HND": (0, 1, 3, 2, 4)},
        {"NHD": (1, 0, 2, 3, 4, 5), "HND": (1, 4, 0, 2, 3, 5)},
    ),
    _Generation(
        "flashinfer_v0.12", "vLLM 0.12-0.25", "FLASHINFER; TRITON_ATTN 0.12-0.22", ("B", "S", "N", "H", "D"),
        {"NHD": (0, 1, 2, 3, 4), "HND": (0, 1, 3, 2, 4)},
        {"NHD": (1, 0, 2, 3, 4, 5), "HND": (1, 2, 4, 0, 3, 5)},
    ),
    _Generation(
        "flash_attn_v0.26", "vLLM 0.26-0.28", "FLASH_ATTN, FLASHINFER, TRITON_ATTN", ("B", "H", "N", "SD"),
        {"NHD": (0, 2, 1, 3), "HND": (0, 1, 2, 3)},
        {"NHD": (1, 0, 3, 2, 4), "HND": (1, 2, 0, 3, 4)},
    ),
    _Generation(
        "cpu_attn_v0.12", "vLLM 0.12-0.22", "CPU_ATTN", ("S", "B", "H", "N", "D"),
        {"NHD": (0, 1, 2, 3, 4)}, {},
    ),
    _Generation(
        "mla_v0.12", "vLLM 0.12-0.28",
        "MLA backends (cross-layer: MLA common 0.12-0.17; FlashMLA and others 0.24-0.28)", ("B", "N", "HSD"),
        {"NHD": (0, 1, 2)}, {"NHD": (1, 0, 2, 3)}, requires="mla",
    ),
]


def _generation_layouts(gen: _Generation) -> list[Layout]:
    view_order = "".join(gen.logical)
    out = []
    for kv_layout, order in gen.per_layer.items():
        physical = tuple(gen.logical[i] for i in order)
        out.append(Layout(
            gen.name + ("" if kv_layout == "NHD" else "_hnd"), gen.family, "L" + "".join(physical),
            view_order, gen.logical,
            f"{_shape_text(gen.logical)} per layer, stored {_shape_text(physical)}",
            f"{kv_layout}: one tensor per layer", split="L", requires=gen.requires, backends=gen.backends,
        ))
    for kv_layout, order in gen.cross_layer.items():
        physical = tuple((("L",) + gen.logical)[i] for i in order)
        out.append(Layout(
            gen.name + ("" if kv_layout == "NHD" else "_hnd") + "_cross", gen.family + " cross-layer",
            "".join(physical), view_order, gen.logical, _shape_text(physical),
            f"{kv_layout}: one tensor for all layers, passed to register_cross_layers_kv_cache",
            storage_shape=physical, requires=gen.requires, backends=gen.backends,
        ))
    return out


_at = next(i for i, layout in enumerate(_LAYOUTS) if layout.name == "cpu_attn_v0.23")
_LAYOUTS[_at:_at] = [layout for gen in _GENERATIONS for layout in _generation_layouts(gen)]
LAYOUTS: dict[str, Layout] = {layout.name: layout for layout in _LAYOUTS}

# Which generation each backend used, by release, with its quirks: Triton ignored the
# HND setting before 0.20 and had no stride order (so no cross-layer) before 0.14; MLA's
# common backend gave up cross-layer in 0.18; CPU never had it.
_BACKEND_RELEASES = {
    "FLASH_ATTN": [(12, 22, "flash_attn_v0.12", ""), (23, 25, "flash_attn_v0.23", ""), (26, 28, "flash_attn_v0.26", "")],
    "FLASHINFER": [(12, 25, "flashinfer_v0.12", ""), (26, 28, "flash_attn_v0.26", "")],
    "TRITON_ATTN": [
        (12, 13, "flashinfer_v0.12", "nhd_only no_cross"),
        (14, 19, "flashinfer_v0.12", "nhd_only"),
        (20, 22, "flashinfer_v0.12", ""),
        (23, 25, "flash_attn_v0.23", ""),
        (26, 28, "flash_attn_v0.26", ""),
    ],
    "CPU_ATTN": [(12, 22, "cpu_attn_v0.12", "nhd_only no_cross"), (23, 28, "cpu_attn_v0.23", "nhd_only no_cross")],
    "MLA": [(12, 17, "mla_v0.12", "nhd_only"), (18, 28, "mla_v0.12", "nhd_only no_cross")],
}


def vllm_layout(version: str, backend: str, kv_layout: str | None = None, cross_layer: bool = False) -> Layout:
    """The layout a vLLM release's attention backend hands a connector.

    ``kv_layout`` is VLLM_KV_CACHE_LAYOUT: NHD/HND before 0.29, a KVCacheLayout name (or
    NHD/HND as its aliases) from 0.29 on; by default the release's default (NHD, then
    LBNHC; LBHNC on CPU). ``cross_layer`` asks for 0.12-0.28's
    register_cross_layers_kv_cache path, or a block-outermost layout from 0.29 on (where
    every GPU backend takes all six layouts, bar FlashInfer on SM100: LBHNC and BLHNC).
    """
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        raise ValueError(f"vLLM version must look like '0.20' or '0.20.1', got {version!r}") from None
    backend = backend.upper()
    if kv_layout is None:
        kv_layout = "HND" if backend == "CPU_ATTN" and (major, minor) >= (0, 29) else "NHD"
    kv_layout = kv_layout.upper()
    if (major, minor) >= (0, 29):
        name = {"NHD": "LBNHC", "HND": "LBHNC"}.get(kv_layout, kv_layout)
        if backend == "CPU_ATTN":
            if name != "LBHNC" or cross_layer:
                raise ValueError(f"vLLM {version} CPU_ATTN supports only LBHNC (per-layer), not {kv_layout}")
            return LAYOUTS["CPU_LBHNC"]
        layout = get_layout(name)
        if layout.name not in VLLM_V29_LAYOUTS:
            raise ValueError(f"vLLM {version} layouts are {list(VLLM_V29_LAYOUTS)} (or NHD/HND), not {kv_layout!r}")
        if cross_layer and not layout.is_cross_layer:
            raise ValueError(f"{layout.name} is layer-major; cross-layer needs one of BLHNC, BLNHC, BHLNC")
        return layout
    if backend not in _BACKEND_RELEASES:
        raise ValueError(f"unknown backend {backend!r}; choose one of {sorted(_BACKEND_RELEASES)}")
    if kv_layout not in ("NHD", "HND"):
        raise ValueError(f"vLLM {version} cache layouts are NHD and HND, not {kv_layout!r}")
    for first, last, name, quirks in _BACKEND_RELEASES[backend]:
        if major == 0 and first <= minor <= last:
            break
    else:
        raise ValueError(f"kvlab covers {backend} from vLLM 0.12 on, not {version}")
    if "nhd_only" in quirks:
        kv_layout = "NHD"
    if cross_layer and "no_cross" in quirks:
        raise ValueError(f"{backend} in vLLM {version} has no cross-layer KV cache")
    return LAYOUTS[name + ("" if kv_layout == "NHD" else "_hnd") + ("_cross" if cross_layer else "")]
VLLM_V29_LAYOUTS = tuple(_V29_PERMUTATIONS)


def get_layout(name: str | Layout) -> Layout:
    """A layout by name (case-insensitive)."""
    if isinstance(name, Layout):
        return name
    by_lower = {key.lower(): layout for key, layout in LAYOUTS.items()}
    if str(name).lower() not in by_lower:
        raise ValueError(f"unknown layout {name!r}; choose one of {list(LAYOUTS)}")
    return by_lower[str(name).lower()]


def check_compatible(layout: str | Layout, geometry: ModelGeometry) -> None:
    """Refuse a layout that cannot hold this geometry's KV (e.g. MLA in a K/V-split layout)."""
    layout = get_layout(layout)
    if geometry.is_mla and not _fits_mla(layout):
        raise ValueError(
            f"layout {layout.name} keeps K and V apart, but {geometry.name} is MLA (one latent "
            f"per token); MLA-capable layouts: {[n for n, l in LAYOUTS.items() if _fits_mla(l)]}"
        )
    if not geometry.is_mla and layout.requires == "mla":
        raise ValueError(
            f"layout {layout.name} is for MLA caches, but {geometry.name} has separate K and V; "
            f"K/V layouts: {[n for n, l in LAYOUTS.items() if l.requires != 'mla']}"
        )


def _fits_mla(layout: Layout) -> bool:
    return layout.requires != "kv" and (layout.packs_parts or layout.is_tuple)


def compatible_layouts(geometry: ModelGeometry, chunk_formats: bool = True) -> list[str]:
    """Names of the layouts that can hold this geometry's KV (MLA or K/V)."""
    return [
        name
        for name, layout in LAYOUTS.items()
        if (_fits_mla(layout) if geometry.is_mla else layout.requires != "mla")
        and (chunk_formats or not layout.is_chunk_format)
    ]


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
        parts, dim = 2, geometry.head_size
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
    return out


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
    layers: dict[str, torch.Tensor | tuple[torch.Tensor, ...]] = field(default_factory=dict)
    # views of the storage that copy engines cut once and reuse (kvlab.transfer)
    views: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def cross_layer_tensor(self) -> torch.Tensor | None:
        return self.storage[0] if self.layout.is_cross_layer else None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.storage)


def layer_name(index: int) -> str:
    return f"model.layers.{index}.self_attn.attn"


def allocate(
    layout: str | Layout,
    geometry: ModelGeometry,
    num_blocks: int,
    device: str | torch.device = "cpu",
    *,
    fill: str = "zeros",
    pin_memory: bool = False,
) -> KVCache:
    """Allocate ``layout`` for ``geometry`` on ``device`` (cpu, cuda, npu, meta or auto)
    and cut each layer's view out of it.

    ``fill`` is ``"zeros"``, ``"empty"`` or ``"arange"`` (each element's value is its
    position in the layout's logical order, handy to see where things land).
    ``pin_memory`` page-locks a host allocation so an accelerator can copy it asynchronously.
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
    make = torch.zeros if fill == "zeros" else torch.empty
    storage = [make(a.sizes, dtype=geometry.dtype, device=device, pin_memory=pin_memory) for a in allocs]
    if fill == "arange":
        for alloc, tensor in zip(allocs, storage):
            tensor.copy_(torch.arange(alloc.numel, device=device).reshape(alloc.sizes).to(geometry.dtype))
    return _wrap(layout, geometry, num_blocks, allocs, storage)


def _wrap(layout: Layout, geometry: ModelGeometry, num_blocks: int, allocs: list[Allocation],
          storage: list[torch.Tensor]) -> KVCache:
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
    layers = {name: (tuple(v) if layout.is_tuple else v[0]) for name, v in views.items()}
    if layout.storage_shape:
        storage = [
            t.view([_group_size(g, axis_sizes(layout, geometry, num_blocks, a.index.get("S")))
                    for g in layout.storage_shape if g not in layout.split])
            for a, t in zip(allocs, storage)
        ]
    return KVCache(layout, geometry, num_blocks, storage, layers)


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


def _parts(view: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return view if isinstance(view, tuple) else (view,)


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
        if len(_parts(ref_view)) != len(real_view):
            return None
        for ref_part, real in zip(_parts(ref_view), real_view):
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
    if len(layers) != geometry.num_layers:
        raise ValueError(f"got KV for {len(layers)} layers, the geometry has {geometry.num_layers}")
    given = [_parts(v) for v in layers.values()]
    names = candidates or compatible_layouts(geometry, chunk_formats=False)
    sizes = [num_blocks] if num_blocks else sorted(set(given[0][0].shape))
    for name in names:
        layout = get_layout(name)
        for size in sizes:
            try:
                cache = _adopt_as(layout, geometry, size, given)
            except ValueError:
                cache = None
            if cache is not None:
                cache.layers = dict(zip(layers, cache.layers.values()))
                return cache
    first = given[0]
    raise ValueError(
        f"no kvlab layout among {names} matches these KV views (layer 0: shapes "
        f"{[tuple(p.shape) for p in first]}, strides {[p.stride() for p in first]}, dtype {first[0].dtype}) "
        f"for {geometry.name}"
    )


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


def vllm_history(versions: list[str], backends: tuple[str, ...] = tuple(_BACKEND_RELEASES)) -> dict[str, dict[str, str]]:
    """backend -> release -> the default per-layer layout, marked "+ cross" where that
    release could also hand a connector a cross-layer cache."""
    table: dict[str, dict[str, str]] = {}
    for backend in backends:
        for version in versions:
            layout = vllm_layout(version, backend)
            cross = False
            for kv_layout in (None, "BLNHC"):
                try:
                    vllm_layout(version, backend, kv_layout, cross_layer=True)
                    cross = True
                except ValueError:
                    pass
            table.setdefault(backend, {})[version] = layout.name + (" + cross" if cross else "")
    return table
