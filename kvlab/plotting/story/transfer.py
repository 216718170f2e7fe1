"""Notebook 02: transfer timing against the same-run copy ceiling, the cost model fitted to
it, and layerwise loading. Ratios carry their interquartile range over the repeats, a
speed-up its bootstrap interval; a comparison is claimed only where the ranges part."""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from kvlab.plotting.common import as_records, short_hardware
from kvlab.plotting.story.claims import Prose, Takeaways, number, prose, quoted, span, takeaways
from kvlab.plotting.story.layouts import cross_layer

CLOSE_FIT = 0.15  # a fit whose median |relative error| stays below this "fits closely"


def short_model(model: str) -> str:
    """A model's name without its organisation."""
    return model.split("/")[-1]


def _worse_direction(rows: list[dict]) -> dict[tuple[str, str], dict]:
    """Each (layout, method)'s row in its worse direction (the lower ratio to the ceiling)."""
    worse: dict[tuple[str, str], dict] = {}
    for r in rows:
        key = (r["layout"], r["method"])
        if key not in worse or r["ratio"] < worse[key]["ratio"]:
            worse[key] = r
    return worse


def _iqr(row: dict) -> tuple[float, float]:
    return row.get("ratio_q1", row["ratio"]), row.get("ratio_q3", row["ratio"])


def ratio_text(row: dict) -> str:
    """``0.83 (quartiles 0.80–0.87 over 15 repeats)``."""
    low, high = _iqr(row)
    return f"{row['ratio']:.2f} (quartiles {low:.2f}–{high:.2f} over {row.get('repeats', '?')} repeats)"


def _headline(rows: Any, model: str, tokens: int) -> list[dict]:
    """Bench rows of ``model`` at ``tokens``, scattered to host memory, of one machine's run."""
    rows = [r for r in as_records(rows) if r.get("status") == "ok" and r["model"] == model and r["tokens"] == tokens
            and r.get("block_ids") == "scattered" and r.get("target") == "host" and number(r.get("ratio"))]
    return [r for r in rows if r.get("run_id") == rows[0].get("run_id")] if rows else []


def _best_pair(worse: dict[tuple[str, str], dict]) -> dict[bool, dict | None]:
    return {cross: max((r for (layout, _), r in worse.items() if cross_layer(layout) == cross),
                       key=lambda r: r["ratio"], default=None) for cross in (True, False)}


def best_layouts_point(rows: Any, model: str, tokens: int) -> str | None:
    """The best cross-layer and per-layer transfer's ratio to the ceiling, each in its worse
    direction, and whether this run tells them apart (their quartile ranges part)."""
    headline = _headline(rows, model, tokens)
    if not headline:
        return None
    best = _best_pair(_worse_direction(headline))
    cross, layer = best[True], best[False]
    if cross is None or layer is None:
        return None
    (c_low, c_high), (l_low, l_high) = _iqr(cross), _iqr(layer)
    verdict = ("the cross-layer one is the faster beyond the spread" if c_low > l_high else
               "the per-layer one is the faster beyond the spread" if l_low > c_high else
               "their quartile ranges overlap, so this run cannot tell the two apart")
    return (f"Moving {tokens:,} tokens of {short_model(model)}, the best cross-layer transfer ({cross['layout']}, "
            f"{cross['method']}) reaches {ratio_text(cross)} of the copy ceiling, the best per-layer one "
            f"({layer['layout']}, {layer['method']}) {ratio_text(layer)}, each in its worse direction: {verdict} "
            f"{quoted(headline)}.")


def method_gain_point(rows: Any, model: str, tokens: int) -> str | None:
    """Per copy method, cross-layer's best ratio over per-layer's (each in its worse
    direction): where issuing one copy per segment makes cross-layer pay, and where a
    batched copy erases the difference."""
    headline = _headline(rows, model, tokens)
    worse = _worse_direction(headline)
    parts = []
    for method in dict.fromkeys(method for _, method in worse):
        best = _best_pair({key: r for key, r in worse.items() if key[1] == method})
        cross, layer = best[True], best[False]
        if cross is None or layer is None:
            continue
        (c_low, c_high), (l_low, l_high) = _iqr(cross), _iqr(layer)
        told = "" if c_low > l_high or l_low > c_high else ", within the spread"
        parts.append(f"`{method}` {cross['ratio'] / layer['ratio']:.2f}×{told}")
    if not parts:
        return None
    return (f"Cross-layer's best ratio over per-layer's, per copy method: {', '.join(parts)} "
            f"(above 1: cross-layer faster) {quoted(headline)}.")


