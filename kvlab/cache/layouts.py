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
sizes multiply: ``"SD"`` is vLLM's C, ``"BN"`` LMCache's T, ``"HD"`` LMCache's hidden dim."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


AXES = "LBSNHD"
# Layout.role: what a connector adopting a vLLM cache takes a layout for, in the order it tries them.
ROLES = ("mla", "cpu", "vllm", "")


class Kind(Enum):
    """What a layout is: a paged cache an engine computes into, or a stored chunk whose
    "blocks" are its consecutive groups of block-size tokens."""

    PAGED = "paged"
    CHUNK = "chunk"


class Holds(Enum):
    """Which KV a layout can hold: separate K and V, MLA's one latent per token, or either."""

    KV = "kv"
    MLA = "mla"
    ANY = "any"


@dataclass(frozen=True)
class Layout:
    """One KV cache layout: a physical axis order and how a connector sees each layer.

    ``mla_twin`` names the layout that plays this one's part for an MLA model (the Ascend
    tuple, LMCache's chunk); ``lmcache_peer`` the LMCache chunk format LMCache's own copy
    function moves this paged layout to and from, and ``lmcache_pages`` how LMCache's CPU
    fallback views each of its layers (axis groups, as ``view_shape``). ``role`` is what a
    connector adopting a vLLM cache takes the layout for, tried in this order: "mla" (an MLA
    model's latent cache), "cpu" (what vLLM's CPU attention reads; on a CPU only), "vllm"
    (vLLM >= 0.29's own orders); "" after those. ``vllm_order`` names the KVCacheLayout of
    vLLM >= 0.29 whose buffer the layout reads ("" for none). ``scales`` says which quantized caches
    (kvlab.cache.quant) it carries: rows with their scales "inline", "regions" (NVFP4: the
    order describes the page as vLLM views it, ``side_order`` what each K or V side holds:
    every (head, token) row's values, then their scales, heads outside tokens "HN" or inside
    "NH"), or "" none."""

    name: str
    family: str
    order: str
    view_order: str
    view_shape: tuple[str, ...]
    shape_text: str
    note: str
    split: str = ""
    storage_shape: tuple[str, ...] = ()
    requires: Holds = Holds.ANY
    backends: str = ""
    kind: Kind = Kind.PAGED
    mla_twin: str | None = None
    lmcache_peer: str | None = None
    scales: str = "inline"
    side_order: str = ""
    lmcache_pages: tuple[str, ...] = ()
    role: str = ""
    vllm_order: str = ""

    def __post_init__(self) -> None:
        # user input (register_layout takes any Layout): raised, not asserted, so python -O keeps it
        if sorted(self.order) != sorted(AXES) or self.order[-1] != "D":
            raise ValueError(f"layout {self.name!r}: order must hold each of the axes {AXES} once, with D "
                             f"innermost (last), got {self.order!r}")
        if any(a not in self.order for a in self.split):
            raise ValueError(f"layout {self.name!r}: split names axes of its order {AXES}, got {self.split!r}")
        kept = "".join(a for a in self.order if a not in "L" + self.split)
        if sorted(self.view_order) != sorted(kept):
            raise ValueError(f"layout {self.name!r}: view_order must hold each axis of the order outside the layer "
                             f"axis and the split ones ({kept!r}) once, got {self.view_order!r}")
        if self.role not in ROLES:
            raise ValueError(f"layout {self.name!r}: role is one of {ROLES}, got {self.role!r}")
        if self.scales not in ("inline", "regions", "") or (self.scales == "regions") != (self.side_order in ("HN", "NH")):
            raise ValueError(f"layout {self.name!r}: scales is 'inline', 'regions' (with side_order 'HN' or 'NH') "
                             f"or '', got {self.scales!r} with side_order {self.side_order!r}")

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
        return self.kind is Kind.CHUNK

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "family": self.family,
            "shape": self.shape_text,
            "physical_order": self.order,
            "cross_layer": self.is_cross_layer,
            "layer_compact": self.is_layer_compact,
            "tuple": self.is_tuple,
            "requires": self.requires.value,
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
        backends="FLASH_ATTN, FLASHINFER, TRITON_ATTN (C = K|V per token and head)", role="vllm", vllm_order=name,
    )


