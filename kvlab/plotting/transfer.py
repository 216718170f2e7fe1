"""Figures of notebook 02: transfer timing against the same-run copy ceiling, bandwidth,
the fitted cost model, break-even segment sizes, layerwise loading, machines side by side.
Every copy method keeps its colour (its registry entry's, common.method_colour) and every series names its
machine where a figure shows more than one."""

from __future__ import annotations

from typing import Sequence

import matplotlib.lines
import matplotlib.patches
import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np

from kvlab.plotting.common import (CROSS_LAYER, DEFAULT_WIDTH, GREY, PER_LAYER, SMALL, _ok, figure_width, human_bytes,
                                   ink, machine_title, method_colour, model_name, panels, paper_figure,
                                   short_hardware, title, unique_legend, with_hardware, wrap)
from kvlab.transfer.registry import ALL_METHODS, get_method

DIRECTION_STYLES = {"offload": "-", "load": "--"}
MARKERS = "os^Dv"


def _one_machine(rows: list[dict], hardware: str | None) -> tuple[list[dict], str | None]:
    """The rows of ``hardware`` (default: the first machine in ``rows``) and its name."""
    machines = list(dict.fromkeys(r.get("hardware") for r in rows))
    hardware = hardware if hardware is not None else (machines[0] if machines else None)
    if rows and hardware not in machines:
        raise ValueError(f"no rows measured on {hardware!r}; these rows are from {machines}")
    return [r for r in rows if r.get("hardware") == hardware], hardware


