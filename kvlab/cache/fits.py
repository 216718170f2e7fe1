"""Which layouts can hold which KV: an MLA latent or K and V, unquantized, in quantized rows
with their scales inline, or NVFP4 with its scales in regions of each page."""

from __future__ import annotations

from kvlab.cache.geometry import ModelGeometry
from kvlab.cache.layouts import LAYOUTS, Holds, Layout, get_layout


def check_compatible(layout: str | Layout, geometry: ModelGeometry) -> None:
    """Refuse a layout that cannot hold this geometry's KV (e.g. MLA in a K/V-split layout,
    NVFP4 in a layout without its scale regions)."""
    layout = get_layout(layout)
    if not _fits_scales(layout, geometry):
        quant = geometry.quant.name if geometry.quant else f"unquantized {geometry.dtype}"
        raise ValueError(
            f"layout {layout.name} carries {layout.scales or 'no'} scales{' (NVFP4)' * (layout.scales == 'regions')}, "
            f"but {geometry.name} is {quant}; layouts that fit: {compatible_layouts(geometry)}"
        )
    if geometry.is_mla and not _fits_mla(layout):
        raise ValueError(
            f"layout {layout.name} keeps K and V apart, but {geometry.name} is MLA (one latent "
            f"per token); MLA-capable layouts: {[n for n, l in LAYOUTS.items() if _fits_mla(l)]}"
        )
    if not geometry.is_mla and layout.requires is Holds.MLA:
        raise ValueError(
            f"layout {layout.name} is for MLA caches, but {geometry.name} has separate K and V; "
            f"K/V layouts: {[n for n, l in LAYOUTS.items() if l.requires is not Holds.MLA]}"
        )


def _fits_mla(layout: Layout) -> bool:
    return layout.requires is not Holds.KV and (layout.packs_parts or layout.is_tuple)


def _fits_scales(layout: Layout, geometry: ModelGeometry) -> bool:
    """Unquantized KV fits every order but NVFP4's; inline-scale rows the orders that carry
    them (their rows are only wider); NVFP4 only its own."""
    if geometry.quant is None:
        return layout.scales != "regions"
    return layout.scales == ("inline" if geometry.quant.inline else "regions")


def compatible_layouts(geometry: ModelGeometry, chunk_formats: bool = True) -> list[str]:
    """Names of the layouts that can hold this geometry's KV (MLA or K/V, quantized or not)."""
    return [
        name
        for name, layout in LAYOUTS.items()
        if (_fits_mla(layout) if geometry.is_mla else layout.requires is not Holds.MLA)
        and (chunk_formats or not layout.is_chunk_format) and _fits_scales(layout, geometry)
    ]
