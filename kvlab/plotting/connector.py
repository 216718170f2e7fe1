"""Figures of notebook 03: the layerwise hooks' timeline, time to first token, per-layer
against cross-layer hand-over, the connector as vLLM deploys it, and a prefix through a
network tier per layout."""

from __future__ import annotations

import re
from typing import Sequence

import matplotlib.pyplot as plt

from kvlab.experiments.paths import Reuse, connector_colour

_HOOK_EVENTS = {"load_wait": ("#ff7f0e", "wait_for_layer_load"), "attention": ("#1f77b4", "attention"),
                "save": ("#2ca02c", "save_kv_layer")}


def hooks_timeline(rows: Sequence[dict], title: str = "") -> plt.Figure:
    """One line per layer over time: load waits, attention and save_kv_layer calls, with a
    tick where each save was issued. ``rows`` are kvlab.hooks.LayerTrace rows."""
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 0.9 + 0.3 * max(len(layers), 1)))
    for event, (colour, label) in _HOOK_EVENTS.items():
        picked = [r for r in rows if r["event"] == event]
        if not picked:
            continue
        for i, layer in enumerate(layers):
            spans = [(1e3 * r["start"], 1e3 * (r["end"] - r["start"])) for r in picked if r["layer"] == layer]
            ax.broken_barh(spans, (i - 0.35, 0.7), color=colour, label=label if i == 0 else None)
        if event == "save":
            ax.scatter([1e3 * r["start"] for r in picked], [layers.index(r["layer"]) for r in picked],
                       marker="|", s=120, color="black", lw=1, zorder=3, label="save issued")
    ax.set_yticks(range(len(layers)), [re.sub(r"^model\.layers\.(\d+)\..*", r"layer \1", n) for n in layers],
                  fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("time since the trace began (ms)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def ttft_figure(rows: Sequence[dict], title: str = "") -> plt.Figure:
    """Median time to first token per scenario (whiskers: min to max over the samples), with
    vLLM's own prefix-cache hit as the floor; each connector's overhead over it in brackets."""
    rows = list(rows)
    fig, ax = plt.subplots(figsize=(7.5, 0.8 + 0.38 * max(len(rows), 1)))
    for i, r in enumerate(rows):
        ms = 1e3 * r["median_s"]
        ax.barh(i, ms, 0.7, color=connector_colour(r["connector"]))
        ax.errorbar(ms, i, xerr=[[ms - 1e3 * r["min_s"]], [1e3 * r["max_s"] - ms]], color="black", lw=0.8, capsize=2)
        overhead = r.get("overhead_s")
        note = f"{ms:.0f} ms" if overhead is None or overhead != overhead else f"{ms:.0f} ms (+{1e3 * overhead:.0f})"
        ax.text(1e3 * r["max_s"] * 1.05, i, note, va="center", fontsize=7)
    floor = [r for r in rows if Reuse.of(r["scenario"]) is Reuse.VLLM_PREFIX_HIT]
    if floor:
        ax.axvline(1e3 * floor[0]["median_s"], color="black", ls="--", lw=0.8)
    ax.set_yticks(range(len(rows)), [r["scenario"] for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, log); dashed: vLLM prefix-cache hit; (+overhead over it)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def registration_figure(rows: Sequence[dict], title: str = "") -> plt.Figure:
    """Per-layer against cross-layer hand-over: copies per load and load time."""
    rows = list(rows)
    fig, axes = plt.subplots(1, 2, figsize=(9, 0.9 + 0.4 * max(len(rows), 1)), sharey=True)
    colours = ["#2ca02c" if r["cross_layer"] else "#1f77b4" for r in rows]
    labels = [f"{r['registration']} ({r['layout']})" for r in rows]
    for ax, key, xlabel in ((axes[0], "load_segments", "contiguous copies per load (log)"),
                            (axes[1], "load_ms", "load time (ms)")):
        values = [r[key] for r in rows]
        ax.barh(range(len(rows)), values, 0.7, color=colours)
        for i, v in enumerate(values):
            ax.text(v, i, f" {v:.0f}" if key == "load_segments" else f" {v:.1f}", va="center", fontsize=7)
        ax.set_xlabel(xlabel)
    return _rows_labelled(fig, axes, labels, title + " (green: cross-layer)", log_first=True)


def deployed_figure(serving: Sequence[dict], title: str = "") -> plt.Figure:
    """vLLM's default process layout: each connector's time-to-first-token overhead over
    the same engine's own prefix hit, and the model runner's milliseconds in save calls
    per cold prompt. ``serving`` are kvlab.experiments.deployed.serving_costs rows."""
    rows = [r for r in serving if r.get("overhead_s") is not None]
    fig, axes = plt.subplots(1, 2, figsize=(9, 0.9 + 0.45 * max(len(rows), 1)), sharey=True)
    labels = [r["engine"] for r in rows]
    colours = [connector_colour(r["connector"]) for r in rows]
    for ax, key, xlabel in ((axes[0], "overhead_s", "TTFT over the engine's own prefix hit (ms)"),
                            (axes[1], "runner_save_s", "model runner in save calls, per cold prompt (ms)")):
        values = [1e3 * r[key] for r in rows]
        ax.barh(range(len(rows)), values, 0.6, color=colours)
        for i, v in enumerate(values):
            ax.text(max(v, 0), i, f" {v:.1f}", va="center", fontsize=7)
        ax.set_xlabel(xlabel, fontsize=8)
    return _rows_labelled(fig, axes, labels, title)


LMCACHE_COLOUR = "#9467bd"  # not Reuse.LMCACHE's green: green marks cross-layer rows here


def network_tier_figure(rows: Sequence[dict], title: str = "") -> plt.Figure:
    """A prefix through a Redis server, per layout and strategy: objects per chunk, and the
    store and fetch times against the server's own ceiling (the same bytes as one ready
    value per chunk, dashed). ``rows`` are kvlab.experiments.network.redis_prefix_costs rows."""
    rows = list(rows)
    fig, axes = plt.subplots(1, 3, figsize=(11, 0.9 + 0.4 * max(len(rows), 1)), sharey=True)
    labels = [f"{r['layout']}: {r['strategy']}" for r in rows]
    colours = [LMCACHE_COLOUR if r["strategy"].startswith("LMCache") else
               "#2ca02c" if r["cross_layer"] else "#1f77b4" for r in rows]
    panels = ((axes[0], "objects_per_chunk", None, "Redis objects per chunk (log)"),
              (axes[1], "store_s", "ceiling_store_s", "store the prefix (ms)"),
              (axes[2], "fetch_s", "ceiling_fetch_s", "fetch the prefix (ms)"))
    for ax, key, ceiling, xlabel in panels:
        scale = 1 if ceiling is None else 1e3
        values = [scale * r[key] for r in rows]
        ax.barh(range(len(rows)), values, 0.6, color=colours)
        for i, v in enumerate(values):
            ax.text(v, i, f" {v:.0f}" if ceiling is None else f" {v:.1f}", va="center", fontsize=7)
        if ceiling is not None:
            for i, r in enumerate(rows):
                if r[ceiling] is not None:
                    ax.plot([1e3 * r[ceiling]] * 2, [i - 0.35, i + 0.35], color="black", ls="--", lw=0.8)
        ax.set_xlabel(xlabel, fontsize=8)
    return _rows_labelled(fig, axes, labels, title + " (green: cross-layer; purple: LMCache; dashed: one ready value "
                                              "per chunk)", log_first=True)


def _rows_labelled(fig: plt.Figure, axes: Sequence[plt.Axes], labels: list[str], title: str,
                   log_first: bool = False) -> plt.Figure:
    """Finish panels of horizontal bars sharing their rows: labels on the first panel (the
    first row on top), a log scale there if asked, the title."""
    if log_first:
        axes[0].set_xscale("log")
    axes[0].set_yticks(range(len(labels)), labels, fontsize=7)
    axes[0].invert_yaxis()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig
