"""Figures of notebook 02: transfer timing against the same-run copy ceiling, bandwidth,
the fitted cost model, break-even segment sizes, layerwise loading, machines side by side.
Every copy method keeps the colour its registry entry gives it."""

from __future__ import annotations

from typing import Sequence

import matplotlib
import matplotlib.patches
import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np

from kvlab.plotting.common import _ok, human_bytes
from kvlab.transfer.registry import get_method, method_colours


def transfer_ratios(rows: Sequence[dict], model: str, tokens: int, block_ids: str = "scattered",
                    target: str = "host") -> plt.Figure:
    """Each layout x method as a share of the copy ceiling measured beside it, per direction;
    whiskers span the repeats' quartiles and hatched bars are flagged as noise."""
    chosen = _ok(rows, model=model, tokens=tokens, block_ids=block_ids, target=target)
    layouts = list(dict.fromkeys(r["layout"] for r in chosen))
    colours = method_colours()
    methods = [m for m in colours if any(r["method"] == m for r in chosen)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharey=True)
    width = 0.8 / max(len(methods), 1)
    for ax, direction in zip(axes, ("offload", "load")):
        for j, method in enumerate(methods):
            for i, layout in enumerate(layouts):
                hit = [r for r in chosen if r["layout"] == layout and r["method"] == method and r["direction"] == direction]
                if hit:
                    r = hit[0]
                    spread = ([[r["ratio"] - r["ratio_q1"]], [r["ratio_q3"] - r["ratio"]]]
                              if "ratio_q1" in r else None)  # the repeats' quartiles, where recorded
                    ax.bar(i + j * width, r["ratio"], width, color=colours[method], label=get_method(method).legend,
                           yerr=spread, error_kw={"lw": 0.6, "capsize": 1.5}, hatch="//" if r.get("noisy") else None)
                    ax.text(i + j * width, r["ratio"] + 0.02, f"{r['gbps']:.1f}", ha="center", fontsize=6, rotation=90)
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(layouts))], layouts, fontsize=8)
        ax.set_title(f"{direction} ({'device to host' if direction == 'offload' else 'host to device'})", fontsize=9)
        ax.set_ylim(0, 1.25)
    axes[0].set_ylabel("share of the copy ceiling (1 = one big memcpy)")
    handles, labels = axes[0].get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    axes[1].legend(unique.values(), unique.keys(), fontsize=7, loc="upper right")
    hardware = chosen[0].get("hardware", "this machine") if chosen else ""
    fig.suptitle(f"{model}: {tokens} tokens, {block_ids} blocks ({hardware}); numbers are GB/s", fontsize=9)
    fig.tight_layout()
    return fig


def bandwidth_vs_tokens(rows: Sequence[dict], model: str, method: str, block_ids: str = "scattered") -> plt.Figure:
    """GB/s against tokens moved for each layout, with the ceiling measured beside it."""
    chosen = _ok(rows, model=model, method=method, block_ids=block_ids, target="host")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), sharey=True)
    for ax, direction in zip(axes, ("offload", "load")):
        picked = [r for r in chosen if r["direction"] == direction]
        for layout in dict.fromkeys(r["layout"] for r in picked):
            line = sorted((r["tokens"], r["gbps"]) for r in picked if r["layout"] == layout)
            ax.plot(*zip(*line), marker="o", label=layout)
        ceiling = sorted({(r["tokens"], r["ceiling_gbps"]) for r in picked})
        if ceiling:
            ax.plot(*zip(*ceiling), ls=":", color="black", label="ceiling (same run)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens moved")
        ax.set_title(direction, fontsize=9)
    axes[0].set_ylabel("GB/s")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"{model}, method {method}, {block_ids} blocks", fontsize=9)
    fig.tight_layout()
    return fig


