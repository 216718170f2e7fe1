"""Figures of notebook 05's "How the costs grow" and notebook 04's scale model (kvlab.experiments.scaling): a hit's
overhead against prompt length beside the STREAM-style copy of its bytes, a lookup against
the chunks a tier stores, serving against concurrent requests, and a store's measured
per-object and per-byte costs scaled to many hosts (kvlab.experiments.scale_model)."""

from __future__ import annotations

from typing import Sequence

import matplotlib.pyplot as plt
import matplotlib.ticker

from kvlab.experiments.scaling import UNPINNED
from kvlab.plotting.common import (BLACK, BLUE, CROSS_LAYER, CYCLE, DEFAULT_WIDTH, GREY, PER_LAYER, PURPLE, SMALL,
                                   VERMILLION, measured, one_run, panels, paper_figure,
                                   plain_log_ticks, readable, unique_legend, wrap)
from kvlab.plotting.common import title as figure_title

PATH_STYLES = {"KVLab, memory": (BLUE, "o"), "KVLab, shm": (CYCLE[5], "s"), "KVLab, disk": (CYCLE[2], "^"),
               "KVLab, redis": (VERMILLION, "D"), "ExampleConnector": (PURPLE, "v")}
SERVER_STYLES = {"KVLabConnector": (BLUE, "o"), "KVLabConnector alone": (CYCLE[5], "s"),
                 "vLLM prefix cache": (BLACK, "^"), "no cache": (GREY, "v"), UNPINNED: (CYCLE[2], "D")}
SERVER_LABELS = {UNPINNED: "KVLabConnector, unpinned"}  # the data's name is too long for a column's legend
DODGE = 0.12  # log2 units between servers at one level: servers whose numbers coincide stay visible


