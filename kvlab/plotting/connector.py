"""Figures of notebook 03: the layerwise hooks' timeline, time to first token, per-layer
against cross-layer hand-over, the connector as vLLM deploys it, and a prefix through a
network tier per layout. Connectors keep their paths' colours (common.PATH_COLOURS)."""

from __future__ import annotations

import re
from typing import Sequence

import matplotlib.lines
import matplotlib.patches
import matplotlib.pyplot as plt

from kvlab.experiments.paths import Reuse
from kvlab.plotting.common import (BLUE, CROSS_LAYER, DEFAULT_WIDTH, GREEN, PATH_COLOURS, PER_LAYER, SMALL, VERMILLION,
                                   _rows_labelled, connector_colour, dots, figure_width, panels, paper_figure,
                                   readable, unique_legend, wrap)
from kvlab.plotting.common import title as figure_title

_HOOK_EVENTS = {"load_wait": (VERMILLION, "wait_for_layer_load"), "attention": (BLUE, "attention"),
                "save": (GREEN, "save_kv_layer")}
LAYER_KINDS = [matplotlib.patches.Patch(color=PER_LAYER, label="per-layer"),
               matplotlib.patches.Patch(color=CROSS_LAYER, label="cross-layer")]


def _row_inches(labels: Sequence[str], width: str | float, least: float) -> float:
    """Inches per row of a figure whose rows _rows_labelled labels: ``least``, more where a
    label wraps (to a third of the figure's width) to more lines than that holds."""
    lines = max((wrap(label, figure_width(width) / 3, SMALL).count("\n") + 1 for label in labels), default=1)
    return max(least, 0.12 * lines + 0.06)


