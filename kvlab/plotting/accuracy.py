"""Figures of notebook 04: KV round trips, accuracy against the control, connectors side by
side."""

from __future__ import annotations

from typing import Sequence

import matplotlib
import matplotlib.patches
import matplotlib.pyplot as plt
import matplotlib.ticker

from kvlab.experiments.paths import colour as path_colour
from kvlab.plotting.common import _rows_labelled


def roundtrip_figure(summary: Sequence[dict], title: str = "") -> plt.Figure:
    """KV round trips (rows of kvlab.experiments.roundtrip.roundtrip_summary) per model and layout (rows)
    and copy method (columns): bit-exact out of run; grey where the method cannot run here."""
    summary = list(summary)
    lines = list(dict.fromkeys((r["model"], r["layout"]) for r in summary))
    methods = list(dict.fromkeys(r["method"] for r in summary))
    cells = {(r["model"], r["layout"], r["method"]): r for r in summary}
    fig, ax = plt.subplots(figsize=(2.6 + 0.9 * len(methods), 0.8 + 0.22 * len(lines)))
    for i, (model, layout) in enumerate(lines):
        for j, method in enumerate(methods):
            cell = cells.get((model, layout, method))
            ran, exact = (cell["round_trips"], cell["bit_exact"]) if cell else (0, 0)
            colour = "#dddddd" if not ran else ("#2ca02c" if exact == ran else "#d62728")
            ax.add_patch(matplotlib.patches.Rectangle((j, i), 1, 1, color=colour, ec="white"))
            ax.text(j + 0.5, i + 0.5, f"{exact}/{ran}" if ran else "n/a", ha="center", va="center", fontsize=6)
    ax.set_xlim(0, len(methods))
    ax.set_ylim(len(lines), 0)
    ax.set_xticks([j + 0.5 for j in range(len(methods))], methods, fontsize=7)
    ax.set_yticks([i + 0.5 for i in range(len(lines))],
                  [f"{layout} ({model.split('/')[-1].split(' ')[0]})" for model, layout in lines], fontsize=6)
    ax.set_title(title or "KV round trips: bit-exact / run (grey: not available here)", fontsize=9)
    fig.tight_layout()
    return fig


def accuracy_figure(generations: Sequence[dict], perplexity: Sequence[dict], scores: Sequence[dict],
                    title: str = "") -> plt.Figure:
    """Per reuse path: the largest logprob difference against recompute and against vLLM's
    own prefix hit (0 drawn at the axis floor), the share of identical generations, and
    task accuracy +/- stderr."""
    fig, axes = plt.subplots(1, 3, figsize=(12, 0.9 + 0.42 * max(len(generations), 1)), sharey=True)
    names = [r["path"] for r in generations]
    colours = [path_colour(n) for n in names]
    floor = 1e-8
    by_path = {r["path"]: r for r in perplexity}
    for k, (key, marker, label) in enumerate((("max_logprob_diff", "o", "vs recompute"),
                                              ("max_logprob_diff_vs_control", "s", "vs vLLM prefix hit"))):
        values = [max(g[key], by_path[g["path"]][key], floor) for g in generations]
        axes[0].scatter(values, [i + 0.15 * (k - 0.5) for i in range(len(names))], marker=marker, c=colours, label=label)
    axes[0].set_xscale("log")
    axes[0].axvline(floor, color="black", lw=0.6, ls=":")
    axes[0].set_xlabel(f"max |logprob difference| (log; {floor:g} = bitwise equal)")
    axes[0].legend(fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, frameon=False)
    axes[1].barh(range(len(names)), [100 * g["identical_share"] for g in generations], 0.7, color=colours)
    axes[1].set_xlim(0, 105)
    axes[1].set_xlabel("identical greedy generations (%)")
    shown = "flexible-extract" if any(s["filter"] == "flexible-extract" for s in scores) else scores[0]["filter"]
    flexible = {s["path"]: s for s in scores if s["filter"] == shown}
    accuracy = [100 * flexible[n]["accuracy"] for n in names]
    axes[2].barh(range(len(names)), accuracy, 0.7, color=colours,
                 xerr=[100 * flexible[n]["stderr"] for n in names], capsize=3)
    for i, (a, n) in enumerate(zip(accuracy, names)):
        axes[2].text(a + 100 * flexible[n]["stderr"], i,
                     f" {a:.1f}% ± {100 * flexible[n]['stderr']:.1f} (n={int(flexible[n]['n'])})", va="center",
                     fontsize=7)
    axes[2].set_xlim(0, max([5.0] + [a + 100 * flexible[n]["stderr"] for a, n in zip(accuracy, names)]) * 1.4)
    axes[2].set_xlabel(f"task accuracy, {shown} (%, +/- stderr)")
    return _rows_labelled(fig, axes[0], names, title)


def comparison_figure(rows: Sequence[dict], title: str = "") -> plt.Figure:
    """Connectors side by side: time to first token cold and warm (with vLLM's own prefix
    hit as the floor), and the effective retrieve throughput a request sees."""
    rows = list(rows)
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.9 + 0.5 * max(len(rows), 1)), sharey=True)
    names = [r["connector"] for r in rows]
    for i, r in enumerate(rows):
        axes[0].barh(i - 0.2, 1e3 * r["cold_s"], 0.38, color="#bbbbbb")
        if r.get("warm_s") is not None:
            axes[0].barh(i + 0.2, 1e3 * r["warm_s"], 0.38, color=path_colour(r["connector"]))
            axes[0].text(1e3 * r["warm_s"] * 1.05, i + 0.2, f"{1e3 * r['warm_s']:.0f} ms", va="center", fontsize=7)
        axes[0].text(1e3 * r["cold_s"] * 1.05, i - 0.2, f"{1e3 * r['cold_s']:.0f} ms", va="center", fontsize=7)
        axes[0].plot(1e3 * r["floor_s"], i + 0.2, "k|", ms=12)
        gbps = r.get("retrieve_gbps")
        axes[1].barh(i, gbps or 0, 0.6, color=path_colour(r["connector"]))
        if gbps:
            axes[1].text(gbps, i, f" {gbps:.2f} GB/s", va="center", fontsize=7)
    axes[0].set_xscale("log")
    axes[0].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[0].set_xlabel("time to first token (ms, log)\ngrey: cold; colour: warm; |: the engine's own prefix hit")
    axes[1].set_xlabel("retrieve throughput a request sees (GB/s)\nKV bytes / (warm - prefix hit without connector)")
    return _rows_labelled(fig, axes[0], names, title)
