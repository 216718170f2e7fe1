"""What each cell of a memory map holds: one head vector of an unquantized cache, or one
byte unit (``KVQuant.unit``) of a quantized one, labelled with its kind (payload, scale,
padding), so that a map draws a quantized row, or an NVFP4 page, in proportion to its bytes."""

from __future__ import annotations

import torch

from kvlab.cache.allocation import address_labels
from kvlab.cache.geometry import ModelGeometry
from kvlab.cache.layouts import Layout, get_layout
from kvlab.cache.quant import PAYLOAD, SCALE


def cell_labels(layout: str | Layout, geometry: ModelGeometry, num_blocks: int) -> dict[str, torch.Tensor]:
    """Who owns each cell of the cache, in address order: the columns of
    :func:`kvlab.cache.address_labels` and ``kind`` (kvlab.cache.quant.KINDS)."""
    layout = get_layout(layout)
    rows = address_labels(layout, geometry, num_blocks)
    quant = geometry.quant
    if quant is None:
        return {**rows, "kind": torch.full_like(rows["tensor"], PAYLOAD)}
    if layout.scales == "regions":
        return _region_cells(layout, geometry, rows)
    kinds = quant.kinds(geometry.head_size)
    units = {name: column.repeat_interleave(len(kinds)) for name, column in rows.items()}
    return {**units, "kind": kinds.repeat(len(rows["tensor"]))}


def cells_per_page(layout: str | Layout, geometry: ModelGeometry) -> int:
    """Cells of one layer's page of one block (a memory map's row)."""
    labels = cell_labels(layout, geometry, 1)
    return len(labels["tensor"]) // geometry.num_layers


def _region_cells(layout: Layout, geometry: ModelGeometry, rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """NVFP4: each page (one layer, one block: a run of 2 * H * BS rows as vLLM views it)
    holds, for K then V, every (head, token) row's values, then their scales, in the
    layout's ``side_order``; a row's values are ``payload / unit`` cells, its scales one."""
    quant, heads, tokens = geometry.quant, geometry.num_kv_heads, geometry.block_size
    unit = quant.unit(geometry.head_size)
    page_rows = 2 * heads * tokens
    owners = torch.stack([rows[name] for name in ("tensor", "layer", "block")]).view(3, -1, page_rows)
    if not (owners == owners[:, :, :1]).all():
        raise ValueError(f"{layout.name}: an NVFP4 page must be a run of 2 * H * BS rows of one layer and block, "
                         f"with the layer and block axes outside the page")
    pages = {name: column[::page_rows] for name, column in rows.items()}
    grid = torch.arange(heads * tokens)
    head, token = (grid // tokens, grid % tokens) if layout.side_order == "HN" else (grid % heads, grid // heads)
    template: dict[str, list[torch.Tensor]] = {"part": [], "token": [], "head": [], "kind": []}
    for part in (0, 1):
        for kind, size in ((PAYLOAD, quant.payload_bytes(geometry.head_size)), (SCALE, quant.scales_bytes(geometry.head_size))):
            repeat = size // unit
            template["part"].append(torch.full((len(grid) * repeat,), part))
            template["token"].append(token.repeat_interleave(repeat))
            template["head"].append(head.repeat_interleave(repeat))
            template["kind"].append(torch.full((len(grid) * repeat,), kind))
    page = {name: torch.cat(parts) for name, parts in template.items()}
    count = len(pages["tensor"])
    out = {name: pages[name].repeat_interleave(len(page["kind"])) for name in ("tensor", "layer", "block")}
    return {**out, **{name: column.repeat(count) for name, column in page.items()}}