@paper_figure
def hooks_timeline(rows: Sequence[dict], title: str = "", width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """One line per layer over time: load waits, attention and save_kv_layer calls, with a
    tick where each save was issued. ``rows`` are kvlab.hooks.LayerTrace rows."""
    inches = figure_width(width)
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    fig, ax = plt.subplots(figsize=(inches, 1.2 + 0.14 * max(len(layers), 1)), layout="constrained")
    for event, (colour, label) in _HOOK_EVENTS.items():
        picked = [r for r in rows if r["event"] == event]
        if not picked:
            continue
        for i, layer in enumerate(layers):
            spans = [(1e3 * r["start"], 1e3 * (r["end"] - r["start"])) for r in picked if r["layer"] == layer]
            ax.broken_barh(spans, (i - 0.35, 0.7), color=colour, label=label)
        if event == "save":
            ax.scatter([1e3 * r["start"] for r in picked], [layers.index(r["layer"]) for r in picked],
                       marker="|", s=40, color="black", lw=0.8, zorder=3, label="save issued")
    ax.set_yticks(range(len(layers)), [re.sub(r"^model\.layers\.(\d+)\..*", r"layer \1", n) for n in layers])
    ax.set_ylim(len(layers) - 0.5, -0.5)
    ax.set_xlabel("time since the trace began (ms)")
    unique_legend(ax, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=4 if inches >= 5 else 2)
    figure_title(fig, readable(title, rows))
    return fig


@paper_figure
def ttft_figure(rows: Sequence[dict], title: str = "", width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """Median time to first token per scenario as a dot on a log axis (recompute takes seconds,
    a prefix hit tens of milliseconds), whiskers from the fastest to the slowest sample, vLLM's
    own prefix-cache hit dashed as the floor, each connector's overhead over it in brackets."""
    rows = list(rows)
    labels = [r["scenario"] for r in rows]
    fig, (ax,) = panels(1, width, 0.9 + _row_inches(labels, width, 0.3) * max(len(rows), 1))
    medians = [1e3 * r["median_s"] for r in rows]
    ax.errorbar(medians, range(len(rows)), xerr=[[ms - 1e3 * r["min_s"] for r, ms in zip(rows, medians)],
                                                 [1e3 * r["max_s"] - ms for r, ms in zip(rows, medians)]],
                fmt="none", ecolor="black", elinewidth=0.8, capsize=2)
    overheads = [r.get("overhead_s") for r in rows]  # None (or a table's NaN) where there is no floor to add to
    notes = [f"{ms:.0f} ms" if o is None or o != o else f"{ms:.0f} ms (+{1e3 * o:.0f})"
             for ms, o in zip(medians, overheads)]
    dots(ax, range(len(rows)), medians, [connector_colour(r["connector"]) for r in rows], notes,
         ends=[1e3 * r["max_s"] for r in rows])
    floor = [r for r in rows if Reuse.of(r["scenario"]) is Reuse.VLLM_PREFIX_HIT]
    if floor:
        ax.axvline(1e3 * floor[0]["median_s"], color="black", ls="--", lw=0.8)
    ax.set_xlabel(wrap("time to first token (ms, log); dashed: vLLM prefix-cache hit; (+overhead over it)",
                       0.6 * figure_width(width)))  # the width right of the row labels
    return _rows_labelled(fig, [ax], labels, readable(title, rows),
                          room=[max(map(len, notes), default=0) + 1])


@paper_figure
def registration_figure(rows: Sequence[dict], title: str = "", width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """Per-layer against cross-layer hand-over: copies per load and load time."""
    rows = list(rows)
    labels = [f"{r['registration']} ({r['layout']})" for r in rows]
    fig, axes = panels(2, width, 0.9 + _row_inches(labels, width, 0.3) * max(len(rows), 1), sharey=True,
                       min_panel_width=3)
    colours = [CROSS_LAYER if r["cross_layer"] else PER_LAYER for r in rows]
    copies = [r["load_segments"] for r in rows]
    dots(axes[0], range(len(rows)), copies, colours, [f"{v:,.0f}" for v in copies])
    axes[0].set_xlabel("contiguous copies per load (log)")
    times = [r["load_ms"] for r in rows]
    axes[1].barh(range(len(rows)), times, 0.7, color=colours)
    for i, v in enumerate(times):
        axes[1].text(v, i, f" {v:.1f}", va="center", fontsize=SMALL)
    axes[1].set_xlabel("load time (ms)")
    fig.legend(handles=LAYER_KINDS, loc="outside lower center", ncols=2)
    return _rows_labelled(fig, axes, labels, readable(title, rows), room=[8, 7])


@paper_figure
def deployed_figure(serving: Sequence[dict], title: str = "", width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """vLLM's default process layout: each connector's time-to-first-token overhead over
    the same engine's own prefix hit, and the model runner's milliseconds in save calls
    per cold prompt. ``serving`` are kvlab.experiments.deployed.serving_costs rows."""
    rows = [r for r in serving if r.get("overhead_s") is not None]
    fig, axes = panels(2, width, 0.9 + 0.35 * max(len(rows), 1), sharey=True, min_panel_width=3)
    labels = [r["engine"] for r in rows]
    colours = [connector_colour(r["connector"]) for r in rows]
    for ax, key, xlabel in ((axes[0], "overhead_s", "TTFT over the engine's own prefix hit (ms)"),
                            (axes[1], "runner_save_s", "model runner in save calls, per cold prompt (ms)")):
        values = [1e3 * r[key] for r in rows]
        ax.barh(range(len(rows)), values, 0.6, color=colours)
        for i, v in enumerate(values):
            ax.text(max(v, 0), i, f" {v:.1f}", va="center", fontsize=SMALL)
        ax.set_xlabel(wrap(xlabel, 2.4))
    return _rows_labelled(fig, axes, labels, readable(title, rows), room=[7, 7])


@paper_figure
def network_tier_figure(rows: Sequence[dict], title: str = "", width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """A prefix through a network store, per layout and strategy: objects per chunk, and the
    store and fetch times against the store's own ceiling (the same bytes as one ready
    value per chunk, dashed). ``rows`` are kvlab.experiments.network.redis_prefix_costs rows
    (a Redis server or cluster) or kvlab.experiments.mooncake_costs.mooncake_prefix_costs rows."""
    rows = list(rows)
    fig, axes = panels(3, width, 0.9 + 0.3 * max(len(rows), 1), sharey=True)
    labels = [f"{r['layout']}: {r['strategy']}" for r in rows]
    lmcache = PATH_COLOURS[Reuse.LMCACHE]
    colours = [lmcache if r["strategy"].startswith("LMCache") else CROSS_LAYER if r["cross_layer"] else PER_LAYER
               for r in rows]
    objects = [r["objects_per_chunk"] for r in rows]
    dots(axes[0], range(len(rows)), objects, colours, [f"{v:,.0f}" for v in objects])
    axes[0].set_xlabel(f"{rows[0].get('store', 'redis').capitalize() if rows else ''} objects per chunk (log)")
    for ax, key, ceiling, xlabel in ((axes[1], "store_s", "ceiling_store_s", "store the prefix (ms)"),
                                     (axes[2], "fetch_s", "ceiling_fetch_s", "fetch the prefix (ms)")):
        values = [1e3 * r[key] for r in rows]
        ceilings = [1e3 * r[ceiling] if r[ceiling] is not None else 0 for r in rows]
        ax.barh(range(len(rows)), values, 0.6, color=colours)
        for i, (v, c) in enumerate(zip(values, ceilings)):
            if c:
                ax.plot([c] * 2, [i - 0.35, i + 0.35], color="black", ls="--", lw=0.8)
            ax.text(max(v, c), i, f" {v:.1f}", va="center", fontsize=SMALL)  # clear of the ceiling's mark
        ax.set_xlabel(xlabel)
    kinds = LAYER_KINDS + [matplotlib.patches.Patch(color=lmcache, label="LMCache"),
                           matplotlib.lines.Line2D([], [], color="black", ls="--", lw=0.8,
                                                   label="one ready value per chunk")]
    fig.legend(handles=kinds, loc="outside lower center", ncols=4 if figure_width(width) >= 5 else 2)
    return _rows_labelled(fig, axes, labels, readable(title, rows), room=[5, 6, 6])


@paper_figure
def engine_layouts_figure(rows: Sequence[dict], title: str = "", width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """Per-layer against cross-layer inside the engine, rows of
    kvlab.experiments.ttft.layouts_in_the_engine: each variant's time-to-first-token overhead
    over vLLM's own prefix hit (left) and, per load, the copying against the part of it the
    model runner waited for (right; layerwise hides the rest behind compute)."""
    rows = [r for r in rows if isinstance(r.get("hand_over"), str)]  # KVLab's rows (a table's NaN is not one)
    fig, axes = panels(2, width, 0.9 + 0.3 * max(len(rows), 1), sharey=True, min_panel_width=3)
    colours = [CROSS_LAYER if r["hand_over"] == "cross-layer" else PER_LAYER for r in rows]
    hatches = ["//" if r["tier"] == "Redis" else "" for r in rows]
    overheads = [1e3 * r["overhead_s"] for r in rows]
    axes[0].barh(range(len(rows)), overheads, 0.7, color=colours, hatch=hatches, edgecolor="white")
    for i, v in enumerate(overheads):
        axes[0].text(max(v, 0), i, f" {v:.0f}", va="center", fontsize=SMALL)
    axes[0].axvline(0, color="black", lw=0.8)
    axes[0].set_xlabel("TTFT over the prefix hit (ms)")
    copies = [1e3 * r["copy_s"] for r in rows]
    waited = [1e3 * (r["copy_s"] if r["mode"] == "whole-step" else r["wait_s"]) for r in rows]  # whole-step waits for all
    axes[1].barh(range(len(rows)), copies, 0.7, color="white", edgecolor=[*colours], hatch=hatches)
    axes[1].barh(range(len(rows)), waited, 0.7, color=colours, hatch=hatches, edgecolor="white")
    for i, (c, w) in enumerate(zip(copies, waited)):
        axes[1].text(c, i, f" {c:.0f} ({w:.0f} waited)", va="center", fontsize=SMALL)
    axes[1].set_xlabel("copying (ms); filled: waited for")
    tier = [matplotlib.patches.Patch(facecolor="white", edgecolor="grey", hatch="//", label="from Redis"),
            matplotlib.patches.Patch(facecolor="grey", label="from memory")]
    fig.legend(handles=[*LAYER_KINDS, *tier], loc="outside lower center", ncols=4 if figure_width(width) >= 5 else 2)
    labels = [f"{r['hand_over']} {r['layout']}, {r['mode']}, {r['tier']}" for r in rows]
    return _rows_labelled(fig, axes, labels, title, room=[5, 16])