def _cpu_attn(name: str, note: str) -> Layout:
    """One of vLLM's ``KVCacheLayout`` orders as CPU_ATTN's kernels read it: each (block,
    head) page is [2*BS, D], all K rows then all V rows. The kernels follow the block and
    head strides, so the head-major orders (HNC innermost) all work; the NHD ones cannot
    be viewed as such pages (tests/connector/test_cpu_backend.py)."""
    order = "".join(("L", "B", "H", "SND")[i] for i in _V29_PERMUTATIONS[name][:4])
    return Layout(
        f"CPU_{name}", "vLLM >= 0.29", order, "BHSND", ("B", "H", "N", "SD"),
        f"per-layer [B, H, N, 2D] views of one {name} buffer",
        f"CPU_ATTN reads each (block, head) page as [2*BS, D]: all K rows, then all V rows; {note}",
        backends="CPU_ATTN" if name == "LBHNC" else "kvlab's CPU_ATTN backend", requires=Holds.KV, scales="",
        role="cpu", vllm_order=name,
    )


def _nvfp4(name: str) -> Layout:
    """vLLM's NVFP4 cache (FLASHINFER) under one of its KVCacheLayout orders: a layer's view
    is (NB, 2H, BS, D/2 + D/16) bytes over the logical [L, B, 2H, N, C]; only orders whose
    pages are dense can be read (``_nvfp4_kv_views`` raises otherwise)."""
    logical = ("L", "B", "SH", "N", "D")
    order = "".join(logical[i] for i in _V29_PERMUTATIONS[name])
    return Layout(
        f"nvfp4_{name}", "vLLM >= 0.29", order, "BSHND", ("B", "SH", "N", "D"),
        f"per-layer (NB, 2H, BS, D/2 + D/16) uint8 views of one {name} buffer",
        "NVFP4: each K/V side of a page holds every row's packed 4-bit values, then their fp8 scales",
        backends="FLASHINFER (nvfp4)", requires=Holds.KV, scales="regions", side_order=name[2:4], vllm_order=name,
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
    # MLA in vLLM >= 0.29: the same KVCacheLayout orders with one "head" (the latent); byte
    # for byte LBNHC / BLNHC, named for what they hold.
    Layout(
        "mla_v0.29", "vLLM >= 0.29", "LBNHSD", "BHNSD", ("B", "H", "N", "SD"),
        "per-layer [B, 1, N, C] views of one LBNHC buffer (C = kv_lora_rank + rope)",
        "MLA: one latent per token and layer; each layer contiguous",
        requires=Holds.MLA, backends="CPU_MLA, FLASHMLA, TRITON_MLA", role="mla",
    ),
    Layout(
        "mla_v0.29_cross", "vLLM >= 0.29", "BLNHSD", "BHNSD", ("B", "H", "N", "SD"),
        "per-layer [B, 1, N, C] views of one BLNHC buffer (C = kv_lora_rank + rope)",
        "MLA cross-layer: a block holds every layer's latents in one run",
        requires=Holds.MLA, backends="CPU_MLA, FLASHMLA, TRITON_MLA", role="mla",
    ),
    _cpu_attn("LBHNC", "CPU_ATTN's own (the only layout it declares): each layer contiguous"),
    _cpu_attn("LHBNC", "each layer contiguous, heads outside blocks (kvlab's backend)"),
    _cpu_attn("BLHNC", "cross-layer: a block holds every layer's packed pages in one run (kvlab's backend)"),
    _cpu_attn("BHLNC", "cross-layer per head: a block is one run, heads outermost (kvlab's backend)"),
    *(_nvfp4(name) for name in ("LBHNC", "LBNHC", "BLHNC", "BLNHC")),
    # vLLM 0.12 to 0.28: one tensor per layer (CPU_ATTN's packed page; see GENERATIONS).
    Layout(
        "cpu_attn_v0.23", "vLLM 0.23-0.28", "LBHSND", "BHSND", ("B", "H", "N", "SD"),
        "(NB, H, BS, 2D) per layer", "CPU_ATTN reads each (block, head) page as [2*BS, D]",
        split="L", requires=Holds.KV, backends="CPU_ATTN", scales="",
    ),
    # vllm-ascend: each layer a (k_cache, v_cache) tuple of separate tensors.
    Layout(
        "ascend_kv_tuple", "vllm-ascend", "LSBNHD", "BNHD", ("B", "N", "H", "D"),
        "(k_cache, v_cache), each (NB, BS, H, D), per layer",
        "K and V are separate allocations: no run ever spans both",
        split="LS", requires=Holds.KV, backends="Ascend attention", mla_twin="ascend_mla_tuple", scales="",
    ),
    Layout(
        "ascend_mla_tuple", "vllm-ascend", "LSBNHD", "BNHD", ("B", "N", "H", "D"),
        "(nope_cache (NB, BS, 1, kv_lora_rank), rope_cache (NB, BS, 1, rope)) per layer",
        "the MLA latent and its rope part in two allocations",
        split="LS", requires=Holds.MLA, backends="Ascend MLA attention", scales="",
    ),
    # LMCache 0.5.6 stored chunk formats (lmcache.v1.memory_management.MemoryFormat).
    Layout(
        "KV_2LTD", "LMCache chunk", "SLBNHD", "SBNHD", ("S", "BN", "HD"), "[2, L, T, H*D]",
        "LMCache's stored object per chunk (non-layerwise)",
        storage_shape=("S", "L", "BN", "HD"), requires=Holds.KV, kind=Kind.CHUNK, mla_twin="KV_MLA_FMT", scales="",
    ),
    Layout(
        "KV_T2D", "LMCache chunk", "LBNSHD", "BNSHD", ("BN", "S", "HD"), "[T, 2, H*D] per layer",
        "LMCache's layerwise object: one per chunk and layer",
        split="L", storage_shape=("BN", "S", "HD"), requires=Holds.KV, kind=Kind.CHUNK, scales="",
    ),
    Layout(
        "KV_MLA_FMT", "LMCache chunk", "LBNHSD", "BNHSD", ("BN", "SD"), "[1, L, T, C]",
        "LMCache's stored MLA chunk: one latent per token and layer",
        storage_shape=("H", "L", "BN", "SD"), requires=Holds.MLA, kind=Kind.CHUNK, scales="",
    ),
]


