"""Hybrid models: several KV cache groups in one buffer.

vLLM's hybrid allocator (on by default for connectors that declare ``SupportsHMA``, vLLM
#41847) gives each kind of layer a group with its own block table: full attention, sliding
window, Mamba/GDN state. The groups are laid over the same bytes ("cache groups overlay each
other, which is sound because a block ID is owned by one group at a time":
``vllm/v1/kv_cache_interface.py::KVCacheTensor``), so block *b* holds one group's pages, and
which group's depends on the scheduler's block tables, not on the buffer. Where each group's
layer pages sit is ``get_kv_cache_config_from_groups`` (``vllm/v1/core/kv_cache_utils.py``,
0.33: ``kv_cache_planning.py``; run here): layer-outer layouts need one page size (vLLM pads
Mamba pages to the attention page), block-outer ones pack each group's pages side by side in
a block and pad the block to the widest group (multi-group packing, vLLM #46252).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from kvlab.cache.allocation import KVCache, allocate, from_storage, layer_name
from kvlab.cache.devices import resolve_device
from kvlab.cache.geometry import ModelGeometry
from kvlab.cache.layouts import VLLM_V29_LAYOUTS
from kvlab.cache.quant import PADDING, PAYLOAD
from kvlab.cache.segments import Segments, check_block_ids, merge_runs

GROUP_KINDS = ("full_attention", "sliding_window", "mamba")
UNUSED = 3  # a cell kind beside kvlab.cache.quant's: bytes of a block its owner's pages leave free
# The orders whose pages are one run each, the ones vLLM can pack groups of several page sizes in.
HYBRID_LAYOUTS = tuple(name for name in VLLM_V29_LAYOUTS if name not in ("LHBNC", "BHLNC"))


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group: its kind, its model layers, and one layer's page: ``content``
    bytes (attention KV of a block, or one Mamba state), placed as ``page`` bytes."""

    kind: str
    layers: tuple[int, ...]
    content: int
    page: int
    geometry: ModelGeometry | None = None  # attention groups: their KV, one layer per group layer
    window: int | None = None  # sliding window, tokens

    def __post_init__(self) -> None:
        if self.kind not in GROUP_KINDS:
            raise ValueError(f"a KV cache group is one of {GROUP_KINDS}, not {self.kind!r}")
        if not self.layers or len(set(self.layers)) != len(self.layers):
            raise ValueError(f"a {self.kind} group needs distinct layers, got {self.layers}")
        if not 0 < self.content <= self.page:
            raise ValueError(f"a {self.kind} group's page ({self.page} B) must hold its content ({self.content} B)")
        if (self.geometry is None) != (self.kind == "mamba"):
            raise ValueError(f"attention groups, and only they, have a KV geometry (got a {self.kind} group)")

    @classmethod
    def attention(cls, geometry: ModelGeometry, layers: Sequence[int], window: int | None = None) -> KVGroup:
        """Full attention, or sliding window attention over ``window`` tokens."""
        return cls("sliding_window" if window else "full_attention", tuple(layers), geometry.page_bytes,
                   geometry.page_bytes, geometry.with_(num_layers=len(layers)), window)

    @classmethod
    def mamba(cls, layers: Sequence[int], state_bytes: int, page: int | None = None) -> KVGroup:
        """Mamba/GDN state: one state (conv and SSM) of ``state_bytes`` per layer and block,
        in a page of ``page`` bytes (vLLM pads it to the attention page)."""
        return cls("mamba", tuple(layers), state_bytes, page or state_bytes)

    @property
    def is_attention(self) -> bool:
        return self.geometry is not None

    def describe(self) -> str:
        """'sliding_window (window 64): layers 1, 3', 'mamba: layer 2'."""
        window = f" (window {self.window})" if self.window else ""
        return f"{self.kind}{window}: layer{'s' * (len(self.layers) > 1)} {', '.join(map(str, self.layers))}"


@dataclass(frozen=True)
class Placement:
    """Where a group's pages sit in the buffer (vLLM's KVCacheTensor): layer i of the group,
    block b, at ``offset + i * layer_stride + b * block_stride`` bytes."""

    offset: int
    layer_stride: int
    block_stride: int


