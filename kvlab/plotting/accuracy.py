"""Figures of notebook 06: accuracy against the control and connectors side by side (its KV
round trips are a table: every cell "n/n" says one thing). Reuse paths and connectors keep
their colours (common.PATH_COLOURS)."""

from __future__ import annotations

import math
from typing import Sequence

import matplotlib
import matplotlib.lines
import matplotlib.pyplot as plt
import matplotlib.ticker

from kvlab.plotting.common import (DEFAULT_WIDTH, GREY, SMALL, dots, figure_width, footnote, ink,
                                   measured, newest_run, one_run, over_own_floor, panels, paper_figure, path_colour, readable,
                                   rows_labelled, signed, wrap)


@paper_figure
def accuracy_figure(generations: Sequence[dict], perplexity: Sequence[dict], scores: Sequence[dict],
                    title: str = "", width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """Per reuse path, from one run (the newest of each table): the largest logprob
    difference against recompute and against vLLM's own prefix hit (symlog: linear around 0,
    so bitwise equal is drawn at 0; where every difference is 0, a sentence under the figure
    says so instead of a panel of zeros), the share of identical generations, and task
    accuracy +/- stderr."""
    generations, perplexity, (scores, title) = newest_run(generations), newest_run(perplexity), one_run(scores, title)
    differences = [max(g[key], p[key]) for g, p in zip(generations, _by_path(generations, perplexity))
                   for key in DIFFERENCES]
    bitwise = not any(differences)
    fig, axes = panels(2 if bitwise else 3, width, 0.9 + 0.32 * max(len(generations), 1), sharey=True)
    names = [r["path"] for r in generations]
    colours = [path_colour(n) for n in names]
    if not bitwise:
        _logprob_differences(axes[0], generations, perplexity, colours)
    axes[-2].barh(range(len(names)), [100 * g["identical_share"] for g in generations], 0.7, color=colours)
    axes[-2].set_xlim(0, 105)
    axes[-2].set_xlabel("identical greedy generations (%)")
    _task_accuracy(fig, axes[-1], names, colours, scores)
    if bitwise:
        footnote(fig, f"Every path's logprobs are bitwise equal to recompute's and to vLLM's own prefix hit's "
                      f"(largest |difference| 0, over {_counted(generations, 'prompts', 'prompt')} and "
                      f"{_counted(perplexity, 'windows', 'perplexity window')}).")
    return rows_labelled(fig, axes, names, readable(title, [*generations, *scores]))


DIFFERENCES = ("max_logprob_diff", "max_logprob_diff_vs_control")


def _by_path(generations: Sequence[dict], perplexity: Sequence[dict]) -> list[dict]:
    """Each generations row's perplexity row (the same path)."""
    by_path = {r["path"]: r for r in perplexity}
    return [by_path[g["path"]] for g in generations]


def _counted(rows: Sequence[dict], key: str, word: str) -> str:
    """'200 prompts', '1-4 windows': the counts ``rows`` record under ``key``."""
    counts = sorted({int(r[key]) for r in rows if measured(r.get(key))})
    span = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return f"{span} {word}{'s' * (counts != [1])}" if counts else f"the {word}s"


LINEAR_BELOW = 1e-6  # logprob differences: the symlog axis is linear below it, so 0 sits at 0


def _logprob_differences(ax: plt.Axes, generations: Sequence[dict], perplexity: Sequence[dict],
                         colours: Sequence[str]) -> None:
    """The largest logprob difference per path on a symlog axis: 0 where bitwise equal, decades above."""
    largest = 0.0
    for key, marker, shift in zip(DIFFERENCES, "os", (-0.075, 0.075)):
        values = [max(g[key], p[key]) for g, p in zip(generations, _by_path(generations, perplexity))]
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
    """Connectors side by side, from one run (the newest in ``rows``): time to first token
    cold and warm as dots on a log axis, each engine's own prefix hit (its floor) a black bar
    on the warm row, and each warm time's note saying how far it sits from that floor (a warm
    time below its floor says so: the retrieve cost is not measurable against it); and the
    effective retrieve throughput a request sees."""
    rows, title = one_run(rows, title, "prompt_tokens")
    fig, axes = panels(2, width, 1.1 + 0.45 * max(len(rows), 1), sharey=True, min_panel_width=3)
    names = [r["connector"] for r in rows]
    warm = [i for i, r in enumerate(rows) if measured(r.get("warm_s"))]
    cold_ms = [1e3 * r["cold_s"] for r in rows]
    warm_ms = [1e3 * rows[i]["warm_s"] for i in warm]
    floors = [1e3 * rows[i]["floor_s"] for i in warm]
    dots(axes[0], [i - 0.2 for i in range(len(rows))], cold_ms, [GREY] * len(rows), [f"{v:.0f} ms" for v in cold_ms])
    dots(axes[0], [i + 0.2 for i in warm], warm_ms, [path_colour(names[i]) for i in warm],
         [over_own_floor(v, f) for v, f in zip(warm_ms, floors)], ends=[max(v, f) for v, f in zip(warm_ms, floors)])
    axes[0].plot([1e3 * r["floor_s"] for r in rows], [i + 0.2 for i in range(len(rows))], "k|", ms=10)
    for i, r in enumerate(rows):
        gbps = r.get("retrieve_gbps")
        if measured(gbps):
            axes[1].barh(i, gbps, 0.6, color=path_colour(r["connector"]))
            axes[1].text(gbps, i, f" {gbps:.2f} GB/s", va="center", fontsize=SMALL)
    inches = min(2.8, 0.6 * figure_width(width))  # a panel's width right of the row labels
    axes[0].set_xlabel(wrap("time to first token (ms, log)\ngrey: cold; colour: warm; |: the engine's own prefix hit",
                            inches))
    axes[1].set_xlabel(wrap("retrieve throughput a request sees (GB/s)\nKV bytes / (warm - prefix hit without "
                            "connector)", inches))
    below = [(names[i], w, f) for i, w, f in zip(warm, warm_ms, floors) if w < f]
    plain = next((1e3 * r["floor_s"] for r in rows if not measured(r.get("warm_s"))), None)
    if below and plain is not None:
        footnote(fig, " ".join(f"{name}'s warm time ({warm:.0f} ms) is below its own engine's prefix hit ({floor:.0f} "
                               f"ms, {signed(floor - plain)} ms against the engine without a connector): {name} "
                               f"slows every request, prefix hits too, and its retrieve cost is lost in that."
                               for name, warm, floor in below))
    return rows_labelled(fig, axes, names, readable(title, rows),
                         room=[max(len(over_own_floor(v, f)) for v, f in zip(warm_ms, floors)) + 1, 10])
