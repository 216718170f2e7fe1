"""Figures of notebooks 03 to 05: the layerwise hooks' timeline, time to first token, per-layer
against cross-layer hand-over, the connector as vLLM deploys it, and a prefix through a
network tier per layout. Connectors keep their paths' colours (common.PATH_COLOURS)."""

from __future__ import annotations

import re
from typing import Sequence

import matplotlib.lines
import matplotlib.patches
import matplotlib.pyplot as plt

from kvlab.experiments.paths import Reuse
from kvlab.plotting.common import (BLACK, BLUE, CROSS_LAYER, DEFAULT_WIDTH, GREEN, GREY, ORANGE, PATH_COLOURS, PER_LAYER,
                                   SMALL, VERMILLION, connector_colour, dots, figure_width, measured, one_run, over_own_floor,
                                   panels, paper_figure, readable, rows_labelled, unique_legend, wrap)
from kvlab.plotting.common import title as figure_title

# each traced event: its colour, its name in the key, its lane in a layer's line (up is negative)
# and the mark it is drawn as where too short to see as a span (in the load's lane; above the
# upper lane, pointing at it)
HOOK_EVENTS = {"load": (ORANGE, "load (the loading thread's copy)", 0.22, "^"),
               "load_wait": (VERMILLION, "wait_for_layer_load", -0.18, "v"),
               "attention": (BLUE, "attention", -0.18, "v"),
               "save": (GREEN, "save_kv_layer", -0.18, "v")}
THINNEST_SPAN = 0.004  # of the time axis: a shorter span is drawn as a mark at its start
LAYER_KINDS = [matplotlib.patches.Patch(color=PER_LAYER, label="per-layer"),
               matplotlib.patches.Patch(color=CROSS_LAYER, label="cross-layer")]


def _row_inches(labels: Sequence[str], width: str | float, least: float) -> float:
    """Inches per row of a figure whose rows _rows_labelled labels: ``least``, more where a
    label wraps (to a third of the figure's width) to more lines than that holds."""
    lines = max((wrap(label, figure_width(width) / 3, SMALL).count("\n") + 1 for label in labels), default=1)
    return max(least, 0.12 * lines + 0.06)


