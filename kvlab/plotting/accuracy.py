"""Figures of notebook 04: KV round trips, accuracy against the control, connectors side by
side. Reuse paths and connectors keep their colours (common.PATH_COLOURS)."""

from __future__ import annotations

from typing import Sequence

import matplotlib
import matplotlib.lines
import matplotlib.patches
import matplotlib.pyplot as plt
import matplotlib.ticker

from kvlab.plotting.common import (DEFAULT_WIDTH, GREEN, GREY, LIGHT_GREY, SMALL, VERMILLION, _rows_labelled,
                                   figure_width, panels, paper_figure, path_colour, wrap)
from kvlab.plotting.common import title as figure_title


@paper_figure
def roundtrip_figure(summary: Sequence[dict], title: str = "", width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """KV round trips (rows of kvlab.experiments.roundtrip.roundtrip_summary) per model and layout (rows)
    and copy method (columns): bit-exact out of run; grey where the method cannot run here."""
    summary = list(summary)
    inches = figure_width(width)
    lines = list(dict.fromkeys((r["model"], r["layout"]) for r in summary))
    methods = list(dict.fromkeys(r["method"] for r in summary))
    cells = {(r["model"], r["layout"], r["method"]): r for r in summary}
    fig, ax = plt.subplots(figsize=(inches, 0.9 + 0.16 * len(lines)), layout="constrained")
    for i, (model, layout) in enumerate(lines):
        for j, method in enumerate(methods):
            cell = cells.get((model, layout, method))
            ran, exact = (cell["round_trips"], cell["bit_exact"]) if cell else (0, 0)
            colour = LIGHT_GREY if not ran else (GREEN if exact == ran else VERMILLION)
            ax.add_patch(matplotlib.patches.Rectangle((j, i), 1, 1, facecolor=colour, edgecolor="white"))
            ax.text(j + 0.5, i + 0.5, f"{exact}/{ran}" if ran else "n/a", ha="center", va="center", fontsize=SMALL)
    ax.set_xlim(0, len(methods))
    ax.set_ylim(len(lines), 0)
    ax.xaxis.tick_top()
    ax.set_xticks([j + 0.5 for j in range(len(methods))], methods)
    ax.set_yticks([i + 0.5 for i in range(len(lines))],
                  [f"{layout} ({model.split('/')[-1].split(' ')[0]})" for model, layout in lines])
    ax.tick_params(length=0)
    figure_title(fig, title or "KV round trips: bit-exact / run (grey: not available here)")
    return fig


@paper_figure
def accuracy_figure(generations: Sequence[dict], perplexity: Sequence[dict], scores: Sequence[dict],
                    title: str = "", width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """Per reuse path: the largest logprob difference against recompute and against vLLM's
    own prefix hit (0 drawn at the axis floor), the share of identical generations, and
    task accuracy +/- stderr."""
    fig, axes = panels(3, width, 0.9 + 0.32 * max(len(generations), 1), sharey=True)
    names = [r["path"] for r in generations]
    colours = [path_colour(n) for n in names]
    floor = 1e-8
    by_path = {r["path"]: r for r in perplexity}
    markers = []
    for k, (key, marker, label) in enumerate((("max_logprob_diff", "o", "vs recompute"),
                                              ("max_logprob_diff_vs_control", "s", "vs vLLM prefix hit"))):
        values = [max(g[key], by_path[g["path"]][key], floor) for g in generations]
        axes[0].scatter(values, [i + 0.15 * (k - 0.5) for i in range(len(names))], marker=marker, c=colours, s=14)
        markers.append(matplotlib.lines.Line2D([], [], ls="", marker=marker, color=GREY, label=label))
    axes[0].set_xscale("log")
    axes[0].axvline(floor, color="black", lw=0.6, ls=":")
    axes[0].set_xlabel(wrap(f"max |logprob difference| (log; {floor:g} = bitwise equal)", 2.2))
    axes[0].legend(handles=markers, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=2, handletextpad=0.2,
                   columnspacing=0.8)
    axes[1].barh(range(len(names)), [100 * g["identical_share"] for g in generations], 0.7, color=colours)
    axes[1].set_xlim(0, 105)
    axes[1].set_xlabel("identical greedy generations (%)")
    shown = "flexible-extract" if any(s["filter"] == "flexible-extract" for s in scores) else scores[0]["filter"]
    flexible = {s["path"]: s for s in scores if s["filter"] == shown}
    accuracy = [100 * flexible[n]["accuracy"] for n in names]
    stderr = [100 * flexible[n]["stderr"] for n in names]
    axes[2].barh(range(len(names)), accuracy, 0.7, color=colours, xerr=stderr, capsize=2,
                 error_kw={"lw": 0.8})
    notes = [f" {a:.1f}% ± {e:.1f} (n={int(flexible[n]['n'])})" for a, e, n in zip(accuracy, stderr, names)]
    for i, (a, e, note) in enumerate(zip(accuracy, stderr, notes)):
        axes[2].text(a + e, i, note, va="center", fontsize=SMALL)
    axes[2].set_xlim(0, max([5.0] + [a + e for a, e in zip(accuracy, stderr)]) * 1.02)
    axes[2].set_xlabel(wrap(f"task accuracy, {shown} (%, +/- stderr)", 2.2))
    return _rows_labelled(fig, axes, names, title, room=[0, 0, max(map(len, notes), default=0)])


@paper_figure
def comparison_figure(rows: Sequence[dict], title: str = "", width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """Connectors side by side: time to first token cold and warm (with vLLM's own prefix
    hit as the floor), and the effective retrieve throughput a request sees."""
    rows = list(rows)
    fig, axes = panels(2, width, 1.1 + 0.45 * max(len(rows), 1), sharey=True, min_panel_width=3)
    names = [r["connector"] for r in rows]
    for i, r in enumerate(rows):
        axes[0].barh(i - 0.2, 1e3 * r["cold_s"], 0.38, color=LIGHT_GREY)
        if r.get("warm_s") is not None:
            axes[0].barh(i + 0.2, 1e3 * r["warm_s"], 0.38, color=path_colour(r["connector"]))
            axes[0].text(1e3 * r["warm_s"] * 1.05, i + 0.2, f"{1e3 * r['warm_s']:.0f} ms", va="center", fontsize=SMALL)
        axes[0].text(1e3 * r["cold_s"] * 1.05, i - 0.2, f"{1e3 * r['cold_s']:.0f} ms", va="center", fontsize=SMALL)
        axes[0].plot(1e3 * r["floor_s"], i + 0.2, "k|", ms=10)
        gbps = r.get("retrieve_gbps")
        axes[1].barh(i, gbps or 0, 0.6, color=path_colour(r["connector"]))
        if gbps:
            axes[1].text(gbps, i, f" {gbps:.2f} GB/s", va="center", fontsize=SMALL)
    axes[0].set_xscale("log")
    axes[0].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[0].set_xlabel(wrap("time to first token (ms, log)\ngrey: cold; colour: warm; |: the engine's own prefix hit",
                            2.8, 8))
    axes[1].set_xlabel(wrap("retrieve throughput a request sees (GB/s)\nKV bytes / (warm - prefix hit without "
                            "connector)", 2.8, 8))
    return _rows_labelled(fig, axes, names, title, room=[8, 10])
