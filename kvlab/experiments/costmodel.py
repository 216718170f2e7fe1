"""A two-term cost model of a KV transfer: a fixed cost per segment plus bytes over bandwidth.

    time = segments x per_segment_s + bytes / bandwidth

fitted per hardware, direction and method from benchmark rows. Two numbers explain most
of what separates per-layer from cross-layer layouts, and they answer the practical
questions: from which segment size on does a per-layer layout stop costing more than a
cross-layer one, and what does an LMCache chunk gain from cross-layer blocks?
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

from kvlab.cache.geometry import ModelGeometry
from kvlab.cache.segments import transfer_cost


@dataclass(frozen=True)
class CostFit:
    """``time = segments * per_segment_s + bytes / bandwidth`` for one hardware, direction, method."""

    hardware: str
    direction: str
    method: str
    per_segment_s: float
    bandwidth: float  # bytes per second
    rows: int
    mean_abs_error: float  # relative, over the rows it was fitted on

    def predict(self, segments: float, nbytes: float) -> float:
        return segments * self.per_segment_s + nbytes / self.bandwidth

    def break_even_segment_bytes(self, num_layers: int, tolerance: float = 0.1) -> float:
        """Per-layer segment size from which a per-layer layout costs at most ``tolerance``
        more than the cross-layer layout, whose segments are ``num_layers`` times larger."""
        slack = 1 - (1 + tolerance) / num_layers
        if slack <= 0 or self.per_segment_s == 0:
            return 0.0
        return self.per_segment_s * self.bandwidth * slack / tolerance

    def describe(self) -> dict[str, Any]:
        return {
            "hardware": self.hardware, "direction": self.direction, "method": self.method,
            "per_segment_us": self.per_segment_s * 1e6, "bandwidth_gbps": self.bandwidth / 1e9,
            "rows": self.rows, "mean_abs_error_pct": 100 * self.mean_abs_error,
        }


def _usable(row: dict[str, Any]) -> bool:
    return row.get("status") == "ok" and row.get("kind", "transfer") == "transfer" and "segments" in row


def fit(rows: Iterable[dict[str, Any]], min_rows: int = 3) -> list[CostFit]:
    """Fit every (hardware, direction, method) with at least ``min_rows`` measured rows.

    Least squares on relative error (each row divided by its own time), so small and
    large transfers count alike; a coefficient that would come out negative is dropped.
    """
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for row in rows:
        if _usable(row):
            groups.setdefault((row.get("hardware") or "?", row["direction"], row["method"]), []).append(row)
    fits = []
    for (hardware, direction, method), group in sorted(groups.items()):
        if len(group) < min_rows:
            continue
        x = torch.tensor([[r["segments"], r["bytes"]] for r in group], dtype=torch.float64)
        t = torch.tensor([r["seconds"] for r in group], dtype=torch.float64)
        coef = _nonnegative_lstsq(x / t[:, None], torch.ones_like(t))
        per_segment, per_byte = (float(c) for c in coef)
        predicted = x @ coef
        error = float(((predicted - t).abs() / t).mean())
        fits.append(CostFit(hardware, direction, method, per_segment, 1 / per_byte if per_byte > 0 else float("inf"),
                            len(group), error))
    return fits


def _nonnegative_lstsq(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    coef = torch.linalg.lstsq(a, b[:, None]).solution.flatten()
    if (coef >= 0).all():
        return coef
    best = None
    for keep in range(a.shape[1]):  # one term only: the better of the two
        c = torch.zeros_like(coef)
        c[keep] = max(0.0, float(torch.linalg.lstsq(a[:, keep:keep + 1], b[:, None]).solution))
        residual = float(((a @ c - b) ** 2).sum())
        if best is None or residual < best[0]:
            best = (residual, c)
    return best[1]


def predictions(rows: Iterable[dict[str, Any]], fits: Sequence[CostFit]) -> list[dict[str, Any]]:
    """Each measured row with the model's prediction and its relative error."""
    by_key = {(f.hardware, f.direction, f.method): f for f in fits}
    out = []
    for row in rows:
        model = by_key.get((row.get("hardware") or "?", row.get("direction"), row.get("method")))
        if model is None or not _usable(row):
            continue
        predicted = model.predict(row["segments"], row["bytes"])
        out.append({**row, "predicted_s": predicted, "error": (predicted - row["seconds"]) / row["seconds"]})
    return out


def chunk_gain(fits: Sequence[CostFit], geometries: Sequence[ModelGeometry], tokens: int = 256,
               per_layer: str = "LBHNC", cross_layer: str = "BLHNC") -> list[dict[str, Any]]:
    """What moving one ``tokens``-token chunk (scattered blocks) costs per-layer and
    cross-layer under each fitted model, and the gain of cross-layer."""
    out = []
    for geometry in geometries:
        costs = {name: transfer_cost(name, geometry, tokens) for name in (per_layer, cross_layer)}
        for f in fits:
            t_pl = f.predict(costs[per_layer]["segments"], costs[per_layer]["bytes_moved"])
            t_x = f.predict(costs[cross_layer]["segments"], costs[cross_layer]["bytes_moved"])
            out.append({
                "model": geometry.name, "hardware": f.hardware, "direction": f.direction, "method": f.method,
                "tokens": tokens, "bytes": costs[per_layer]["bytes_moved"],
                "per_layer_segments": costs[per_layer]["segments"], "cross_layer_segments": costs[cross_layer]["segments"],
                "per_layer_s": t_pl, "cross_layer_s": t_x, "gain": t_pl / t_x,
            })
    return out
