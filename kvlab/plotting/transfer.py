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

from kvlab.plotting.common import (CROSS_LAYER, DEFAULT_WIDTH, GREY, LIGHT_GREY, PER_LAYER, SMALL, figure_width,
                                   human_bytes, ink, method_colour, model_name, newest_run, ok_rows, panels, paper_figure,
                                   plain_log_ticks, short_hardware, title, unique_legend, wrap)
from kvlab.transfer.registry import ALL_METHODS, get_method

DIRECTION_STYLES = {"offload": "-", "load": "--"}
MARKERS = "os^Dv"


def _one_machine(rows: list[dict], hardware: str | None) -> tuple[list[dict], str | None]:
    """The newest run of ``hardware`` (default: the newest run in ``rows``) and its machine."""
    machines = list(dict.fromkeys(r.get("hardware") for r in rows))
    if rows and hardware is not None and hardware not in machines:
        raise ValueError(f"no rows measured on {hardware!r}; these rows are from {machines}")
    chosen = newest_run([r for r in rows if hardware is None or r.get("hardware") == hardware])
    return chosen, chosen[0].get("hardware") if chosen else hardware


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
    from one run (the newest of ``hardware``, default the newest in ``rows``); every method
    the rows measured, whiskers span the repeats' quartiles, hatched bars are flagged as
    noise (hatching means that in every figure), numbers are GB/s where they fit."""
    chosen, hardware = _one_machine(ok_rows(rows, model=model, tokens=tokens, block_ids=block_ids, target=target),
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
    top = max([1.3] + [1.08 * high for bars in numbers.values() for _, _, high, _, _, _ in bars])
    for ax in axes:  # every bar and whisker whole, a method faster than the ceiling too
        ax.set_ylim(0, top)
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
    """GB/s against tokens moved for each layout, ticks at the token counts measured, and the
    copy ceiling measured beside each layout: its median over the layouts (dotted) and their
    range (shaded), from one run (the newest of ``hardware``, default the newest in ``rows``)."""
    chosen, hardware = _one_machine(ok_rows(rows, model=model, method=method, block_ids=block_ids, target="host"),
                                    hardware)
    fig, axes = panels(2, width, 2.2, sharey=True)
    layouts = list(dict.fromkeys(r["layout"] for r in chosen))
    counts = sorted({r["tokens"] for r in chosen})
    for ax, direction in zip(axes, ("offload", "load")):
        picked = [r for r in chosen if r["direction"] == direction]
        for k, layout in enumerate(layouts):
            line = sorted((r["tokens"], r["gbps"]) for r in picked if r["layout"] == layout)
            if line:
                ax.plot(*zip(*line), marker=MARKERS[k % len(MARKERS)], label=layout,
                        color=f"C{k % 8}")
        ceilings = [(n, [r["ceiling_gbps"] for r in picked if r["tokens"] == n]) for n in counts]
        ceilings = [(n, values) for n, values in ceilings if values]
        if ceilings:
            ax.fill_between([n for n, _ in ceilings], [min(v) for _, v in ceilings], [max(v) for _, v in ceilings],
                            color=LIGHT_GREY, lw=0, zorder=0)
            ax.plot([n for n, _ in ceilings], [float(np.median(v)) for _, v in ceilings], ls=":", color="black",
                    label=wrap("ceiling, same run (median; shaded: range over layouts)", figure_width(width) / 2))
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [f"{n:,}" for n in counts])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_ylim(bottom=0)
        ax.set_xlabel("tokens moved")
        ax.set_ylabel("GB/s")
        ax.set_title(direction)
    unique_legend(fig, axes, loc="outside lower center", title=short_hardware(hardware),
                  ncols=_legend_columns(figure_width(width), len(layouts) + 1, 1.4))
    title(fig, f"{model_name(model)}, method {method}, {block_ids} blocks")
    return fig


DIRECTION_MARKERS = {"offload": "o", "load": "^"}


@paper_figure
def cost_model_figure(predicted: Sequence[dict], width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """Predicted against measured time for every row of one run (the newest in ``predicted``;
    colour: the method, marker: the direction); the diagonal is a perfect model, and each
    method's legend entry says how far off the model is: the median (mean) |relative error|
    of its rows."""
    inches = figure_width(width)
    wide = inches >= 5
    predicted = newest_run(predicted)
    fig, ax = plt.subplots(figsize=(inches, 3.6), layout="constrained")
    for method in dict.fromkeys(r["method"] for r in predicted):
        rows = [r for r in predicted if r["method"] == method]
        errors = [100 * abs(r["error"]) for r in rows]
        label = f"{method} {np.median(errors):.0f}% ({np.mean(errors):.0f}%)"
        colour = method_colour(method)
        for direction, marker in DIRECTION_MARKERS.items():
            picked = [r for r in rows if r["direction"] == direction]
            ax.scatter([r["seconds"] * 1e3 for r in picked], [r["predicted_s"] * 1e3 for r in picked], s=10,
                       marker=marker, color=colour, alpha=0.8, linewidths=0.8, label=label)
    for direction, marker in DIRECTION_MARKERS.items():  # the markers' key
        ax.scatter([], [], s=10, marker=marker, color=GREY, label=direction)
    low, high = ax.get_xlim()
    ax.plot([low, high], [low, high], color="black", lw=0.8, label="perfect model")
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):
        plain_log_ticks(axis)
    ax.set_xlabel("measured (ms)")
    ax.set_ylabel("predicted (ms)")
    machine = short_hardware(predicted[0].get("hardware"))
    unique_legend(fig, [ax], loc="outside right upper" if wide else "outside lower center",
                  title=f"{machine}\n|error|: median (mean)", ncols=1 if wide else _legend_columns(inches, 9, 1.5))
    ax.set_title(wrap("model: time = segments × cost per segment + bytes / bandwidth", inches - 0.4))
    return fig


@paper_figure
def break_even_figure(fits: Sequence, num_layers: int, tolerance: float = 0.1,
                      width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """Per-layer over cross-layer time against the per-layer segment size, per fitted model
    (kvlab.experiments.costmodel.CostFit) of one machine (fits of several are refused: whose
    threshold is whose would be a guess): colour the method, dashes the direction (one line
    for both where they agree within 3%, so neither hides the other), a vertical line where
    per-layer comes within ``tolerance`` of cross-layer."""
    machines = list(dict.fromkeys(f.hardware for f in fits))
    if len(machines) > 1:
        raise ValueError(f"fits of {len(machines)} machines ({machines}): a break-even figure draws one machine's; "
                         f"pass the fits of the run it shows")
    inches = figure_width(width)
    sizes = np.logspace(10, 24, 60, base=2)
    columns = _legend_columns(inches, len(fits), 1.5)
    fig, ax = plt.subplots(figsize=(inches, max(2.6, 1.9 + 0.18 * -(-len(fits) // columns))), layout="constrained")
    ratios = {f: np.array([f.predict(1 / s, 1) / f.predict(1 / (num_layers * s), 1) for s in sizes]) for f in fits}
    for method in dict.fromkeys(f.method for f in fits):
        mine = [f for f in fits if f.method == method]
        alike = len(mine) > 1 and all(np.allclose(ratios[f], ratios[mine[0]], rtol=0.03) for f in mine)
        for f in mine[:1] if alike else mine:
            label = f"{method} ({' ≈ '.join(g.direction for g in mine)})" if alike else f"{method} {f.direction}"
            ax.plot(sizes, ratios[f], label=label, color=method_colour(method),
                    ls="-" if alike else DIRECTION_STYLES.get(f.direction, ":"))
        for f in mine:
            even = f.break_even_segment_bytes(num_layers, tolerance)
            if even:
                ax.axvline(even, color=method_colour(method), lw=0.6,
                           ls="-" if alike else DIRECTION_STYLES.get(f.direction, ":"))
    ax.axhline(1 + tolerance, color="black", lw=0.6, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    plain_log_ticks(ax.yaxis)
    ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=4 if inches >= 5 else 16))  # sizes that fit
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: human_bytes(v)))
    ax.set_xlabel(wrap("per-layer segment size (cross-layer segments are L times larger)", inches - 0.6))
    ax.set_ylabel("per-layer /\ncross-layer time")
    ax.set_title(wrap(f"{num_layers} layers; vertical lines: per-layer within {tolerance:.0%} of cross-layer",
                      inches - 0.6))
    unique_legend(fig, [ax], loc="outside lower center", title=short_hardware(machines[0]) if machines else None,
                  ncols=columns)
    return fig


@paper_figure
def layerwise_figure(rows: Sequence[dict], width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """Speed-up of layer-by-layer loading overlapped with compute over load-then-compute, from
    one run (the newest in ``rows``)."""
    inches = figure_width(width)
    rows = newest_run(rows)
    fig, ax = plt.subplots(figsize=(inches, 2.6), layout="constrained")
    series = list(dict.fromkeys((r["model"], r["tokens"]) for r in rows))
    for k, key in enumerate(series):
        picked = sorted((r["intensity"], r["speedup"], r["ideal_speedup"]) for r in rows
                        if (r["model"], r["tokens"]) == key)
        x, speedup, ideal = zip(*picked)
        line, = ax.plot(x, speedup, marker="o", label=f"{model_name(key[0])}, {key[1]} tokens", color=f"C{k % 8}")
        ax.plot(x, ideal, ls=":", color=line.get_color())
    ax.axhline(1, color="black", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("compute per layer / load per layer")
    ax.set_ylabel("speed-up over\nload-then-compute")
    ax.set_title("layerwise loading (dotted: perfect overlap)")
    unique_legend(fig, [ax], loc="outside lower center", title=short_hardware(rows[0].get("hardware")),
                  ncols=_legend_columns(inches, len(series), 2.4))
    return fig


@paper_figure
def hardware_figure(rows: Sequence[dict], model: str, tokens: int, width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """Per-layer against cross-layer on every machine with results, compared by design: the
    best method's share of that machine's own ceiling, offload and load in a panel each, each
    bar naming its layout, method and GB/s."""
    inches = figure_width(width)
    chosen = ok_rows(rows, model=model, tokens=tokens, block_ids="scattered", target="host")
    machines = list(dict.fromkeys(r["hardware"] for r in chosen))
    fig, axes = panels(2, width, 0.9 + 0.75 * max(len(machines), 1), sharey=True, min_panel_width=3)
    longest = 1.0
    for ax, direction in zip(axes, ("offload", "load")):
        for i, machine in enumerate(machines):
            for j, (name, cross) in enumerate((("per-layer", False), ("cross-layer", True))):
                picked = [r for r in chosen if r["hardware"] == machine and r["cross_layer"] == cross
                          and r["direction"] == direction]
                if picked:
                    best = max(picked, key=lambda r: r["ratio"])
                    longest = max(longest, best["ratio"])
                    colour = CROSS_LAYER if cross else PER_LAYER
                    y = i + (j - 0.5) * 0.4
                    ax.barh(y, best["ratio"], 0.36, color=colour, label=name)
                    ax.text(0.02, y, f"{best['layout']} {best['method']}, {best['gbps']:.1f} GB/s", va="center",
                            fontsize=SMALL, color=ink(colour))
        ax.axvline(1, color="black", lw=0.8, ls="--")
        ax.set_title(f"{direction}")
        ax.set_xlabel(wrap("share of the machine's own copy ceiling", 2.6))
    for ax in axes:
        ax.set_xlim(0, 1.05 * longest)
    axes[0].set_yticks(range(len(machines)), [wrap(short_hardware(m), inches / 4, SMALL) for m in machines])
    axes[0].invert_yaxis()
    title(fig, f"{model_name(model)}: {tokens} tokens, scattered blocks; bars: the best method of each")
    unique_legend(fig, axes, loc="outside lower center", ncols=2)
    return fig