@dataclass(frozen=True)
class Generation:
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
    requires: Holds = Holds.KV
    lmcache_peer: str | None = None  # the LMCache chunk its NHD per-layer cache moves to
    lmcache_pages: tuple[str, ...] = ()  # how LMCache's CPU fallback views each layer of it (axis groups)
    role: str = ""  # of its NHD per-layer layout (Layout.role)


_SHAPE_SYMBOLS = {"L": "L", "B": "NB", "S": "2", "N": "BS", "H": "H", "D": "D", "SD": "2D", "HSD": "C"}


def _shape_text(tokens: tuple[str, ...]) -> str:
    return "(" + ", ".join(_SHAPE_SYMBOLS[t] for t in tokens) + ")"


# get_kv_cache_shape and get_kv_cache_stride_order(include_num_layers_dimension=False/True)
# of vLLM 0.12-0.28, as executed from the release wheels
# (tests/fixtures/vllm_kv_shapes_0.12-0.28.json). "SD" is K|V packed per token (2*D);
# "HSD" is MLA's one-head latent. NHD was the default cache layout.
GENERATIONS = [
    Generation(
        "flash_attn_v0.12", "vLLM 0.12-0.22", "FLASH_ATTN", ("S", "B", "N", "H", "D"),
        {"NHD": (0, 1, 2, 3, 4), "HND": (0, 1, 3, 2, 4)},
        {"NHD": (2, 0, 1, 3, 4, 5), "HND": (2, 4, 0, 1, 3, 5)}, lmcache_peer="KV_2LTD", lmcache_pages=("S", "BN", "HD"),
    ),
    Generation(
        "flash_attn_v0.23", "vLLM 0.23-0.25", "FLASH_ATTN, TRITON_ATTN 0.23-0.25", ("B", "S", "N", "H", "D"),
        {"NHD": (0, 1, 2, 3, 4), "HND": (0, 1, 3, 2, 4)},
        {"NHD": (1, 0, 2, 3, 4, 5), "HND": (1, 4, 0, 2, 3, 5)},
    ),
    Generation(
        "flashinfer_v0.12", "vLLM 0.12-0.25", "FLASHINFER; TRITON_ATTN 0.12-0.22", ("B", "S", "N", "H", "D"),
        {"NHD": (0, 1, 2, 3, 4), "HND": (0, 1, 3, 2, 4)},
        {"NHD": (1, 0, 2, 3, 4, 5), "HND": (1, 2, 4, 0, 3, 5)}, lmcache_peer="KV_2LTD",
        lmcache_pages=("B", "S", "N", "HD"),
    ),
    Generation(
        "flash_attn_v0.26", "vLLM 0.26-0.28", "FLASH_ATTN, FLASHINFER, TRITON_ATTN", ("B", "H", "N", "SD"),
        {"NHD": (0, 2, 1, 3), "HND": (0, 1, 2, 3)},
        {"NHD": (1, 0, 3, 2, 4), "HND": (1, 2, 0, 3, 4)},
    ),
    Generation(
        "cpu_attn_v0.12", "vLLM 0.12-0.22", "CPU_ATTN", ("S", "B", "H", "N", "D"),
        {"NHD": (0, 1, 2, 3, 4)}, {},
    ),
    Generation(
        "mla_v0.12", "vLLM 0.12-0.28",
        "MLA backends (cross-layer: MLA common 0.12-0.17; FlashMLA and others 0.24-0.28)", ("B", "N", "HSD"),
        {"NHD": (0, 1, 2)}, {"NHD": (1, 0, 2, 3)}, requires=Holds.MLA, lmcache_peer="KV_MLA_FMT",
        lmcache_pages=("BN", "HSD"), role="mla",
    ),
]