@paper_figure
def costs_by_length_figure(rows: Sequence[dict], title: str = "", width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """Left: each reuse path's time to first token over its engine's own prefix hit against
    prompt length, and the STREAM-style copy of the same bytes (the physical bound, dashed).
    Right: that overhead over the bound."""
    fig, (ax, ratio) = panels(2, width, 2.4)
    drawn, title = one_run(rows, title, "prompt_tokens")
    rows = [r for r in drawn if measured(r.get("overhead_s"))]  # a path that could not run says why in its row
    for path in dict.fromkeys(r["path"] for r in rows):
        colour, marker = PATH_STYLES.get(path, (GREY, "o"))
        mine = sorted((r for r in rows if r["path"] == path), key=lambda r: r["prompt_tokens"])
        ax.plot([r["prompt_tokens"] for r in mine], [1e3 * r["overhead_s"] for r in mine], marker=marker,
                color=colour, label=path)
        ratio.plot([r["prompt_tokens"] for r in mine], [r["bound_ratio"] for r in mine], marker=marker, color=colour,
                   label=path)
    bound = sorted({(r["prompt_tokens"], r["stream_s"]) for r in rows if measured(r.get("stream_s"))})
    ax.plot([t for t, _ in bound], [1e3 * s for _, s in bound], ls="--", color=BLACK, label="STREAM copy (bound)")
    ratio.axhline(1.5, ls=":", color=GREY, lw=0.8, label="target: 1.5x")
    ax.set_yscale("log")
    ax.set_ylabel("TTFT over floor (ms)")
    ratio.set_yscale("log")
    ratio.set_ylabel("overhead / STREAM copy")
    return _finish(fig, "prompt tokens", 2, 4, title, rows)


@paper_figure
def lookup_scaling_figure(rows: Sequence[dict], title: str = "", width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """Left: a scheduler's lookup of one prompt against the chunks its tier stores, a new
    engine's first (headers read) and a repeated one. Right: the disk tier's start-up."""
    rows, title = one_run(rows, title, "prompt_tokens")
    fig, (ax, start) = panels(2, width, 2.2)
    for tier, colour in (("disk", CYCLE[2]), ("redis", VERMILLION)):
        mine = sorted((r for r in rows if r["tier"] == tier), key=lambda r: r["stored_chunks"])
        if not mine:
            continue
        stored = [r["stored_chunks"] for r in mine]
        ax.plot(stored, [r["first_lookup_ms"] for r in mine], marker="o", ls="--", color=colour,
                label=f"{tier}: a new engine's first")
        ax.plot(stored, [r["lookup_ms"] for r in mine], marker="o", color=colour, label=f"{tier}: repeated")
        start.plot(stored, [r["startup_ms"] for r in mine], marker="o", color=colour, label=tier)
    ax.axhline(1.0, ls=":", color=GREY, lw=0.8, label="target: 1 ms")
    ax.set_yscale("log")
    ax.set_ylabel(f"lookup (ms), {rows[0]['prompt_tokens']} tok.")
    start.set_yscale("log")
    start.set_ylabel("tier start-up (ms)")
    return _finish(fig, "chunks stored", 10, 3, title, rows)


@paper_figure
def concurrency_figure(rows: Sequence[dict], title: str = "", width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """Throughput and p99 time to first token against concurrent requests, per server, each
    server drawn a little to the side of each level (:data:`DODGE`; p50 beside its p99), so
    that series whose numbers coincide stay visible."""
    rows, title = one_run(rows, title)
    fig, (ax, tail) = panels(2, width, 2.2)
    servers = list(dict.fromkeys(r["server"] for r in rows))
    for i, server in enumerate(servers):
        colour, marker = SERVER_STYLES.get(server, (GREY, "o"))
        label = SERVER_LABELS.get(server, server)
        mine = sorted((r for r in rows if r["server"] == server), key=lambda r: r["concurrency"])
        levels = [r["concurrency"] * 2 ** (DODGE * (i - (len(servers) - 1) / 2)) for r in mine]
        ax.plot(levels, [r["throughput_rps"] for r in mine], marker=marker, color=colour, label=label)
        tail.plot(levels, [r["ttft_p99_s"] for r in mine], marker=marker, color=colour, label=label)
        beside = [level * 2 ** (DODGE / 2) for level in levels]  # p50 beside its p99: they may coincide
        tail.plot(beside, [r["ttft_p50_s"] for r in mine], marker=marker, color=colour, ls=":", alpha=0.6)
    ax.set_ylabel("requests per second")
    tail.set_yscale("log")
    tail.plot([], [], ls=":", color=GREY, label="p50 (dotted; p99 solid)")
    tail.set_ylabel("TTFT (s)")
    return _finish(fig, "concurrent requests", 2, 4, title, rows)


@paper_figure
def scale_prediction_figure(predictions: Sequence[dict], calibration: Sequence[dict], title: str = "",
                            width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """Left: the cost model's time for every host to fetch its prefixes at once against the
    host count, per store (line style) and way (colour: an object per per-layer run, per
    cross-layer run, per chunk; stores predicted alike share a line). Right: the same model
    against this host's own prefix measurements, which calibrate it (marker: the store), and
    on which side of the diagonal (predicted as measured) it sits. From one machine's fits
    (the newest in ``predictions``)."""
    predictions, title = one_run(predictions, title, "tokens")
    fig, (ax, check) = panels(2, width, 2.4)
    styles = {"mooncake": "-", "redis cluster": "--"}
    series: dict[tuple, list[str]] = {}  # the hosts' predicted seconds of a layout and way: the stores predicting them
    for (store, layout, way) in dict.fromkeys((r["store"], r["layout"], r["way"]) for r in predictions):
        mine = sorted((r for r in predictions if (r["store"], r["layout"], r["way"]) == (store, layout, way)),
                      key=lambda r: r["hosts"])
        per_chunk = way == "object per chunk"  # a chunk's one object: the same for every layout
        key = ("per chunk" if per_chunk else layout, tuple((r["hosts"], r["predicted_s"]) for r in mine))
        stores = series.setdefault(key, [])
        if store not in stores:
            stores.append(store)
    for (name, points), stores in series.items():
        colour = GREY if name == "per chunk" else CROSS_LAYER if name.startswith("B") else PER_LAYER
        label = "an object per chunk" if name == "per chunk" else f"{name}: an object per run"
        hosts, seconds = zip(*points)
        ax.plot(hosts, seconds, marker="o", ms=3, color=colour, ls=styles.get(stores[0], ":") if len(stores) == 1 else
                "-.", label=label if len(stores) == 1 else f"{label} ({' = '.join(stores)})")
    for store, style in styles.items():
        ax.plot([], [], color=BLACK, ls=style, label=store)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"hosts fetching at once, {predictions[0]['prefixes']} prefixes each")
    ax.set_ylabel("predicted (s)")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:,.0f}"))
    markers = {"mooncake": "o", "redis cluster": "s"}
    for row in calibration:
        colour = CROSS_LAYER if row["layout"].startswith("B") else PER_LAYER
        check.scatter(1e3 * row["measured_s"], 1e3 * row["predicted_s"], color=colour, s=14,
                      marker=markers.get(row["store"], "D"))
    for store in dict.fromkeys(row["store"] for row in calibration):
        check.scatter([], [], color=GREY, s=14, marker=markers.get(store, "D"), label=f"{store} (right)")
    edges = [1e3 * v for r in calibration for v in (r["measured_s"], r["predicted_s"])]
    if edges:
        check.plot([min(edges), max(edges)], [min(edges), max(edges)], color=GREY, ls=":", lw=0.8)
        below, count = sum(r["predicted_s"] < r["measured_s"] for r in calibration), len(calibration)
        note = (f"{below} of {count} below the diagonal: the model predicts less time than measured"
                if 2 * below > count else f"{count - below} of {count} above the diagonal: the model predicts "
                                          f"more time than measured" if 2 * below < count else
                f"{below} of {count} below the diagonal, {count - below} above")
        fig.get_layout_engine().execute(fig)
        check.text(0.03, 0.97, wrap(note, 0.75 * check.get_position().width * fig.get_figwidth(), SMALL),
                   transform=check.transAxes, va="top", fontsize=SMALL)
    check.set_xscale("log")
    check.set_yscale("log")
    for axis in (ax.yaxis, check.xaxis, check.yaxis):
        plain_log_ticks(axis)
    check.set_xlabel("measured on this host (ms)")
    check.set_ylabel("model (ms)")
    unique_legend(fig, loc="outside lower center", ncols=3 if fig.get_figwidth() >= 5 else 2)
    figure_title(fig, readable(title, predictions))
    return fig


def _finish(fig: plt.Figure, xlabel: str, base: int, columns: int, title: str, rows: Sequence[dict]) -> plt.Figure:
    """Both panels on a log ``xlabel`` axis, one legend under them (``columns`` wide, two in
    a single column), the title."""
    for axis in fig.axes:
        axis.set_xscale("log", base=base)
        axis.set_xlabel(xlabel)
        axis.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:,.0f}"))
        if axis.get_yscale() == "log":
            plain_log_ticks(axis.yaxis)
    unique_legend(fig, loc="outside lower center", ncols=columns if fig.get_figwidth() >= 5 else 2)
    figure_title(fig, readable(title, rows))
    return fig
