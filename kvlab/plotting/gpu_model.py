"""Figures and prose of notebook 02's GPU section, drawn from the published table and the GPU
cost model (kvlab.experiments.published, kvlab.experiments.gpu_costmodel): published against
predicted, per-layer against cross-layer on three machines, and the Markdown that states their
numbers (computed here, never typed into a notebook). Each figure's footer names the sources."""

from __future__ import annotations

import math
from statistics import median
from typing import Any, Sequence

import matplotlib.lines
import matplotlib.pyplot as plt
import numpy as np

from kvlab.experiments.gpu_costmodel import MACHINES, QUESTION_MECHANISMS, SMALL_PAGE_BYTES
from kvlab.experiments.published import MECHANISMS, OWN_SOURCE
from kvlab.plotting.common import (BLACK, DEFAULT_WIDTH, GREY, PURPLE, as_records, figure_width, method_colour, model_name,
                                   paper_figure, plain_log_ticks, plural, title)

# one colour per mechanism, the colour of the kvlab method that works that way
MECHANISM_COLOURS = {"dma_batch": method_colour("dma"), "memcpy_per_segment": method_colour("segments"),
                     "copy_kernel": method_colour("triton"), "nixl": PURPLE, "copy_engine": BLACK}
MECHANISM_LABELS = {"dma_batch": "batched DMA", "memcpy_per_segment": "copy per segment",
                    "copy_kernel": "copy kernel", "nixl": "NIXL", "copy_engine": "copy engine (link)"}
# panels of the published figure: the quoted units that share an axis
UNIT_PANELS = (("per call (µs)", ("us",)), ("time (ms)", ("ms", "s")), ("bandwidth (GB/s)", ("GB/s",)),
               ("share (%) or ratio (×)", ("%", "x")))
ROLE_MARKERS = {"fit": dict(marker="o", facecolors="none"), "held-out": dict(marker="o"), "own": dict(marker="D")}
MODEL_MARKERS = "os^"
LINK_NAMES = {"pcie5": "PCIe Gen5", "nvlink_c2c": "NVLink-C2C"}
ERASED = 0.1  # a batched copy's cross-layer gain under 1 + this: erased