def cost_model_figure(predicted: Sequence[dict]) -> plt.Figure:
    """Predicted against measured time for every row, per method; the diagonal is a perfect model."""
    fig, ax = plt.subplots(figsize=(5.2, 4.6))
    for method in dict.fromkeys(r["method"] for r in predicted):
        rows = [r for r in predicted if r["method"] == method]
        for direction, marker in (("offload", "o"), ("load", "^")):
            picked = [r for r in rows if r["direction"] == direction]
            if picked:
                error = 100 * sum(abs(r["error"]) for r in picked) / len(picked)
                ax.scatter([r["seconds"] * 1e3 for r in picked], [r["predicted_s"] * 1e3 for r in picked], s=12,
                           marker=marker, color=method_colours().get(method), alpha=0.7,
                           label=f"{method} {direction} (mean error {error:.0f}%)")
    low, high = ax.get_xlim()
    ax.plot([low, high], [low, high], color="black", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured (ms)")
    ax.set_ylabel("predicted: segments x cost + bytes / bandwidth (ms)")
    ax.legend(fontsize=6)
    fig.tight_layout()
    return fig


def break_even_figure(fits: Sequence, num_layers: int, tolerance: float = 0.1) -> plt.Figure:
    """Per-layer over cross-layer time against the per-layer segment size, per fitted model."""
    sizes = np.logspace(10, 24, 60, base=2)
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for f in fits:
        ratio = [f.predict(1 / s, 1) / f.predict(1 / (num_layers * s), 1) for s in sizes]
        line, = ax.plot(sizes, ratio, label=f"{f.hardware.split(':')[0]} {f.method} {f.direction}",
                        color=method_colours().get(f.method), ls="-" if f.direction == "offload" else "--")
        even = f.break_even_segment_bytes(num_layers, tolerance)
        if even:
            ax.axvline(even, color=line.get_color(), lw=0.6, ls=line.get_linestyle())
    ax.axhline(1 + tolerance, color="black", lw=0.6, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: human_bytes(v)))
    ax.set_xlabel("per-layer segment size (cross-layer segments are L times larger)")
    ax.set_ylabel("per-layer time / cross-layer time")
    ax.set_title(f"{num_layers} layers; vertical lines: per-layer within {tolerance:.0%} of cross-layer", fontsize=9)
    ax.legend(fontsize=6)
    fig.tight_layout()
    return fig


def layerwise_figure(rows: Sequence[dict]) -> plt.Figure:
    """Speed-up of layer-by-layer loading overlapped with compute over load-then-compute."""
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for key in dict.fromkeys((r["hardware"], r["model"], r["tokens"]) for r in rows):
        picked = sorted((r["intensity"], r["speedup"], r["ideal_speedup"]) for r in rows
                        if (r["hardware"], r["model"], r["tokens"]) == key)
        x, speedup, ideal = zip(*picked)
        line, = ax.plot(x, speedup, marker="o", label=f"{key[1].split('/')[-1]}, {key[2]} tokens ({key[0].split(':')[0]})")
        ax.plot(x, ideal, ls=":", color=line.get_color())
    ax.axhline(1, color="black", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("compute per layer / load per layer")
    ax.set_ylabel("load-then-compute time / layerwise time")
    ax.set_title("layerwise loading (dotted: perfect overlap)", fontsize=9)
    ax.legend(fontsize=6)
    fig.tight_layout()
    return fig


def hardware_figure(rows: Sequence[dict], model: str, tokens: int) -> plt.Figure:
    """Per-layer against cross-layer on every machine with results: the best method's share of
    that machine's ceiling, each labelled with its hardware."""
    chosen = _ok(rows, model=model, tokens=tokens, block_ids="scattered", target="host")
    machines = list(dict.fromkeys(r["hardware"] for r in chosen))
    fig, ax = plt.subplots(figsize=(7, 0.9 + 0.9 * max(len(machines), 1)))
    bars = [("per-layer", False, "offload"), ("per-layer", False, "load"), ("cross-layer", True, "offload"),
            ("cross-layer", True, "load")]
    for i, machine in enumerate(machines):
        for j, (name, cross, direction) in enumerate(bars):
            picked = [r for r in chosen if r["hardware"] == machine and r["cross_layer"] == cross
                      and r["direction"] == direction]
            if picked:
                best = max(picked, key=lambda r: r["ratio"])
                y = i + j * 0.2
                ax.barh(y, best["ratio"], 0.18, color=("#1f77b4", "#aec7e8", "#2ca02c", "#98df8a")[j],
                        label=f"{name} {direction}" if i == 0 else None)
                ax.text(best["ratio"] + 0.01, y, f"{best['layout']} {best['method']} {best['gbps']:.1f} GB/s",
                        va="center", fontsize=6)
    ax.set_yticks([i + 0.3 for i in range(len(machines))], machines, fontsize=7)
    ax.axvline(1, color="black", lw=0.8, ls="--")
    ax.set_xlim(0, 1.6)
    ax.set_xlabel("best method's share of the machine's own copy ceiling")
    ax.set_title(f"{model}: {tokens} tokens, scattered blocks", fontsize=9)
    ax.legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    return fig
