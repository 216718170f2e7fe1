"""What notebook 01's section on quantized and hybrid caches counts and says: tables from
kvlab's own arithmetic, and their key numbers as Markdown points (kvlab.plotting.story's
``takeaways``), so that no number is typed into a cell."""

from __future__ import annotations

from typing import Any, Sequence

from kvlab.cache.allocation import allocate, layer_name
from kvlab.cache.fits import compatible_layouts
from kvlab.cache.geometry import ModelGeometry, dtype_name
from kvlab.cache.hybrid import HybridGeometry, KVGroup, allocate_hybrid, group_segments
from kvlab.cache.identify import ambiguities, geometry_label
from kvlab.cache.quant import QUANTS
from kvlab.cache.segments import transfer_cost
from kvlab.plotting.common import human_bytes
from kvlab.plotting.story import Takeaways, takeaways

# The layouts each format's costs are counted in: a per-layer and a cross-layer one.
COUNTED = {"inline": ("LBHNC", "BLHNC"), "regions": ("nvfp4_LBHNC", "nvfp4_BLHNC")}


def format_rows(geometry: ModelGeometry) -> list[dict[str, Any]]:
    """One row per quantized format: how one head's row of K or V is stored, for this head size."""
    rows = []
    for quant in QUANTS.values():
        split = quant.split(geometry.head_size)
        rows.append({"format": quant.name, "stored as": dtype_name(quant.storage),
                     "scales": "inline" if quant.inline else "regions", "row bytes": quant.row_bytes(geometry.head_size),
                     **{f"{kind} bytes": n for kind, n in split.items()}, "source": quant.source})
    return rows


def quantized_costs(geometry: ModelGeometry, tokens: int = 256) -> list[dict[str, Any]]:
    """Moving ``tokens`` tokens (scattered blocks) unquantized and in each format, in a
    per-layer and a cross-layer layout: segments, and bytes by kind."""
    rows = []
    for quant in (None, *QUANTS):
        sized = geometry if quant is None else geometry.quantized(quant)
        kind = "regions" if sized.quant is not None and not sized.quant.inline else "inline"
        for layout in COUNTED[kind]:
            cost = transfer_cost(layout, sized, tokens)
            rows.append({"format": quant or dtype_name(geometry.dtype), "layout": layout, "segments": cost["segments"],
                         "bytes moved": cost["bytes_moved"], "scale bytes": cost.get("scale_bytes", 0),
                         "padding bytes": cost.get("padding_bytes", 0)})
    return rows


def quantized_points(rows: Sequence[dict[str, Any]]) -> Takeaways:
    """Per format, its first layout's transfer against the unquantized one's."""
    plain = rows[0]
    points = []
    for row in rows[2::2]:
        extra = row["scale bytes"] + row["padding bytes"]
        points.append(f"{row['format']} in {row['layout']}: {human_bytes(row['bytes moved'])} for what takes "
                      f"{human_bytes(plain['bytes moved'])} in {plain['format']}, {100 * extra / row['bytes moved']:.3g} % "
                      f"of it scales and padding, in {row['segments']:,} segments ({plain['segments']:,} unquantized)")
    return takeaways(*points)


def hybrid_rows(hybrid: HybridGeometry, layouts: Sequence[str], blocks: Sequence[int], num_blocks: int = 8
                ) -> list[dict[str, Any]]:
    """Per layout and group: the segments and bytes moving ``blocks`` of that group touches,
    and the bytes each of its pages leaves as padding."""
    rows = []
    for layout in layouts:
        cache = allocate_hybrid(hybrid, layout, num_blocks, "meta")
        for index, group in enumerate(hybrid.groups):
            moved = group_segments(cache, index, blocks)
            rows.append({"layout": layout, "group": group.describe(), "bytes per block": hybrid.bytes_per_block(layout),
                         "segments": moved.count, "bytes moved": moved.total_bytes,
                         "padding per page": group.page - group.content})
    return rows


def hybrid_points(rows: Sequence[dict[str, Any]]) -> Takeaways:
    """How many segments each layout cuts each group's blocks into."""
    points = {}
    for row in rows:
        points.setdefault(row["layout"], []).append(f"{row['group'].split(':')[0]} {row['segments']:,}")
    return takeaways(*(f"{layout}, segments by group: {', '.join(counts)}" for layout, counts in points.items()))


def ambiguity_rows(geometries: Sequence[ModelGeometry]) -> list[dict[str, Any]]:
    """Every pair of layouts whose views the other matches, per geometry."""
    return [{"geometry": a.geometry, "views of": a.layout, "also match": a.other, "same bytes": a.same_meaning}
            for geometry in geometries for a in ambiguities(geometry)]