@dataclass(frozen=True)
class HybridGeometry:
    """A hybrid model's KV: its groups, over disjoint layers."""

    name: str
    groups: tuple[KVGroup, ...]

    def __post_init__(self) -> None:
        layers = [layer for group in self.groups for layer in group.layers]
        if not self.groups or len(set(layers)) != len(layers):
            raise ValueError(f"{self.name}: groups must be given and hold each layer once, got layers {layers}")

    def bytes_per_block(self, layout: str) -> int:
        """One block id's bytes in every group's view: the widest group's pages."""
        if _block_outer(layout):
            return max(len(g.layers) * g.page for g in self.groups)
        pages = {g.page for g in self.groups}
        if len(pages) > 1:
            raise ValueError(f"{layout} keeps each layer's pages together, which needs one page size, not "
                             f"{sorted(pages)}: vLLM pads Mamba pages to the attention page, or packs mixed pages "
                             f"block-outer (BLHNC)")
        return max(len(g.layers) for g in self.groups) * pages.pop()

    def placements(self, layout: str, num_blocks: int) -> list[Placement]:
        """Each group's placement: every group starts at byte 0 (the groups alias)."""
        block = self.bytes_per_block(layout)
        if _block_outer(layout):
            return [Placement(0, g.page, block) for g in self.groups]
        return [Placement(0, num_blocks * g.page, g.page) for g in self.groups]


def _block_outer(layout: str) -> bool:
    if layout not in HYBRID_LAYOUTS:
        raise ValueError(f"kvlab places hybrid groups in {list(HYBRID_LAYOUTS)} (pages of one run), not {layout!r}")
    return layout.startswith("B")


@dataclass
class HybridCache:
    """A hybrid model's buffer and each layer's view of it, as vLLM's ``allocate_kv_cache``
    hands them over: attention ``[B, H, N, C]`` in the KV dtype, Mamba ``[B, 1, 1, state]``
    bytes (its backend splits the state)."""

    hybrid: HybridGeometry
    layout: str
    num_blocks: int
    buffer: torch.Tensor
    placements: list[Placement]
    layers: dict[str, torch.Tensor] = field(default_factory=dict)

    def group_cache(self, index: int) -> KVCache:
        """Attention group ``index`` as a kvlab cache over the shared buffer, for kvlab.transfer:
        where its pages fill the blocks (no padding between them) it is plain ``layout``."""
        group, place = self.hybrid.groups[index], self.placements[index]
        if not group.is_attention:
            raise ValueError(f"group {index} ({group.describe()}) holds Mamba state, not K and V")
        dense = place.layer_stride == (group.page if _block_outer(self.layout) else self.num_blocks * group.page)
        if not dense or place.block_stride != (len(group.layers) * group.page if _block_outer(self.layout) else group.page):
            raise ValueError(f"group {index}'s blocks are {place.block_stride} B apart for {len(group.layers)} pages "
                             f"of {group.page} B: padded between blocks, not a kvlab layout")
        size = len(group.layers) * group.page * self.num_blocks
        cache = from_storage(self.layout, group.geometry, self.num_blocks, [self.buffer[:size].view(group.geometry.dtype)])
        cache.layers = dict(zip([layer_name(i) for i in group.layers], cache.layers.values()))
        return cache


def hybrid_miniature(packed: bool = False) -> HybridGeometry:
    """A hybrid model small enough to draw every 32 bytes of: full-attention, sliding-window
    and Mamba groups of two layers, the Mamba state padded to the attention page (vLLM's
    hybrid allocator); or, ``packed``, three attention layers and one unpadded Mamba state,
    for a block-outer layout to pack (vLLM #46252)."""
    gqa = ModelGeometry("gqa", 1, 2, 8, torch.bfloat16, block_size=4)  # a page: 2 x 4 x 16 x 2 = 256 bytes
    if packed:
        return HybridGeometry("hybrid, mixed pages (miniature)",
                              (KVGroup.attention(gqa, [0, 1, 3]), KVGroup.mamba([2], 96)))
    return HybridGeometry("hybrid (miniature)", (KVGroup.attention(gqa, [0, 3]), KVGroup.attention(gqa, [1, 4], window=8),
                                                 KVGroup.mamba([2, 5], 96, gqa.page_bytes)))


