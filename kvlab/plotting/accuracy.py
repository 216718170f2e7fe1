"""Figures of notebook 04: KV round trips, accuracy against the control, connectors side by
side. Reuse paths and connectors keep their colours (common.PATH_COLOURS)."""

from __future__ import annotations

import math
from typing import Sequence

import matplotlib
import matplotlib.lines
import matplotlib.patches
import matplotlib.pyplot as plt
import matplotlib.ticker

from kvlab.plotting.common import (DEFAULT_WIDTH, GREEN, GREY, LIGHT_GREY, SMALL, VERMILLION, _rows_labelled, dots,
                                   figure_width, ink, model_name, panels, paper_figure, path_colour, readable, wrap)
from kvlab.plotting.common import title as figure_title


@paper_figure
def roundtrip_figure(summary: Sequence[dict], title: str = "", width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """KV round trips (rows of kvlab.experiments.roundtrip.roundtrip_summary) per layout (rows,
    grouped by model, named on the right) and copy method (columns): bit-exact out of run;
    grey where the method cannot run here, and a method that ran for no layout named in
    the title rather than given a grey column."""
    summary = list(summary)
    inches = figure_width(width)
    lines = list(dict.fromkeys((r["model"], r["layout"]) for r in summary))
    methods = list(dict.fromkeys(r["method"] for r in summary))
    ran = [m for m in methods if any(r["round_trips"] for r in summary if r["method"] == m)]
    cells = {(r["model"], r["layout"], r["method"]): r for r in summary}
    fig, ax = plt.subplots(figsize=(inches, 0.9 + 0.14 * len(lines)), layout="constrained")
    for i, (model, layout) in enumerate(lines):
        for j, method in enumerate(ran):
            cell = cells.get((model, layout, method))
            runs, exact = (int(cell["round_trips"]), int(cell["bit_exact"])) if cell else (0, 0)
            colour = LIGHT_GREY if not runs else (GREEN if exact == runs else VERMILLION)
            ax.add_patch(matplotlib.patches.Rectangle((j, i), 1, 1, facecolor=colour, edgecolor="white"))
            ax.text(j + 0.5, i + 0.5, f"{exact}/{runs}" if runs else "n/a", ha="center", va="center", fontsize=SMALL)
    ax.set_xlim(0, len(ran))
    ax.set_ylim(len(lines), 0)
    ax.xaxis.tick_top()
    ax.set_xticks([j + 0.5 for j in range(len(ran))], ran)
    ax.set_yticks([i + 0.5 for i in range(len(lines))], [layout for _, layout in lines])
    models = [model for model, _ in lines]
    starts = [i for i, model in enumerate(models) if i == 0 or model != models[i - 1]]
    for start in starts[1:]:
        ax.axhline(start, color="black", lw=0.8)
    right = ax.secondary_yaxis("right")
    right.set_yticks([(start + end) / 2 for start, end in zip(starts, starts[1:] + [len(lines)])],
                     [model_name(models[start]) for start in starts])
    plt.setp(right.get_yticklabels(), rotation=-90, va="center")
    for axis in (ax, right):
        axis.tick_params(length=0)
    fig.get_layout_engine().execute(fig)
    if ran and max(map(len, ran)) * 0.6 * SMALL > ax.get_window_extent().width * 72 / fig.dpi / len(ran):
        ax.tick_params(axis="x", labelrotation=30)  # method names wider than their column
        plt.setp(ax.get_xticklabels(), ha="left", rotation_mode="anchor")
    idle = [m for m in methods if m not in ran]
    figure_title(fig, (title or "KV round trips: bit-exact / run; grey: cannot run here")
                 + (f" (nor can {', '.join(idle)})" if idle else ""))
    return fig


@paper_figure
def accuracy_figure(generations: Sequence[dict], perplexity: Sequence[dict], scores: Sequence[dict],
                    title: str = "", width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """Per reuse path: the largest logprob difference against recompute and against vLLM's
    own prefix hit (symlog: linear around 0, so bitwise equal is drawn at 0), the share of
    identical generations, and task accuracy +/- stderr."""
    fig, axes = panels(3, width, 0.9 + 0.32 * max(len(generations), 1), sharey=True)
    names = [r["path"] for r in generations]
    colours = [path_colour(n) for n in names]
    _logprob_differences(axes[0], generations, perplexity, colours)
    axes[1].barh(range(len(names)), [100 * g["identical_share"] for g in generations], 0.7, color=colours)
    axes[1].set_xlim(0, 105)
    axes[1].set_xlabel("identical greedy generations (%)")
    _task_accuracy(fig, axes[2], names, colours, scores)
    return _rows_labelled(fig, axes, names, readable(title, [*generations, *scores]))


LINEAR_BELOW = 1e-6  # logprob differences: the symlog axis is linear below it, so 0 sits at 0


def _logprob_differences(ax: plt.Axes, generations: Sequence[dict], perplexity: Sequence[dict],
                         colours: Sequence[str]) -> None:
    """The largest logprob difference per path on a symlog axis: 0 where bitwise equal, decades above."""
    by_path = {r["path"]: r for r in perplexity}
    largest = 0.0
    for key, marker, shift in (("max_logprob_diff", "o", -0.075), ("max_logprob_diff_vs_control", "s", 0.075)):
        values = [max(g[key], by_path[g["path"]][key]) for g in generations]
        largest = max(largest, *values)
        ax.scatter(values, [i + shift for i in range(len(values))], marker=marker, c=colours, s=14, zorder=3)
    top = max(0, math.ceil(math.log10(largest))) if largest > 0 else 0
    ax.set_xscale("symlog", linthresh=LINEAR_BELOW)
    ax.set_xlim(-0.4 * LINEAR_BELOW, 10.0 ** top)
    ax.set_xticks([0] + [10.0 ** k for k in range(top, round(math.log10(LINEAR_BELOW)), -2)])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel(wrap(f"max |logprob difference|\n0: bitwise equal; log above {LINEAR_BELOW:g}", 2.2))
    markers = [matplotlib.lines.Line2D([], [], ls="", marker=marker, color=GREY, label=label)
               for marker, label in (("o", "vs recompute"), ("s", "vs vLLM prefix hit"))]
    ax.legend(handles=markers, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=2, handletextpad=0.2,
              columnspacing=0.8)


def _task_accuracy(fig: plt.Figure, ax: plt.Axes, names: Sequence[str], colours: Sequence[str],
                   scores: Sequence[dict]) -> None:
    """Task accuracy +/- stderr per path on 0-100 %, each number inside its bar where it fits
    (in the ink that reads on the bar) and right of the whisker where not; the sample count
    once in the label when every path has the same."""
    shown = "flexible-extract" if any(s["filter"] == "flexible-extract" for s in scores) else scores[0]["filter"]
    picked = {s["path"]: s for s in scores if s["filter"] == shown}
    accuracy = [100 * picked[n]["accuracy"] for n in names]
    stderr = [100 * picked[n]["stderr"] for n in names]
    counts = [int(picked[n]["n"]) for n in names]
    ax.barh(range(len(names)), accuracy, 0.7, color=colours, xerr=stderr, capsize=2, error_kw={"lw": 0.8})
    ax.set_xlim(0, 100)
    one = len(set(counts)) == 1
    ax.set_xlabel(wrap(f"task accuracy, {shown} (%)\n± stderr" + (f", n = {counts[0]}" if one else ""), 2.2))
    fig.get_layout_engine().execute(fig)
    per_point = 100 / (ax.get_window_extent().width * 72 / fig.dpi)
    for i, (a, e, n, colour) in enumerate(zip(accuracy, stderr, counts, colours)):
        note = f"{a:.1f} ± {e:.1f}" + ("" if one else f" (n={n})")
        wide = (len(note) * 0.6 * SMALL + 4) * per_point
        if wide <= a - e:
            ax.text(1, i, note, va="center", fontsize=SMALL, color=ink(colour))
        else:
            ax.text(a + e + 1, i, note, va="center", fontsize=SMALL)


@paper_figure
def comparison_figure(rows: Sequence[dict], title: str = "", width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """Connectors side by side: time to first token cold and warm as dots on a log axis (with
    vLLM's own prefix hit as the floor), and the effective retrieve throughput a request sees."""
    rows = list(rows)
    fig, axes = panels(2, width, 1.1 + 0.45 * max(len(rows), 1), sharey=True, min_panel_width=3)
    names = [r["connector"] for r in rows]
    warm = [i for i, r in enumerate(rows) if _measured(r.get("warm_s"))]
    cold_ms = [1e3 * r["cold_s"] for r in rows]
    warm_ms = [1e3 * rows[i]["warm_s"] for i in warm]
    floors = [1e3 * rows[i]["floor_s"] for i in warm]
    dots(axes[0], [i - 0.2 for i in range(len(rows))], cold_ms, [GREY] * len(rows), [f"{v:.0f} ms" for v in cold_ms])
    dots(axes[0], [i + 0.2 for i in warm], warm_ms, [path_colour(names[i]) for i in warm],
         [f"{v:.0f} ms" for v in warm_ms], ends=[max(v, f) for v, f in zip(warm_ms, floors)])
    axes[0].plot([1e3 * r["floor_s"] for r in rows], [i + 0.2 for i in range(len(rows))], "k|", ms=10)
    for i, r in enumerate(rows):
        gbps = r.get("retrieve_gbps")
        if _measured(gbps):
            axes[1].barh(i, gbps, 0.6, color=path_colour(r["connector"]))
            axes[1].text(gbps, i, f" {gbps:.2f} GB/s", va="center", fontsize=SMALL)
    axes[0].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    inches = min(2.8, 0.6 * figure_width(width))  # a panel's width right of the row labels
    axes[0].set_xlabel(wrap("time to first token (ms, log)\ngrey: cold; colour: warm; |: the engine's own prefix hit",
                            inches))
    axes[1].set_xlabel(wrap("retrieve throughput a request sees (GB/s)\nKV bytes / (warm - prefix hit without "
                            "connector)", inches))
    return _rows_labelled(fig, axes, names, readable(title, rows), room=[8, 10])


def _measured(value) -> bool:
    """A number was recorded (not None, not a table's NaN)."""
    return value is not None and value == value
