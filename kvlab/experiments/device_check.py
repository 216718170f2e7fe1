"""The summary of one ``scripts/device-check`` run: how each step ended, the device test
suite's pass/fail counts (its JUnit file), and the headline ratios of the transfer sweep
(best per-layer against best cross-layer, per model, size and direction; each method's
best). Torch only, like the rest of the device check."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any, Sequence


def junit_counts(junit: Path) -> dict[str, int]:
    """passed / failed / errors / skipped of a pytest JUnit XML file (all zero when missing)."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    if not junit.exists():
        return counts
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), None)
        counts[{"failure": "failed", "error": "errors", "skipped": "skipped", None: "passed"}[outcome]] += 1
    return counts


def headline(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model, token count and direction (scattered blocks to a host buffer): the best
    per-layer and the best cross-layer ratio to the same-run ceiling, and every method's best."""
    ok = [r for r in rows if r.get("status") == "ok" and r.get("block_ids") == "scattered" and r.get("target") == "host"]
    out = []
    for key in sorted({(r["model"], r["tokens"], r["direction"]) for r in ok}):
        group = [r for r in ok if (r["model"], r["tokens"], r["direction"]) == key]
        entry: dict[str, Any] = dict(zip(("model", "tokens", "direction"), key))
        for side, cross in (("per_layer", False), ("cross_layer", True)):
            best = max((r for r in group if r["cross_layer"] == cross), key=lambda r: r["ratio"], default=None)
            if best is not None:
                entry[side] = {k: best[k] for k in ("layout", "method", "ratio", "gbps", "ceiling_gbps", "segments")}
        entry["methods"] = {m: round(max(r["ratio"] for r in group if r["method"] == m), 3)
                            for m in dict.fromkeys(r["method"] for r in group)}
        out.append(entry)
    return out


def newest_run(paths: Sequence[Path]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The run records of JSONL result files, and the rows of each file's newest run that
    measured something (the rows load_results keeps of a file of one machine), reading
    each file once."""
    runs, rows = [], []
    for path in paths:
        try:
            records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not JSONL: {error}") from None
        runs += [r for r in records if r.get("record") == "run"]
        measured = [r for r in records if r.get("record") != "run"]
        rows += [r for r in measured if r.get("run_id") == measured[-1].get("run_id")]
    return runs, rows


def summarize(out: Path, steps: dict[str, dict[str, int]]) -> dict[str, Any]:
    """The summary of a device check whose files are in ``out``; written there as
    device-check-summary.json."""
    runs, transfer_rows = newest_run(sorted(out.glob("02_transfer-*.jsonl")))
    attention = [r for r in newest_run(sorted(out.glob("02_attention-*.jsonl")))[1] if r.get("status") == "ok"]
    summary = {
        "ok": all(s["rc"] == 0 for s in steps.values()),
        "steps": steps,
        "tests": junit_counts(out / "device-tests.xml"),
        "fingerprint": runs[-1] if runs else None,
        "rows": {"transfer": len(transfer_rows), "noisy": sum(bool(r.get("noisy")) for r in transfer_rows),
                 "unavailable": sorted({f"{r['method']}: {r['status']}" for r in transfer_rows
                                        if str(r.get("status", "")).startswith("unavailable")})},
        "headline": headline(transfer_rows),
        "attention_layerwise": [{k: r[k] for k in ("model", "prefix_tokens", "new_tokens", "intensity", "speedup",
                                                   "ideal_speedup")} for r in attention],
    }
    summary["ok"] = summary["ok"] and summary["tests"]["failed"] == summary["tests"]["errors"] == 0
    (out / "device-check-summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a few readable lines."""
    t = summary["tests"]
    lines = [f"device check: {'ok' if summary['ok'] else 'FAILED'}",
             "steps: " + ", ".join(f"{name} rc={s['rc']} {s['seconds']}s" for name, s in summary["steps"].items()),
             f"device tests: {t['passed']} passed, {t['failed']} failed, {t['errors']} errors, {t['skipped']} skipped",
             f"transfer rows: {summary['rows']['transfer']} ({summary['rows']['noisy']} flagged as noise)"]
    for h in summary["headline"]:
        parts = [f"{side} {h[side]['layout']} {h[side]['method']} {h[side]['ratio']:.2f}"
                 for side in ("per_layer", "cross_layer") if side in h]
        lines.append(f"  {h['model']:28s} {h['tokens']:6d} {h['direction']:7s} " + "  ".join(parts))
    for r in summary["attention_layerwise"]:
        lines.append(f"  attention layerwise {r['model']} {r['prefix_tokens']}+{r['new_tokens']} tokens: "
                     f"speedup {r['speedup']:.2f} (ideal {r['ideal_speedup']:.2f}, intensity {r['intensity']:.2f})")
    return "\n".join(lines)
