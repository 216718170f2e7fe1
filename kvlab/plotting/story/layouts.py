"""Notebooks 01 and 07: what a transfer touches in each layout, from the segment arithmetic."""

from __future__ import annotations

from typing import Any

from kvlab.cache.layouts import get_layout
from kvlab.plotting.common import as_records, human_bytes
from kvlab.plotting.story.claims import Takeaways, number, span, takeaways


def cross_layer(layout: str) -> bool:
    return get_layout(layout).is_cross_layer


def segments_point(rows: Any, block_size: int | None = None) -> str | None:
    """Copies per-layer and cross-layer layouts need to move the same tokens, from rows of
    kvlab.cache.transfer_cost or sweep (of the first token count and block size unless named)."""
    rows = [r for r in as_records(rows) if number(r.get("segments"))]
    if not rows:
        return None
    block_size = rows[0].get("block_size") if block_size is None else block_size
    rows = [r for r in rows if r["tokens"] == rows[0]["tokens"] and r.get("block_size") == block_size]
    per_layer = [r for r in rows if not cross_layer(r["layout"])]
    cross = [r for r in rows if cross_layer(r["layout"])]
    if not per_layer or not cross:
        return None
    fewer = min(r["segments"] for r in per_layer) / max(r["segments"] for r in cross)
    sized = f", block size {block_size}" if block_size else ""
    return (f"Moving {rows[0]['tokens']:,} tokens ({human_bytes(rows[0]['bytes'])}{sized}) from "
            f"{rows[0].get('block_ids', 'scattered')} blocks "
            f"takes the per-layer layouts {span(r['segments'] for r in per_layer)} copies, the cross-layer ones "
            f"{span(r['segments'] for r in cross)}: {fewer:,.0f}× fewer than the fewest per-layer, "
            f"of {human_bytes(min(r['mean_segment_bytes'] for r in cross))} or more each instead of at most "
            f"{human_bytes(max(r['mean_segment_bytes'] for r in per_layer))}.")


def layout_takeaways(rows: Any) -> Takeaways:
    """Notebook 01: the copies of one transfer at each block size, from kvlab.cache.sweep rows."""
    sizes = dict.fromkeys(r.get("block_size") for r in as_records(rows))
    return takeaways(*(segments_point(rows, size) for size in sizes))


def extension_takeaways(checks: Any, costs: Any, layout: str, method: str) -> Takeaways:
    """Notebook 07: the new ``layout`` and ``method`` in the round-trip checks (rows of
    kvlab.experiments.roundtrip.roundtrip) and in the segment arithmetic (transfer_cost rows:
    every layout at the last token count, the one that cuts a block)."""
    new = [r for r in as_records(checks) if r["layout"] == layout or r["method"] == method]
    exact = (f"{sum(bool(r['exact']) for r in new)} of {len(new)} round trips through the new {layout} layout "
             f"or the new {method} method came back exact." if new else None)
    costs = as_records(costs)
    cut = [r for r in costs if r["tokens"] == costs[-1]["tokens"]] if costs else []
    copies = (f"Moving {cut[0]['tokens']:,} tokens: "
              + ", ".join(f"{r['layout']} {r['segments']:,} copies" for r in cut) + "." if cut else None)
    return takeaways(exact, copies)