def allocate_hybrid(hybrid: HybridGeometry, layout: str, num_blocks: int, device: str | torch.device = "cpu") -> HybridCache:
    """One zeroed byte buffer for every group, and each layer's view, placed as vLLM places them."""
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
        raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
    places = hybrid.placements(layout, num_blocks)
    buffer = torch.zeros(hybrid.bytes_per_block(layout) * num_blocks, dtype=torch.int8, device=resolve_device(device))
    views: dict[int, torch.Tensor] = {}
    for group, place in zip(hybrid.groups, places):
        for i, layer in enumerate(group.layers):
            start = place.offset + i * place.layer_stride
            if group.is_attention:
                views[layer] = _attention_view(buffer, layout, group.geometry, num_blocks, start, place.block_stride)
            else:
                views[layer] = buffer.as_strided((num_blocks, 1, 1, group.content),
                                                 (place.block_stride, group.content, group.content, 1), start)
    return HybridCache(hybrid, layout, num_blocks, buffer, places, {layer_name(i): views[i] for i in sorted(views)})


def _attention_view(buffer: torch.Tensor, layout: str, geometry: ModelGeometry, num_blocks: int, start: int,
                    block_stride: int) -> torch.Tensor:
    """One attention layer's [B, H, N, C] view: the page order of ``layout``'s views, blocks
    ``block_stride`` bytes apart."""
    item = geometry.itemsize
    page = next(iter(allocate(layout, geometry.with_(num_layers=1), 1, "meta").layers.values()))
    typed = buffer.view(geometry.dtype)
    return typed.as_strided((num_blocks, *page.shape[1:]), (block_stride // item, *page.stride()[1:]), start // item)


def group_segments(cache: HybridCache, group: int, block_ids: Sequence[int]) -> Segments:
    """The byte runs that moving blocks ``block_ids`` of one group touches: each layer's
    page content (a Mamba state, not its padding), merged where they touch."""
    ids = check_block_ids(block_ids, cache.num_blocks)
    g, place = cache.hybrid.groups[group], cache.placements[group]
    starts = torch.tensor([place.offset + i * place.layer_stride + b * place.block_stride
                           for b in ids for i in range(len(g.layers))], dtype=torch.int64)
    ((tensor, start),), length = merge_runs([(torch.zeros_like(starts), starts)], torch.full_like(starts, g.content))
    return Segments(tensor, start, length)


def hybrid_cells(cache: HybridCache, owners: Sequence[int], unit: int) -> dict[str, torch.Tensor]:
    """What each ``unit`` bytes of the buffer hold when block b belongs to group
    ``owners[b]``: columns ``group``, ``layer`` (the model's; -1 where unused), ``block``
    and ``kind`` (payload, padding, or UNUSED: no page of the owner there)."""
    if len(owners) != cache.num_blocks or any(not 0 <= o < len(cache.hybrid.groups) for o in owners):
        raise ValueError(f"owners names a group for each of {cache.num_blocks} blocks, got {list(owners)}")
    size = cache.buffer.numel()
    if any(n % unit for n in (size, *(x for g in cache.hybrid.groups for x in (g.content, g.page)))):
        raise ValueError(f"every page and its content must be a whole number of {unit}-byte cells")
    cells = torch.arange(size // unit) * unit
    if _block_outer(cache.layout):  # a block's unused bytes still belong to it
        block = cells // cache.placements[0].block_stride
    else:
        page = cache.hybrid.groups[0].page
        block = cells % (cache.num_blocks * page) // page
    group, layer, kind = torch.full_like(cells, -1), torch.full_like(cells, -1), torch.full_like(cells, UNUSED)
    for b, owner in enumerate(owners):
        g, place = cache.hybrid.groups[owner], cache.placements[owner]
        for i, model_layer in enumerate(g.layers):
            start = (place.offset + i * place.layer_stride + b * place.block_stride) // unit
            page = slice(start, start + g.page // unit)
            group[page], layer[page], kind[page] = owner, model_layer, PADDING
            kind[start:start + g.content // unit] = PAYLOAD
    return {"group": group, "layer": layer, "block": block, "kind": kind}