def copies_point(rows: Any, model: str, tokens: int) -> str | None:
    headline = _headline(rows, model, tokens)
    segments = {cross: [r["segments"] for r in headline if cross_layer(r["layout"]) == cross] for cross in (True, False)}
    if not segments[True] or not segments[False]:
        return None
    return (f"The same bytes take per-layer layouts {span(segments[False])} copies and cross-layer "
            f"ones {span(segments[True])}.")


def layerwise_point(rows: Any) -> str | None:
    """Where loading layer by layer beat loading first: only where a speed-up's interval
    clears 1 (rows that kept no interval support no such claim)."""
    rows = [r for r in as_records(rows) if number(r.get("speedup"))]
    if not rows:
        return None
    best = max(rows, key=lambda r: r["speedup"])
    bounded = [r for r in rows if number(r.get("speedup_low"))]
    faster = [r for r in bounded if r["speedup_low"] > 1]
    slower = [r for r in bounded if r["speedup_high"] < 1]
    if not bounded:
        where = "these rows kept no interval, so this run cannot say where it beat loading first"
    else:
        where = (f"beyond its bootstrap interval it beat loading first in {len(faster)} of {len(bounded)} settings"
                 + (f" (compute intensity {span((_intensity(r) for r in faster), digits=2)})" if faster else "")
                 + f" and lost in {len(slower)}")
    interval = (f" (95% bootstrap interval {best['speedup_low']:.2f}–{best['speedup_high']:.2f})"
                if number(best.get("speedup_low")) else "")
    return (f"Layerwise loading: at best {best['speedup']:.2f}×{interval} ({short_model(best['model'])}, "
            f"{best['tokens']:,} tokens, compute intensity {_intensity(best):.2g}); {where} {quoted(rows)}.")


def _intensity(row: dict) -> float:
    """The compute intensity a row reached (its stand-in's whole matmuls), else the one it asked for."""
    return row["reached_intensity"] if number(row.get("reached_intensity")) else row["intensity"]


def transfer_takeaways(rows: Any, model: str, tokens: int, layer_rows: Any = None) -> Takeaways:
    """Notebook 02: the best per-layer and cross-layer ratio to the copy ceiling for ``tokens``
    tokens of ``model`` (bench rows of one run, scattered blocks to host memory), what each
    copy method makes of the difference, the copies, and the layerwise speed-up (rows of
    one run of run_pipeline_sweep)."""
    return takeaways(best_layouts_point(rows, model, tokens), method_gain_point(rows, model, tokens),
                     copies_point(rows, model, tokens), layerwise_point(layer_rows))


def fit_reading(predicted: Any) -> Prose:
    """How well the two-number cost model fits each method (rows of costmodel.predictions):
    "closely" only below :data:`CLOSE_FIT` median |relative error|."""
    rows = [r for r in as_records(predicted) if number(r.get("error"))]
    errors: dict[str, list[float]] = {}
    for r in rows:
        errors.setdefault(r["method"], []).append(abs(r["error"]))
    if not errors:
        return prose(None)
    median = {method: statistics.median(e) for method, e in errors.items()}
    close = [m for m, e in median.items() if e <= CLOSE_FIT]
    loose = [m for m, e in median.items() if e > CLOSE_FIT]

    def listed(methods: Sequence[str]) -> str:
        return ", ".join(f"`{m}` ({100 * median[m]:.0f}%)" for m in methods)

    return prose(
        f"Median |relative error| of the two-number model per method, over {len(rows)} rows "
        f"{quoted(rows)}:",
        f"it fits {listed(close)} closely (at most {CLOSE_FIT:.0%})." if close else
        f"it fits no method within {CLOSE_FIT:.0%}.",
        f"It misfits {listed(loose)}: a method that does not issue one copy per segment (`gather`: one batched "
        "index copy per backing tensor; `compiled`: one fused kernel over the run table) costs what its tensors "
        "and index shape cost, not the segment count linearly, so its fitted per-segment cost and bandwidth are "
        "averages over layouts rather than a mechanism, and its break-even size below is rough." if loose else None)


def break_even_reading(fits: Sequence[Any], num_layers: int, tolerance: float = 0.1) -> Prose:
    """Where per-layer comes within ``tolerance`` of cross-layer, per fitted machine, method
    and direction (costmodel.CostFit)."""
    parts = [f"{short_hardware(f.hardware)} `{f.method}` {f.direction} "
             f"{f.break_even_segment_bytes(num_layers, tolerance) / 1024:,.0f} KiB" for f in fits]
    return prose(f"The vertical lines mark the per-layer segment size from which per-layer comes within "
                 f"{tolerance:.0%} of cross-layer ({num_layers} layers):",
                 "; ".join(parts) + "." if parts else None)