def citations(evaluation: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows a figure's footer names: each published source with its hardware, and kvlab's
    own runs by machine (kvlab.plotting.common.provenance)."""
    out = []
    for row in as_records(evaluation):
        if row["source"] == OWN_SOURCE:
            out.append({"hardware": row["hardware"], "profile": "kvlab"})
        else:
            out.append({"published": row["source"], "hardware": row["hardware"]})
    return out


@paper_figure
def published_figure(evaluation: Sequence[dict[str, Any]], width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """Each predicted row, quoted (x) against predicted (y), one panel per kind of unit: colour the
    mechanism, hollow a fitting row, filled a held-out one, a diamond kvlab's own; the diagonal is
    a perfect model, the dotted lines 25 % off it. The legend gives each mechanism's median
    |held-out error|."""
    rows = as_records(evaluation)
    inches = figure_width(width)
    narrow = inches < 5  # a single column: the four panels one above the other, each the full width
    fig, grid = plt.subplots(4 if narrow else 2, 1 if narrow else 2, figsize=(inches, 8.0 if narrow else 4.0),
                             layout="constrained", squeeze=False)
    for ax, (label, units) in zip(grid.flat, UNIT_PANELS):
        picked = [r for r in rows if r["unit"] in units]
        for role, style in ROLE_MARKERS.items():
            for mechanism in MECHANISMS:
                points = [r for r in picked if r["role"] == role and r["mechanism"] == mechanism]
                if points:
                    colour = MECHANISM_COLOURS[mechanism]
                    ax.scatter([r["quoted"] for r in points], [r["predicted"] for r in points], s=12, linewidths=0.8,
                               edgecolors=colour, **({"c": colour} if "facecolors" not in style else {}), **style)
        values = [v for r in picked for v in (r["quoted"], r["predicted"]) if v > 0]
        low, high = (min(values) / 2, max(values) * 2) if values else (0.1, 10)
        line = np.geomspace(low, high, 2)
        ax.plot(line, line, color="black", lw=0.8)
        for factor in (1.25, 1 / 1.25):
            ax.plot(line, line * factor, color=GREY, lw=0.6, ls=":")
        ax.set(xscale="log", yscale="log", xlim=(low, high), ylim=(low, high))
        plain_log_ticks(ax.xaxis)
        plain_log_ticks(ax.yaxis)
        ax.set_title(label)
    for ax in grid[-1]:
        ax.set_xlabel("published")
    for ax in grid[:, 0]:
        ax.set_ylabel("predicted")
    held = [r for r in rows if r["role"] == "held-out"]
    keys = []
    for mechanism in MECHANISMS:
        errors = [abs(r["error"]) for r in held if r["mechanism"] == mechanism]
        if errors:
            keys.append(matplotlib.lines.Line2D([], [], ls="", marker="o", ms=4, color=MECHANISM_COLOURS[mechanism],
                                                label=f"{MECHANISM_LABELS[mechanism]} {100 * median(errors):.0f}%"))
    keys += [matplotlib.lines.Line2D([], [], ls="", marker="o", ms=4, mfc="none", color=GREY, label="fitted"),
             matplotlib.lines.Line2D([], [], ls="", marker="o", ms=4, color=GREY, label="held out")]
    if any(r["role"] == "own" for r in rows):
        keys.append(matplotlib.lines.Line2D([], [], ls="", marker="D", ms=4, color=GREY, label="kvlab's own"))
    fig.legend(handles=keys, loc="outside lower center", ncols=max(2, min(len(keys), int(inches // 1.7))),
               title="median |held-out error|")
    title(fig, "Published GPU copy measurements against the model")
    return fig


@paper_figure
def layout_question_figure(question: Sequence[dict[str, Any]], tokens: int = 8192,
                           width: str | float = DEFAULT_WIDTH) -> plt.Figure:
    """Per-layer over cross-layer load time (the gain of a cross-layer cache) for a ``tokens``
    prefix, one panel per machine, a row per mechanism, a marker per model, whiskers the
    held-out error band (NIXL over IB has none: one held-out row)."""
    rows = [r for r in as_records(question) if r["tokens"] == tokens]
    models = list(dict.fromkeys(r["model"] for r in rows))
    machines = [m for m in MACHINES if any(r["machine"] == m for r in rows)]
    inches = figure_width(width)
    across = inches / len(machines) >= 2.2
    fig, axes = plt.subplots(1 if across else len(machines), len(machines) if across else 1, sharex=True, sharey=True,
                             figsize=(inches, 2.3 if across else 1.7 * len(machines)), layout="constrained",
                             squeeze=False)
    for ax, machine in zip(axes.flat, machines):
        for i, mechanism in enumerate(QUESTION_MECHANISMS):
            for k, model in enumerate(models):
                hit = [r for r in rows if r["machine"] == machine and r["mechanism"] == mechanism and r["model"] == model]
                if not hit:
                    continue
                r, y = hit[0], i + (k - (len(models) - 1) / 2) * 0.22
                band = [[r["gain"] - r["gain_low"]], [r["gain_high"] - r["gain"]]] if not math.isnan(r["gain_low"]) else None
                ax.errorbar(r["gain"], y, xerr=band, fmt=MODEL_MARKERS[k % len(MODEL_MARKERS)], ms=3.5,
                            color=MECHANISM_COLOURS[mechanism], ecolor=GREY, elinewidth=0.7, capsize=1.5,
                            label=model_name(model))
        ax.axvline(1, color="black", lw=0.8, ls="--")
        ax.set_xscale("log")
        plain_log_ticks(ax.xaxis)
        ax.set_title(f"{machine} ({LINK_NAMES[MACHINES[machine]]})")
        ax.grid(axis="y", color="0.9", lw=0.5)
    axes.flat[0].set_yticks(range(len(QUESTION_MECHANISMS)), [MECHANISM_LABELS[m] for m in QUESTION_MECHANISMS])
    axes.flat[0].invert_yaxis()
    for ax in axes[-1]:
        ax.set_xlabel("per-layer / cross-layer load time")
    _model_legend(fig, models, inches)
    title(fig, f"Does a cross-layer cache load faster? {tokens:,}-token prefixes, predicted")
    return fig


def _model_legend(fig: plt.Figure, models: Sequence[str], inches: float) -> None:
    keys = [matplotlib.lines.Line2D([], [], ls="", marker=MODEL_MARKERS[k % len(MODEL_MARKERS)], ms=4, color=GREY,
                                    label=model_name(model)) for k, model in enumerate(models)]
    keys.append(matplotlib.lines.Line2D([], [], color="black", lw=0.8, ls="--", label="no gain"))
    fig.legend(handles=keys, loc="outside lower center", ncols=max(1, min(len(keys), int(inches // 1.6))))


def _span(values: Sequence[float], digits: int = 1) -> str:
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return f"{low}x" if low == high else f"{low}–{high}x"


def fit_markdown(evaluation: Sequence[dict[str, Any]], parameters: Sequence[dict[str, Any]]) -> str:
    """What the fit reproduces and how far off its held-out predictions are, per mechanism."""
    rows = as_records(evaluation)
    fitted = [r for r in rows if r["role"] == "fit"]
    held = [r for r in rows if r["role"] == "held-out"]
    errors = [abs(r["error"]) for r in held]
    worst = max(held, key=lambda r: abs(r["error"]))
    per_mechanism = "; ".join(
        f"{MECHANISM_LABELS[m]} {100 * median([abs(r['error']) for r in held if r['mechanism'] == m]):.0f}% "
        f"({plural(sum(r['mechanism'] == m for r in held), 'row')})" for m in MECHANISMS if any(r["mechanism"] == m for r in held))
    own = [r for r in rows if r["role"] == "own"]
    own_text = (f" kvlab's own GPU rows ({len(own)}, {', '.join(sorted({r['hardware'] for r in own}))}) are predicted "
                f"with a median |error| of {100 * median(abs(r['error']) for r in own):.0f}%." if own else
                " kvlab has no GPU rows of its own yet: `make run` on a GPU machine adds them here, as held out.")
    return (f"The model has {len(parameters)} parameters, each fitted on one named row ({len(fitted)} rows); it "
            f"reproduces them within {100 * max(abs(r['error']) for r in fitted):.2f}%. On the {len(held)} held-out rows "
            f"from {len({r['source'] for r in held})} sources its median |error| is {100 * median(errors):.0f}%, "
            f"{sum(e <= 0.25 for e in errors)} of {len(held)} within 25%; by mechanism: {per_mechanism}. The worst: "
            f"`{worst['id']}` ({worst['source']}), {worst['quoted']:.3g} {worst['unit']} published against "
            f"{worst['predicted']:.3g} predicted ({100 * worst['error']:+.0f}%).{own_text}")


def answer_markdown(question: Sequence[dict[str, Any]], cpu_gains: Sequence[dict[str, Any]],
                    evaluation: Sequence[dict[str, Any]] = ()) -> str:
    """The reference pull requests' question answered from the model (with NIXL's held-out
    error from ``evaluation``), and set against the CPU cost model's gains
    (kvlab.experiments.costmodel.chunk_gain rows) where they disagree."""
    rows = as_records(question)
    nixl_errors = [e["error"] for e in as_records(evaluation) if e["role"] == "held-out" and e["mechanism"] == "nixl"]

    def gains(mechanism: str, links: Sequence[str], small: bool | None = None) -> list[float]:
        return [r["gain"] for r in rows if r["mechanism"] == mechanism and r["link"] in links
                and (small is None or (r["per_layer_segment_bytes"] < SMALL_PAGE_BYTES) == small)]

    pcie, c2c = ("pcie5",), ("nvlink_c2c",)
    cliff = f"{SMALL_PAGE_BYTES // 1024} KiB"
    small_pages = sorted({f"{model_name(r['model'])} ({r['per_layer_segment_bytes'] / 1024:.0f} KiB)" for r in rows
                          if r["per_layer_segment_bytes"] < SMALL_PAGE_BYTES})
    kernel = [r for r in rows if r["mechanism"] == "copy_kernel"]
    asked = (f"{', '.join(dict.fromkeys(model_name(r['model']) for r in rows))}; "
             f"{', '.join(f'{t:,}' for t in sorted({r['tokens'] for r in rows}))} tokens")
    large, small = gains("dma_batch", pcie, small=False), gains("dma_batch", pcie, small=True)
    dma = " but ".join(
        ([f"{_span(large, 2)} on H100 and H200 where per-layer pages are {cliff} or more"] if large else [])
        + ([f"{_span(small)} for {', '.join(small_pages)}, whose pages fall under the DMA's small-page cliff"]
           if small else []))
    text = (f"**The answer, from the model** ({asked}; scattered blocks loaded from host memory). With one "
            f"`cudaMemcpyAsync` per segment, a cross-layer cache loads {_span(gains('memcpy_per_segment', pcie))} "
            f"faster on H100 and H200 and {_span(gains('memcpy_per_segment', c2c))} on GB200. With batched DMA "
            f"(`cuMemcpyBatchAsync`) it gains {dma}, and {_span(gains('dma_batch', c2c))} on GB200, whose faster link "
            f"leaves descriptor submission the larger cost. A copy kernel gains nothing in the model "
            f"({_span([r['gain'] for r in kernel], 2)}, band "
            f"{min(r['gain_low'] for r in kernel):.2f}–{max(r['gain_high'] for r in kernel):.2f}x: its rule has no "
            f"per-segment cost, and no published row measures one), and NIXL gains {_span(gains('nixl', pcie))} over "
            f"InfiniBand (rc_x) and {_span(gains('nixl', c2c))} over MNNVL (cuda_ipc)"
            + (f", numbers to read as rough: its one held-out row is off by "
               f"{', '.join(f'{100 * e:+.0f}%' for e in nixl_errors)}" if nixl_errors else "")
            + ". Every band is in the table.")
    cpu = [g for g in as_records(cpu_gains) if g["method"] in ("gather", "memcpy", "segments")]
    if not cpu:
        return text
    by_method = {m: [g["gain"] for g in cpu if g["method"] == m] for m in ("gather", "memcpy", "segments")}
    cpu_text = "; ".join(f"`{m}` {_span(v, 2)}" for m, v in by_method.items() if v)
    batched = by_method["gather"] + by_method["memcpy"]
    erased = ("batched copies erase it" if batched and max(batched) < 1 + ERASED else
              "batched copies keep part of it" if batched else "no batched copy was fitted")
    agree = (f" On GPUs the model agrees for a copy kernel and for batched DMA of pages of {cliff} or more over "
             f"PCIe ({_span(large, 2)})." if large else " On GPUs the model agrees for a copy kernel.")
    disagree = " and ".join(
        ([f"batched DMA of pages under {cliff} ({_span(small)})"] if small else [])
        + [f"batched DMA over NVLink-C2C ({_span(gains('dma_batch', c2c))})"])
    return (text + f"\n\n**Against kvlab's CPU finding.** On the CPUs measured here, cross-layer's gain per "
            f"{cpu[0]['tokens']}-token chunk under the CPU cost model is {cpu_text}: {erased}.{agree} The published "
            f"data disagree where the DMA's cost follows its descriptors (their number, or their size under "
            f"{cliff}) rather than the bytes alone: {disagree} still gain from a cross-layer cache. The cliff was "
            f"measured on an H100; on GB200 it is assumed, not measured.")