def _legend_columns(inches: float, labels: int, label_inches: float = 1.0) -> int:
    return max(1, min(labels, int(inches // label_inches)))


def _label_bars(fig: plt.Figure, ax: plt.Axes, bars: list[tuple[float, float, float, float, str, str]],
                line: float) -> bool:
    """Write each (x, low, high, width, text, colour) bar's number where it crosses neither
    the frame nor the reference ``line``: inside the bar from its base, below its whisker's
    ``low`` end (in the ink that reads on its colour), else just above the whisker's ``high``
    end; horizontal where the bar is wide enough, upright where not, not at all where
    neither fits (the title says numbers are shown only when some are). Returns whether
    any was written."""
    fig.get_layout_engine().execute(fig)  # the bars' final sizes on the page
    origin = ax.transData.transform((0, 0))
    points = (ax.transData.transform((1, 1)) - origin) * 72 / fig.dpi  # per data unit, across and up
    pad = 1.5 / points[1]
    written = False
    for x, low, high, width, text, colour in bars:
        across = len(text) * 0.6 * SMALL <= width * points[0]
        if not across and width * points[0] < SMALL:
            continue
        tall = (SMALL if across else len(text) * 0.6 * SMALL) / points[1] + 2 * pad
        ceiling = line if high < line else ax.get_ylim()[1]
        style = dict(ha="center", va="bottom", fontsize=SMALL, rotation=0 if across else 90)
        if tall <= low:
            ax.text(x, pad, text, color=ink(colour), **style)
        elif high + tall <= ceiling:
            ax.text(x, high + pad, text, **style)
        else:
            continue
        written = True
    return written


def _direction(direction: str, hardware: str | None, target: str) -> str:
    """A direction named by what moves: on a CPU "offload: paged cache → host buffer", on an
    accelerator the cache named with its device."""
    device = (hardware or "cpu").split(":")[0]
    cache = "paged cache" if device == "cpu" else f"paged cache ({device})"
    other = "host buffer" if target == "host" else f"{target} chunk"
    source, destination = (cache, other) if direction == "offload" else (other, cache)
    return f"{direction}: {source} → {destination}"


@paper_figure
def transfer_ratios(rows: Sequence[dict], model: str, tokens: int, block_ids: str = "scattered",
                    target: str = "host", width: str | float = DEFAULT_WIDTH,
                    hardware: str | None = None) -> plt.Figure:
    """Each layout x method as a share of the copy ceiling measured beside it, per direction,
    on one machine (``hardware``, default the first in ``rows``); every method the rows
    measured, whiskers span the repeats' quartiles, hatched bars are flagged as noise,
    numbers are GB/s where they fit."""
    chosen, hardware = _one_machine(_ok(rows, model=model, tokens=tokens, block_ids=block_ids, target=target),
                                    hardware)
    layouts = list(dict.fromkeys(r["layout"] for r in chosen))
    methods = [m for m in ALL_METHODS if any(r["method"] == m for r in chosen)]
    methods += [m for m in dict.fromkeys(r["method"] for r in chosen) if m not in methods]  # since unregistered
    fig, axes = panels(2, width, 2.2, sharey=True)
    bar = 0.8 / max(len(methods), 1)
    numbers: dict[plt.Axes, list[tuple[float, float, float, float, str, str]]] = {ax: [] for ax in axes}
    for ax, direction in zip(axes, ("offload", "load")):
        for j, method in enumerate(methods):
            for i, layout in enumerate(layouts):
                hit = [r for r in chosen
                       if r["layout"] == layout and r["method"] == method and r["direction"] == direction]
                if hit:
                    r = hit[0]
                    low, high = r.get("ratio_q1", r["ratio"]), r.get("ratio_q3", r["ratio"])  # the repeats' quartiles
                    legend = get_method(method).legend if method in ALL_METHODS else method
                    ax.bar(i + j * bar, r["ratio"], bar, color=method_colour(method), label=legend,
                           yerr=[[r["ratio"] - low], [high - r["ratio"]]] if "ratio_q1" in r else None,
                           error_kw={"lw": 0.6, "capsize": 1.5, "ecolor": "0.4"},
                           hatch="//" if r.get("noisy") else None, edgecolor="white", linewidth=0.3)
                    numbers[ax].append((i + j * bar, low, high, bar, f"{r['gbps']:.1f}", method_colour(method)))
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_xticks([i + bar * (len(methods) - 1) / 2 for i in range(len(layouts))], layouts)
        ax.set_title(_direction(direction, hardware, target))
        ax.set_ylim(0, 1.3)
        ax.set_ylabel("share of ceiling")
    keys = [matplotlib.lines.Line2D([], [], color="black", lw=0.8, ls="--", label="ceiling: one contiguous copy")]
    if any(r.get("noisy") for r in chosen):
        keys.append(matplotlib.patches.Patch(facecolor="white", edgecolor="black", hatch="//", label="noisy"))
    shown = {c.get_label(): c for ax in axes for c in ax.containers if not c.get_label().startswith("_")}  # methods
    inches = figure_width(width)
    fig.legend([*shown.values(), *keys], [*shown, *(key.get_label() for key in keys)], loc="outside lower center",
               title=short_hardware(hardware), ncols=_legend_columns(inches, len(shown) + len(keys), 1.1))
    fig.get_layout_engine().execute(fig)
    group = (axes[0].transData.transform((1, 0))[0] - axes[0].transData.transform((0, 0))[0]) * 72 / fig.dpi
    if max((len(name) for name in layouts), default=0) * 0.6 * SMALL > group:
        for ax in axes:
            ax.tick_params(axis="x", labelrotation=30)
            plt.setp(ax.get_xticklabels(), ha="right", rotation_mode="anchor")
    labelled = any([_label_bars(fig, ax, numbers[ax], 1.0) for ax in axes])
    title(fig, f"{model_name(model)}: {tokens} tokens, {block_ids} blocks" + ("; numbers: GB/s" if labelled else ""))
    return fig


@paper_figure
def bandwidth_vs_tokens(rows: Sequence[dict], model: str, method: str, block_ids: str = "scattered",
                        width: str | float = DEFAULT_WIDTH, hardware: str | None = None) -> plt.Figure:
    """GB/s against tokens moved for each layout, with the ceiling measured beside it, on one
    machine (``hardware``, default the first in ``rows``)."""
    chosen, hardware = _one_machine(_ok(rows, model=model, method=method, block_ids=block_ids, target="host"),
                                    hardware)
    fig, axes = panels(2, width, 2.2, sharey=True)
    layouts = list(dict.fromkeys(r["layout"] for r in chosen))
    for ax, direction in zip(axes, ("offload", "load")):
        picked = [r for r in chosen if r["direction"] == direction]
        for k, layout in enumerate(layouts):
            line = sorted((r["tokens"], r["gbps"]) for r in picked if r["layout"] == layout)
            if line:
                ax.plot(*zip(*line), marker=MARKERS[k % len(MARKERS)], label=layout,
                        color=f"C{k % 8}")
        ceiling = sorted({(r["tokens"], r["ceiling_gbps"]) for r in picked})
        if ceiling:
            ax.plot(*zip(*ceiling), ls=":", color="black", label="ceiling (same run)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens moved")
        ax.set_ylabel("GB/s")
        ax.set_title(direction)
    unique_legend(fig, axes, loc="outside lower center", title=short_hardware(hardware),
                  ncols=_legend_columns(figure_width(width), len(layouts) + 1))
    title(fig, f"{model_name(model)}, method {method}, {block_ids} blocks")
    return fig


DIRECTION_MARKERS = {"offload": "o", "load": "^"}


@paper_figure
def cost_model_figure(predicted: Sequence[dict], width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """Predicted against measured time for every row (colour: the method, marker: the
    direction, hollow: a second machine); the diagonal is a perfect model, and each method's
    legend entry says how far off the model is: the median (mean) |relative error| of its rows."""
    inches = figure_width(width)
    wide = inches >= 5
    fig, ax = plt.subplots(figsize=(inches, 3.6), layout="constrained")
    machines = list(dict.fromkeys(r.get("hardware") for r in predicted))
    for hardware, method in dict.fromkeys((r.get("hardware"), r["method"]) for r in predicted):
        rows = [r for r in predicted if r.get("hardware") == hardware and r["method"] == method]
        errors = [100 * abs(r["error"]) for r in rows]
        label = with_hardware(f"{method} {np.median(errors):.0f}% ({np.mean(errors):.0f}%)", hardware, machines)
        colour = method_colour(method)
        for direction, marker in DIRECTION_MARKERS.items():
            picked = [r for r in rows if r["direction"] == direction]
            ax.scatter([r["seconds"] * 1e3 for r in picked], [r["predicted_s"] * 1e3 for r in picked], s=10,
                       marker=marker, facecolors="none" if machines.index(hardware) else colour, edgecolors=colour,
                       alpha=0.8, linewidths=0.8, label=label)
    for direction, marker in DIRECTION_MARKERS.items():  # the markers' key
        ax.scatter([], [], s=10, marker=marker, color=GREY, label=direction)
    low, high = ax.get_xlim()
    ax.plot([low, high], [low, high], color="black", lw=0.8, label="perfect model")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured (ms)")
    ax.set_ylabel("predicted (ms)")
    machine = machine_title(machines)
    unique_legend(fig, [ax], loc="outside right upper" if wide else "outside lower center",
                  title=(f"{machine}\n" if machine else "") + "|error|: median (mean)",
                  ncols=1 if wide else _legend_columns(inches, 9, 1.5))
    ax.set_title(wrap("model: time = segments × cost per segment + bytes / bandwidth", inches - 0.4))
    return fig


@paper_figure
def break_even_figure(fits: Sequence, num_layers: int, tolerance: float = 0.1,
                      width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """Per-layer over cross-layer time against the per-layer segment size, per fitted model
    (kvlab.experiments.costmodel.CostFit): colour the method, dashes the direction, markers
    the machine where there are several."""
    inches = figure_width(width)
    sizes = np.logspace(10, 24, 60, base=2)
    machines = list(dict.fromkeys(f.hardware for f in fits))
    columns = _legend_columns(inches, len(fits), 1.6 if len(machines) == 1 else 3.2)
    fig, ax = plt.subplots(figsize=(inches, max(2.6, 1.9 + 0.18 * -(-len(fits) // columns))), layout="constrained")
    for f in fits:
        ratio = [f.predict(1 / s, 1) / f.predict(1 / (num_layers * s), 1) for s in sizes]
        line, = ax.plot(sizes, ratio, label=with_hardware(f"{f.method} {f.direction}", f.hardware, machines),
                        color=method_colour(f.method), ls=DIRECTION_STYLES.get(f.direction, ":"),
                        marker=MARKERS[machines.index(f.hardware) % len(MARKERS)] if len(machines) > 1 else None,
                        markevery=(3, 8), ms=3)
        even = f.break_even_segment_bytes(num_layers, tolerance)
        if even:
            ax.axvline(even, color=line.get_color(), lw=0.6, ls=line.get_linestyle())
    ax.axhline(1 + tolerance, color="black", lw=0.6, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=4 if inches >= 5 else 16))  # sizes that fit
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: human_bytes(v)))
    ax.set_xlabel(wrap("per-layer segment size (cross-layer segments are L times larger)", inches - 0.6))
    ax.set_ylabel("per-layer /\ncross-layer time")
    ax.set_title(wrap(f"{num_layers} layers; vertical lines: per-layer within {tolerance:.0%} of cross-layer",
                      inches - 0.6))
    unique_legend(fig, [ax], loc="outside lower center", title=machine_title(machines), ncols=columns)
    return fig


@paper_figure
def layerwise_figure(rows: Sequence[dict], width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """Speed-up of layer-by-layer loading overlapped with compute over load-then-compute."""
    inches = figure_width(width)
    fig, ax = plt.subplots(figsize=(inches, 2.6), layout="constrained")
    series = list(dict.fromkeys((r["hardware"], r["model"], r["tokens"]) for r in rows))
    machines = [hardware for hardware, _, _ in series]
    for k, key in enumerate(series):
        picked = sorted((r["intensity"], r["speedup"], r["ideal_speedup"]) for r in rows
                        if (r["hardware"], r["model"], r["tokens"]) == key)
        x, speedup, ideal = zip(*picked)
        label = with_hardware(f"{model_name(key[1])}, {key[2]} tokens", key[0], machines)
        line, = ax.plot(x, speedup, marker="o", label=label, color=f"C{k % 8}")
        ax.plot(x, ideal, ls=":", color=line.get_color())
    ax.axhline(1, color="black", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("compute per layer / load per layer")
    ax.set_ylabel("speed-up over\nload-then-compute")
    ax.set_title("layerwise loading (dotted: perfect overlap)")
    unique_legend(fig, [ax], loc="outside lower center", title=machine_title(machines),
                  ncols=_legend_columns(inches, len(series), 2.4))
    return fig


@paper_figure
def hardware_figure(rows: Sequence[dict], model: str, tokens: int, width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """Per-layer against cross-layer on every machine with results: the best method's share of
    that machine's ceiling (hatched: loads), each row of bars labelled with its machine."""
    inches = figure_width(width)
    chosen = _ok(rows, model=model, tokens=tokens, block_ids="scattered", target="host")
    machines = list(dict.fromkeys(r["hardware"] for r in chosen))
    fig, ax = plt.subplots(figsize=(inches, 1.2 + 1.1 * max(len(machines), 1)), layout="constrained")
    bars = [("per-layer", False, "offload"), ("per-layer", False, "load"), ("cross-layer", True, "offload"),
            ("cross-layer", True, "load")]
    longest = 1.0
    for i, machine in enumerate(machines):
        for j, (name, cross, direction) in enumerate(bars):
            picked = [r for r in chosen if r["hardware"] == machine and r["cross_layer"] == cross
                      and r["direction"] == direction]
            if picked:
                best = max(picked, key=lambda r: r["ratio"])
                longest = max(longest, best["ratio"])
                y = i + j * 0.2
                ax.barh(y, best["ratio"], 0.18, color=CROSS_LAYER if cross else PER_LAYER,
                        hatch="//" if direction == "load" else None, edgecolor="white", linewidth=0.3,
                        label=f"{name} {direction}")
                ax.text(0.01, y, f"{best['layout']} {best['method']}, {best['gbps']:.1f} GB/s", va="center",
                        fontsize=SMALL)
    ax.set_yticks([i + 0.3 for i in range(len(machines))],
                  [wrap(short_hardware(m), inches / 4, SMALL) for m in machines])
    ax.invert_yaxis()
    ax.axvline(1, color="black", lw=0.8, ls="--")
    ax.set_xlim(0, 1.05 * longest)
    ax.set_xlabel(wrap("best method's share of the machine's own copy ceiling", inches - 1.2))
    title(fig, f"{model_name(model)}: {tokens} tokens, scattered blocks")
    unique_legend(fig, [ax], loc="outside lower center", ncols=_legend_columns(inches, 4, 1.5))
    return fig