def ambiguity_points(rows: Sequence[dict[str, Any]], geometries: Sequence[ModelGeometry]) -> Takeaways:
    """Per geometry: how many layouts it fits, and how many pairs look alike with other bytes."""
    points = []
    for geometry in geometries:
        mine = [r for r in rows if r["geometry"] == geometry_label(geometry)]
        other = sorted({tuple(sorted((r["views of"], r["also match"]))) for r in mine if not r["same bytes"]})
        shown = "; ".join(" and ".join(pair) for pair in other[:3]) + (" …" if len(other) > 3 else "")
        points.append(f"{geometry_label(geometry)}: {len(compatible_layouts(geometry, chunk_formats=False))} paged layouts, "
                      f"{len(other)} pairs with the same views and other bytes" + (f" ({shown})" if other else ""))
    return takeaways(*points)


def vllm_agreement(cases: Sequence[tuple[str, ModelGeometry]], num_blocks: int = 4) -> list[dict[str, Any]] | None:
    """Per (layout, geometry): whether kvlab's views are the installed vLLM's (shapes,
    strides, offsets, dtype); None where vLLM is not installed."""
    try:
        from kvlab.connector.vllm_views import vllm_layer_views
    except ImportError:
        return None
    rows = []
    for layout, geometry in cases:
        ours = allocate(layout, geometry, num_blocks).layers.values()
        theirs = vllm_layer_views(layout, geometry, num_blocks).values()
        same = all((o.shape, o.stride(), o.storage_offset(), o.dtype) == (t.shape, t.stride(), t.storage_offset(), t.dtype)
                   for o, t in zip(ours, theirs))
        rows.append({"format": geometry.quant.name if geometry.quant else dtype_name(geometry.dtype), "layout": layout,
                     "identical to vLLM": same})
    return rows


def vllm_hybrid_agreement(hybrid: HybridGeometry, layouts: Sequence[str], num_blocks: int = 4
                          ) -> list[dict[str, Any]] | None:
    """Per layout: whether kvlab places every group's layers where vLLM's own planning and
    allocator put them (views and their offsets in the one buffer); None without vLLM."""
    try:
        from kvlab.connector.vllm_views import vllm_hybrid
    except ImportError:
        return None
    rows = []
    for layout in layouts:
        _, theirs = vllm_hybrid(hybrid, layout, num_blocks)
        ours = allocate_hybrid(hybrid, layout, num_blocks).layers
        same = sorted(theirs) == list(ours) and all(
            (ours[n].shape, ours[n].stride(), ours[n].storage_offset(), ours[n].dtype)
            == (theirs[n].shape, theirs[n].stride(), theirs[n].storage_offset(), theirs[n].dtype) for n in theirs)
        rows.append({"model": hybrid.name, "layout": layout, "groups": len(hybrid.groups), "identical to vLLM": same})
    return rows


def vllm_lookalikes(geometry: ModelGeometry, num_blocks: int = 4) -> list[dict[str, Any]] | None:
    """Caches whose views in vLLM's own allocator are the same (shape, strides, offsets) and
    whose bytes are not: an NVFP4 cache and an fp8 one (vLLM stores fp8 as uint8 too) of twice
    the heads and 9/32 the head size; a full-attention and a sliding-window group of one
    hybrid buffer. None without vLLM."""
    try:
        from kvlab.connector.vllm_views import vllm_hybrid, vllm_layer_views
    except ImportError:
        return None

    def signature(views: Any) -> list[tuple]:
        return [(tuple(v.shape), v.stride(), v.storage_offset(), v.untyped_storage().nbytes()) for v in views]

    nvfp4 = geometry.quantized("nvfp4")
    fp8 = geometry.with_(num_kv_heads=2 * geometry.num_kv_heads, head_size=geometry.head_size * 9 // 32, dtype="fp8")
    _, views = vllm_hybrid(HybridGeometry("two attention groups", (KVGroup.attention(geometry, [0]),
                                                                     KVGroup.attention(geometry, [1], window=64))),
                           "LBHNC", num_blocks)
    return [
        {"these views": f"NVFP4, {geometry.num_kv_heads} kv heads of {geometry.head_size}",
         "and these": f"fp8, {fp8.num_kv_heads} kv heads of {fp8.head_size}",
         "identical in vLLM": signature(vllm_layer_views("nvfp4_LBNHC", nvfp4, num_blocks).values())
         == signature(vllm_layer_views("LBNHC", fp8, num_blocks).values())},
        {"these views": "a full-attention group's layer", "and these": "a sliding-window group's layer",
         "identical in vLLM": signature([views[layer_name(0)]]) == signature([views[layer_name(1)]])},
    ]