@paper_figure
def hooks_timeline(rows: Sequence[dict], title: str = "", width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """One line per layer over time, from one run (the newest in ``rows``, which are
    kvlab.hooks.LayerTrace rows): the layer's load copied by the loading thread (lower lane),
    the wait for it, attention and save_kv_layer (upper lane); an event too short to see as
    a span is a mark where it began, so the overlap of loads with attention shows."""
    rows, title = one_run(rows, title, "prompt_tokens")
    inches = figure_width(width)
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    fig, ax = plt.subplots(figsize=(inches, 1.2 + 0.16 * max(len(layers), 1)), layout="constrained")
    times = [1e3 * t for r in rows for t in (r["start"], r["end"])]
    thinnest = THINNEST_SPAN * (max(times) - min(times))
    for event, (colour, label, lane, mark) in HOOK_EVENTS.items():
        picked = [r for r in rows if r["event"] == event]
        spans = [(layers.index(r["layer"]), 1e3 * r["start"], 1e3 * (r["end"] - r["start"])) for r in picked]
        wide = [span for span in spans if span[2] >= thinnest]
        for i in dict.fromkeys(i for i, _, _ in wide):
            ax.broken_barh([(start, length) for j, start, length in wide if j == i], (i + lane - 0.17, 0.34),
                           color=colour, label=label)
        marks = [(start, i + lane - 0.2 * (lane < 0)) for i, start, length in spans if length < thinnest]
        if marks:
            ax.scatter(*zip(*marks), marker=mark, s=12, lw=0, color=colour, zorder=3,
                       label=f"{label} (under {thinnest:.2g} ms: a mark)")
    ax.set_yticks(range(len(layers)), [re.sub(r"^model\.layers\.(\d+)\..*", r"layer \1", n) for n in layers])
    ax.set_ylim(len(layers) - 0.5, -0.5)
    ax.set_xlabel("time since the trace began (ms)")
    unique_legend(fig, [ax], loc="outside lower center", ncols=2 if inches >= 5 else 1)
    figure_title(fig, readable(title, rows))
    return fig


@paper_figure
def ttft_figure(rows: Sequence[dict], title: str = "", width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """Median time to first token per scenario of one run (the newest in ``rows``) as a dot
    on a log axis (recompute takes seconds, a prefix hit tens of milliseconds), whiskers from
    the fastest to the slowest sample; each warm row's own floor (its engine's own
    prefix-cache hit) a black bar on its row, its overhead over that floor in its note; the
    engine without a connector's prefix hit dashed across."""
    rows, title = one_run(rows, title, "prompt_tokens")
    labels = [r["scenario"] for r in rows]
    fig, (ax,) = panels(1, width, 0.9 + _row_inches(labels, width, 0.3) * max(len(rows), 1))
    medians = [1e3 * r["median_s"] for r in rows]
    ax.errorbar(medians, range(len(rows)), xerr=[[ms - 1e3 * r["min_s"] for r, ms in zip(rows, medians)],
                                                 [1e3 * r["max_s"] - ms for r, ms in zip(rows, medians)]],
                fmt="none", ecolor="black", elinewidth=0.8, capsize=2)
    plain = [r for r in rows if Reuse.of(r["scenario"]) is Reuse.VLLM_PREFIX_HIT]
    floors = {i: 1e3 * r["engine_floor_s"] for i, r in enumerate(rows) if r["phase"] != "cold"
              and Reuse.of(r["scenario"]) is not Reuse.VLLM_PREFIX_HIT and measured(r.get("engine_floor_s"))}
    notes = [over_own_floor(ms, floors.get(i)) for i, ms in enumerate(medians)]
    dots(ax, range(len(rows)), medians, [connector_colour(r["connector"]) for r in rows], notes,
         ends=[max(1e3 * r["max_s"], floors.get(i, 0)) for i, r in enumerate(rows)])
    if floors:
        ax.plot(list(floors.values()), list(floors), ls="", marker="|", ms=9, mew=1.2, color=BLACK)
    if plain:
        ax.axvline(1e3 * plain[0]["median_s"], color=GREY, ls="--", lw=0.8)
    ax.set_xlabel(wrap("time to first token (ms, log); |: the same engine's own prefix hit (its floor); dashed: "
                       "vLLM's prefix hit without a connector", 0.6 * figure_width(width)))  # right of the row labels
    return rows_labelled(fig, [ax], labels, readable(title, rows),
                         room=[max(map(len, notes), default=0) + 1])


@paper_figure
def registration_figure(rows: Sequence[dict], title: str = "", width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """Per-layer against cross-layer hand-over through KVLabConnector, from one run (the
    newest in ``rows``): contiguous copies per save and per load (one dot where they are
    the same), and the time to save (outlined) and to load (filled) each layout's blocks."""
    rows, title = one_run(rows, title, "tokens", "hit_tokens")
    labels = [f"{r['registration']} ({r['layout']})" for r in rows]
    fig, axes = panels(2, width, 0.9 + _row_inches(labels, width, 0.4) * max(len(rows), 1), sharey=True,
                       min_panel_width=3)
    colours = [CROSS_LAYER if r["cross_layer"] else PER_LAYER for r in rows]
    loads, saves = [r["load_segments"] for r in rows], [r["save_segments"] for r in rows]
    if loads == saves:
        dots(axes[0], range(len(rows)), loads, colours, [f"{v:,.0f}" for v in loads])
        axes[0].set_xlabel(wrap("contiguous copies per save and per load (log)", min(2.2, 0.5 * figure_width(width))))
    else:
        dots(axes[0], [i + 0.18 for i in range(len(rows))], loads, colours, [f"{v:,.0f}" for v in loads])
        axes[0].scatter(saves, [i - 0.18 for i in range(len(rows))], s=20, facecolors="white", edgecolors=colours,
                        zorder=3)
        axes[0].set_xlabel(wrap("contiguous copies per save (hollow) and per load (log)",
                                min(2.2, 0.5 * figure_width(width))))
    for shift, key, filled in ((-0.19, "save_ms", False), (0.19, "load_ms", True)):
        times = [r[key] for r in rows]
        axes[1].barh([i + shift for i in range(len(rows))], times, 0.36, color=colours if filled else "white",
                     edgecolor=colours, linewidth=0.8)
        for i, v in enumerate(times):
            axes[1].text(v, i + shift, f" {v:.1f}", va="center", fontsize=SMALL)
    axes[1].set_xlabel(wrap("time to save (outlined) and to load (filled), ms", min(2.2, 0.5 * figure_width(width))))
    kinds = [*LAYER_KINDS, matplotlib.patches.Patch(facecolor="white", edgecolor=GREY, label="save"),
             matplotlib.patches.Patch(facecolor=GREY, label="load")]
    fig.legend(handles=kinds, loc="outside lower center", ncols=4 if figure_width(width) >= 5 else 2)
    return rows_labelled(fig, axes, labels, readable(title, rows), room=[8, 7])


@paper_figure
def deployed_figure(serving: Sequence[dict], title: str = "", width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """vLLM's default process layout: each connector's time-to-first-token overhead over
    the same engine's own prefix hit, and the model runner's milliseconds in save calls
    per cold prompt. ``serving`` are kvlab.experiments.deployed.serving_costs rows."""
    drawn, title = one_run(serving, title)
    rows = [r for r in drawn if r.get("overhead_s") is not None]
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
    return rows_labelled(fig, axes, labels, readable(title, rows), room=[7, 7])


@paper_figure
def network_tier_figure(rows: Sequence[dict], title: str = "", width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """A prefix through a network store, per layout and strategy: objects per chunk, and the
    store and fetch times against the store's own ceiling (the same bytes as one ready
    value per chunk, dashed). ``rows`` are kvlab.experiments.network.redis_prefix_costs rows
    (a Redis server or cluster) or kvlab.experiments.mooncake_costs.mooncake_prefix_costs rows."""
    rows, title = one_run(rows, title, "tokens")
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
    kinds = LAYER_KINDS + [matplotlib.patches.Patch(color=lmcache, label="LMCache")] * (lmcache in colours) + [
        matplotlib.lines.Line2D([], [], color="black", ls="--", lw=0.8, label="one ready value per chunk")]
    fig.legend(handles=kinds, loc="outside lower center", ncols=len(kinds) if figure_width(width) >= 5 else 2)
    return rows_labelled(fig, axes, labels, readable(title, rows), room=[5, 6, 6])


@paper_figure
def engine_layouts_figure(rows: Sequence[dict], title: str = "", width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """Per-layer against cross-layer inside the engine, rows of
    kvlab.experiments.ttft.layouts_in_the_engine: each variant's time-to-first-token overhead
    over vLLM's own prefix hit (left) and, per load, the copying against the part of it the
    model runner waited for (right; layerwise hides the rest behind compute)."""
    drawn, title = one_run(rows, title, "prompt_tokens")
    rows = [r for r in drawn if isinstance(r.get("hand_over"), str)]  # KVLab's rows (not a table's NaN)
    fig, axes = panels(2, width, 0.9 + 0.3 * max(len(rows), 1), sharey=True, min_panel_width=3)
    colours = [CROSS_LAYER if r["hand_over"] == "cross-layer" else PER_LAYER for r in rows]
    overheads = [1e3 * r["overhead_s"] for r in rows]
    axes[0].barh(range(len(rows)), overheads, 0.7, color=colours)
    for i, v in enumerate(overheads):
        axes[0].text(max(v, 0), i, f" {v:.0f}", va="center", fontsize=SMALL)
    axes[0].axvline(0, color="black", lw=0.8)
    axes[0].set_xlabel("TTFT over the prefix hit (ms)")
    copies = [1e3 * r["copy_s"] for r in rows]
    waited = [1e3 * (r["copy_s"] if r["mode"] == "whole-step" else r["wait_s"]) for r in rows]  # whole-step waits for all
    axes[1].barh(range(len(rows)), copies, 0.7, color="white", edgecolor=colours)
    axes[1].barh(range(len(rows)), waited, 0.7, color=colours)
    for i, (c, w) in enumerate(zip(copies, waited)):
        axes[1].text(c, i, f" {c:.0f} ({w:.0f} waited)", va="center", fontsize=SMALL)
    axes[1].set_xlabel("copying (ms); filled: waited for")
    fig.legend(handles=LAYER_KINDS, loc="outside lower center", ncols=2)
    labels = [f"{r['hand_over']} {r['layout']}, {r['mode']}, {r['tier']}" for r in rows]
    return rows_labelled(fig, axes, labels, title, room=[5, 16])