def _generation_layouts(gen: Generation) -> list[Layout]:
    view_order = "".join(gen.logical)
    out = []
    for kv_layout, order in gen.per_layer.items():
        physical = tuple(gen.logical[i] for i in order)
        nhd = kv_layout == "NHD"  # the default cache layout: LMCache's peer, and the one a connector is handed
        out.append(Layout(
            gen.name + ("" if nhd else "_hnd"), gen.family, "L" + "".join(physical),
            view_order, gen.logical,
            f"{_shape_text(gen.logical)} per layer, stored {_shape_text(physical)}",
            f"{kv_layout}: one tensor per layer", split="L", requires=gen.requires, backends=gen.backends,
            lmcache_peer=gen.lmcache_peer if nhd else None, lmcache_pages=gen.lmcache_pages if nhd else (),
            role=gen.role if nhd else "", scales=_scales(gen),
        ))
    for kv_layout, order in gen.cross_layer.items():
        physical = tuple((("L",) + gen.logical)[i] for i in order)
        out.append(Layout(
            gen.name + ("" if kv_layout == "NHD" else "_hnd") + "_cross", gen.family + " cross-layer",
            "".join(physical), view_order, gen.logical, _shape_text(physical),
            f"{kv_layout}: one tensor for all layers, passed to register_cross_layers_kv_cache",
            storage_shape=physical, requires=gen.requires, backends=gen.backends, scales=_scales(gen),
        ))
    return out


def _scales(gen: Generation) -> str:
    """The GPU backends' pages take inline-scale rows; CPU_ATTN's kernels read none."""
    return "" if gen.backends == "CPU_ATTN" else "inline"


_at = next(i for i, layout in enumerate(_LAYOUTS) if layout.name == "cpu_attn_v0.23")
_LAYOUTS[_at:_at] = [layout for gen in GENERATIONS for layout in _generation_layouts(gen)]
LAYOUTS: dict[str, Layout] = {layout.name: layout for layout in _LAYOUTS}
VLLM_V29_LAYOUTS = tuple(_V29_PERMUTATIONS)
CPU_ATTN_LAYOUTS = tuple(name for name, layout in LAYOUTS.items() if layout.role == "cpu")  # what kvlab's backend reads


def by_role(*roles: str) -> list[str]:
    """The atlas's layouts of these roles (Layout.role), role by role, in atlas order: a layout
    registered later with a role takes its part at once."""
    return [name for role in roles for name, layout in LAYOUTS.items() if layout.role == role]


def register_layout(layout: Layout, *, replace: bool = False) -> Layout:
    """Add a layout to the atlas: from then on it allocates, adopts, counts segments,
    moves with every copy method and draws like the built-in ones."""
    if layout.name in LAYOUTS and not replace:
        raise ValueError(f"a layout named {layout.name!r} is in the atlas already (replace=True to swap it)")
    LAYOUTS[layout.name] = layout
    return layout


def unregister_layout(name: str) -> None:
    """Take a layout added with :func:`register_layout` out of the atlas."""
    del LAYOUTS[get_layout(name).name]


def get_layout(name: str | Layout) -> Layout:
    """A layout by name (case-insensitive)."""
    if isinstance(name, Layout):
        return name
    by_lower = {key.lower(): layout for key, layout in LAYOUTS.items()}
    if str(name).lower() not in by_lower:
        raise ValueError(f"unknown layout {name!r}; choose one of {list(LAYOUTS)}")
    return by_lower[str(name).lower()]
