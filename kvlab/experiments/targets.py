"""The CPU copy engines' targets: what share of the same-run ceiling each should reach,
judged per run from sweep rows (kvlab.experiments.sweep), and a table of the verdicts."""

from __future__ import annotations

from typing import Any, Sequence

# What the CPU copy engines should reach, as a share of the same-run ceiling, judged by the
# worse of offload and load (Llama-3.1-8B bf16, 1024 tokens, scattered blocks: the ceiling profile).
CPU_TARGETS = {"cross-layer": 0.95, "per-layer": 0.9, "LHBNC": 0.7}
# A chunk of another layout, converted as it moves, at the memory's pace (the conversions
# profile): each pair's best method in its worse direction.
CONVERSION_TARGET = 0.9


def ceiling_targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per run and per target: the best method's worse direction, against torch's copy
    (``ratio``) and against the STREAM-style native copy (``native_ratio``), and whether
    the target is met."""
    ok = [r for r in rows if r.get("status") == "ok" and r.get("target") == "host"]
    out = []
    for run_id in dict.fromkeys(r["run_id"] for r in ok):
        worse: dict[tuple[str, str], dict[str, Any]] = {}
        for r in (r for r in ok if r["run_id"] == run_id):
            key = (r["layout"], r["method"])
            if key not in worse or r["ratio"] < worse[key]["ratio"]:
                worse[key] = r
        groups = {"cross-layer": [r for r in worse.values() if r["cross_layer"]],
                  "per-layer": [r for r in worse.values() if not r["cross_layer"]],
                  "LHBNC": [r for r in worse.values() if r["layout"] == "LHBNC"]}
        for name, group in groups.items():
            if group:
                best = max(group, key=lambda r: r["ratio"])
                out.append({"hardware": best.get("hardware", ""), "run_id": run_id, "target": name, "goal": CPU_TARGETS[name], "layout": best["layout"],
                            "method": best["method"], "direction": best["direction"], "ratio": best["ratio"],
                            "native_ratio": best.get("native_ratio"), "ceiling_gbps": best["ceiling_gbps"],
                            "native_ceiling_gbps": best.get("native_ceiling_gbps"),
                            "met": best["ratio"] >= CPU_TARGETS[name]})
    return out


def format_targets(targets: Sequence[dict[str, Any]]) -> str:
    lines = [f"{'run':12s} {'target':12s} {'goal':>5s} {'best (worse direction)':34s} {'ratio':>6s} "
             f"{'vs memcpy':>9s} {'ceiling':>8s} {'memcpy':>7s}  met"]
    for t in targets:
        native = f"{t['native_ratio']:9.2f}" if t["native_ratio"] is not None else f"{'-':>9s}"
        memcpy = f"{t['native_ceiling_gbps']:7.2f}" if t["native_ceiling_gbps"] is not None else f"{'-':>7s}"
        lines.append(f"{t['run_id']:12s} {t['target']:12s} {t['goal']:5.2f} "
                     f"{t['layout'] + ' ' + t['method'] + ' (' + t['direction'] + ')':34s} {t['ratio']:6.2f} {native} "
                     f"{t['ceiling_gbps']:8.2f} {memcpy}  {'yes' if t['met'] else 'NO'}")
    return "\n".join(lines)
