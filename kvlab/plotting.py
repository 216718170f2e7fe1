"""Figures: the memory map of a small cache, segment scaling, and saving for papers.

Figures are drawn from kvlab's data (layouts and segment rows), never from a notebook's
private state, so every one can be regenerated with the same call.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Sequence

import matplotlib
import matplotlib.patches
import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np

from kvlab.geometry import ModelGeometry
from kvlab.layouts import Layout, address_labels, axis_sizes, get_layout
from kvlab.segments import block_segments

COLOUR_BY = ("layer", "block", "part", "token")
_CMAPS = {"layer": "tab10", "block": "tab20", "part": None, "token": "viridis"}
_PART_COLOURS = np.array([[0.12, 0.47, 0.71], [1.0, 0.5, 0.05]])


def miniature(geometry: ModelGeometry) -> ModelGeometry:
    """A few layers, heads and tokens of ``geometry``: small enough to draw every vector."""
    heads = 1 if geometry.is_mla else min(geometry.num_kv_heads, 2)
    return geometry.with_(
        name=f"{geometry.name} (miniature)",
        num_layers=min(geometry.num_layers, 4),
        num_kv_heads=heads,
        block_size=min(geometry.block_size, 4),
    )


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if float(n).is_integer() else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _colours(values: np.ndarray, by: str, count: int) -> np.ndarray:
    if by == "part":
        return _PART_COLOURS[values % 2]
    cmap = plt.get_cmap(_CMAPS[by])
    scale = values / max(count - 1, 1) if by == "token" else values % cmap.N
    return np.asarray(cmap(scale if by == "token" else scale.astype(int)))[:, :3]


def _legend(by: str, geometry: ModelGeometry, num_blocks: int) -> list[matplotlib.patches.Patch]:
    count = {"layer": geometry.num_layers, "block": num_blocks, "part": 2, "token": geometry.block_size}[by]
    shown = list(range(count)) if count <= 8 else [0, count // 2, count - 1]
    colours = _colours(np.array(shown), by, count)
    names = {"layer": "layer {}", "block": "block {}", "token": "token {}"}
    return [
        matplotlib.patches.Patch(
            color=c, label=geometry.part_names[v] if by == "part" else names[by].format(v)
        )
        for v, c in zip(shown, colours)
    ]


def draw_memory_map(
    ax: plt.Axes,
    layout: str | Layout,
    geometry: ModelGeometry,
    num_blocks: int,
    by: str = "layer",
    moved_blocks: Sequence[int] = (),
    width: int | None = None,
) -> None:
    """Draw the cache's address space, one cell per head vector, coloured by ``by``.

    Rows wrap every ``width`` cells (default: one layer's page of one block). Blocks in
    ``moved_blocks`` are drawn solid, the rest faded; the title gives their segment count.
    """
    layout = get_layout(layout)
    if by not in COLOUR_BY:
        raise ValueError(f"colour by one of {COLOUR_BY}, not {by!r}")
    labels = {k: v.numpy() for k, v in address_labels(layout, geometry, num_blocks).items()}
    counts = {"layer": geometry.num_layers, "block": num_blocks, "part": 2, "token": geometry.block_size}
    rgb = _colours(labels[by], by, counts[by])
    if moved_blocks:
        faded = ~np.isin(labels["block"], list(moved_blocks))
        rgb[faded] = 0.25 * rgb[faded] + 0.75
    width = width or geometry.block_size * geometry.num_kv_heads * axis_sizes(layout, geometry, num_blocks)["S"]
    rows = -(-len(rgb) // width)
    image = np.ones((rows * width, 3))
    image[: len(rgb)] = rgb
    ax.imshow(image.reshape(rows, width, 3), aspect="auto", interpolation="nearest")
    starts = np.flatnonzero(np.diff(labels["tensor"])) + 1
    for start in starts:
        ax.axhline(start / width - 0.5, color="black", lw=0.8)
    ax.set_xticks([])
    ax.set_yticks([])
    title = layout.name
    if moved_blocks:
        seg = block_segments(layout, geometry, num_blocks, moved_blocks)
        title += f"\n{seg.count} segment{'s' * (seg.count != 1)} for {len(moved_blocks)} blocks"
    ax.set_title(title, fontsize=9)


def memory_map(
    layouts: Iterable[str | Layout],
    geometry: ModelGeometry,
    num_blocks: int = 6,
    moved_blocks: Sequence[int] = (1, 4),
    colour_by: Sequence[str] = COLOUR_BY,
) -> plt.Figure:
    """Layouts side by side (columns), coloured by layer, block, K/V and token (rows)."""
    layouts = [get_layout(layout) for layout in layouts]
    fig, axes = plt.subplots(
        len(colour_by), len(layouts), figsize=(2.6 * len(layouts) + 0.8, 2.3 * len(colour_by)), squeeze=False
    )
    for row, by in enumerate(colour_by):
        for col, layout in enumerate(layouts):
            draw_memory_map(axes[row, col], layout, geometry, num_blocks, by, moved_blocks)
            if row:
                axes[row, col].set_title("")
        axes[row, 0].set_ylabel(f"by {by if by != 'part' else 'K/V'}\n(address →, wraps)", fontsize=9)
        axes[row, -1].legend(handles=_legend(by, geometry, num_blocks), loc="center left",
                             bbox_to_anchor=(1.02, 0.5), fontsize=7, frameon=False)
    fig.suptitle(
        f"{geometry.name}: {geometry.num_layers} layers, {num_blocks} blocks of {geometry.block_size} tokens, "
        f"{'one MLA latent' if geometry.is_mla else f'{geometry.num_kv_heads} kv heads'}; "
        f"one cell = one head vector; blocks {list(moved_blocks)} moved",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def segment_scaling(rows: Sequence[dict], title: str = "") -> plt.Figure:
    """Segments and mean segment size against tokens moved, a line per layout and block size.

    ``rows`` are kvlab.segments.sweep rows.
    """
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    series: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        series.setdefault((row["layout"], row["block_size"]), []).append(row)
    layouts = list(dict.fromkeys(k[0] for k in series))
    sizes = sorted({k[1] for k in series})
    styles = ["-", "--", ":", "-."]
    colours = plt.get_cmap("tab10")
    for (layout, block_size), points in series.items():
        points = sorted(points, key=lambda r: r["tokens"])
        tokens = [p["tokens"] for p in points]
        index = layouts.index(layout)
        style = dict(color=colours(index % 10), ls=styles[sizes.index(block_size) % 4],
                     marker="os^vDP*X"[index % 8], ms=7 - index % 4, mfc="none")
        label = f"{layout}, BS={block_size}"
        left.plot(tokens, [p["segments"] for p in points], label=label, **style)
        right.plot(tokens, [p["mean_segment_bytes"] for p in points], label=label, **style)
    for ax, ylabel in ((left, "contiguous segments"), (right, "mean segment size (bytes)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("tokens moved")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="major", alpha=0.3)
    right.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: human_bytes(v)))
    left.legend(fontsize=7, ncol=1)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def save_figure(fig: plt.Figure, name: str, figures_dir: str | Path, formats: Sequence[str] = ("png", "svg")) -> list[Path]:
    """Save ``fig`` as ``figures_dir/name.{png,svg}`` (PNG for reading, SVG/PDF for papers)."""
    figures_dir = Path(figures_dir)
    figures_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        path = figures_dir / f"{name}.{fmt}"
        # A fixed SVG id salt and no dates: the same data gives the same bytes (clean git diffs).
        with plt.rc_context({"svg.hashsalt": "kvlab"}):
            fig.savefig(path, dpi=150, bbox_inches="tight",
                        metadata={"svg": {"Date": None}, "pdf": {"CreationDate": None}}.get(fmt))
        paths.append(path)
    return paths


def segments_by_layout(rows: Sequence[dict], title: str = "") -> plt.Figure:
    """Segments (bars, log scale) and segment size (label) for every layout in ``rows``,
    one bar per block size. ``rows`` are kvlab.segments.sweep rows for one token count."""
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    sizes = sorted({r["block_size"] for r in rows})
    by_key = {(r["layout"], r["block_size"]): r for r in rows}
    height = 0.8 / len(sizes)
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(layouts) * len(sizes) + 1.2))
    for i, block_size in enumerate(sizes):
        ys = np.arange(len(layouts)) + i * height
        values = [by_key[(name, block_size)]["segments"] for name in layouts]
        bars = ax.barh(ys, values, height=height, label=f"block size {block_size}")
        for bar, name in zip(bars, layouts):
            row = by_key[(name, block_size)]
            ax.annotate(f" {row['segments']} x {human_bytes(row['mean_segment_bytes'])}",
                        (bar.get_width(), bar.get_y() + bar.get_height() / 2), va="center", fontsize=7)
    ax.set_yticks(np.arange(len(layouts)) + height * (len(sizes) - 1) / 2, layouts, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(0.8, 20 * max(r["segments"] for r in rows))
    ax.set_xlabel("contiguous segments (log)")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def atlas(
    layouts: Sequence[str | Layout],
    geometry: ModelGeometry,
    by: str = "layer",
    num_blocks: int = 6,
    moved_blocks: Sequence[int] = (1, 4),
    columns: int = 6,
) -> plt.Figure:
    """Every layout on one page, coloured by one property: the whole atlas at a glance."""
    layouts = [get_layout(layout) for layout in layouts]
    rows = -(-len(layouts) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(2.4 * columns + 1, 2.5 * rows), squeeze=False)
    for ax, layout in zip(axes.flat, layouts):
        draw_memory_map(ax, layout, geometry, num_blocks, by, moved_blocks)
        ax.set_title(ax.get_title(), fontsize=7)
    for ax in list(axes.flat)[len(layouts):]:
        ax.axis("off")
    axes[0, -1].legend(handles=_legend(by, geometry, num_blocks), loc="upper left",
                       bbox_to_anchor=(1.02, 1.0), fontsize=7, frameon=False)
    fig.suptitle(f"{geometry.name}: every layout, coloured by {by}; blocks {list(moved_blocks)} moved", fontsize=10)
    fig.tight_layout()
    return fig


# --- transfer timing (notebook 02) ------------------------------------------------------

_METHOD_COLOURS = {"segments": "#d62728", "gather": "#1f77b4", "compiled": "#2ca02c", "triton": "#9467bd",
                   "lmcache": "#ff7f0e", "vllm": "#8c564b"}


def _ok(rows: Iterable[dict], **match) -> list[dict]:
    return [r for r in rows if r.get("status") == "ok" and all(r.get(k) == v for k, v in match.items())]


def transfer_ratios(rows: Sequence[dict], model: str, tokens: int, block_ids: str = "scattered",
                    target: str = "host") -> plt.Figure:
    """Each layout x method as a share of the copy ceiling measured beside it, per direction."""
    chosen = _ok(rows, model=model, tokens=tokens, block_ids=block_ids, target=target)
    layouts = list(dict.fromkeys(r["layout"] for r in chosen))
    methods = [m for m in _METHOD_COLOURS if any(r["method"] == m for r in chosen)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharey=True)
    width = 0.8 / max(len(methods), 1)
    for ax, direction in zip(axes, ("offload", "load")):
        for j, method in enumerate(methods):
            for i, layout in enumerate(layouts):
                hit = [r for r in chosen if r["layout"] == layout and r["method"] == method and r["direction"] == direction]
                if hit:
                    r = hit[0]
                    ax.bar(i + j * width, r["ratio"], width, color=_METHOD_COLOURS[method], label=method)
                    ax.text(i + j * width, r["ratio"] + 0.02, f"{r['gbps']:.1f}", ha="center", fontsize=6, rotation=90)
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(layouts))], layouts, fontsize=8)
        ax.set_title(f"{direction} ({'device to host' if direction == 'offload' else 'host to device'})", fontsize=9)
        ax.set_ylim(0, 1.25)
    axes[0].set_ylabel("share of the copy ceiling (1 = one big memcpy)")
    handles, labels = axes[0].get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    axes[1].legend(unique.values(), unique.keys(), fontsize=7, loc="upper right")
    hardware = chosen[0]["hardware"] if chosen else ""
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
                           marker=marker, color=_METHOD_COLOURS.get(method), alpha=0.7,
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
                        color=_METHOD_COLOURS.get(f.method), ls="-" if f.direction == "offload" else "--")
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


# --- layerwise hooks (kvlab.hooks) ------------------------------------------------------

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


# --- the connector in vLLM (kvlab.engine, kvlab.vllm_driver) -----------------------------


def ttft_figure(rows: Sequence[dict], title: str = "") -> plt.Figure:
    """Median time to first token per scenario (whiskers: min to max over the samples), with
    vLLM's own prefix-cache hit as the floor; each connector's overhead over it in brackets."""
    rows = list(rows)
    fig, ax = plt.subplots(figsize=(7.5, 0.8 + 0.38 * max(len(rows), 1)))
    colours = {"none": "#7f7f7f", "kvlab": "#1f77b4", "example": "#ff7f0e", "lmcache": "#2ca02c"}
    for i, r in enumerate(rows):
        ms = 1e3 * r["median_s"]
        ax.barh(i, ms, 0.7, color=colours.get(r["connector"], "#9467bd"))
        ax.errorbar(ms, i, xerr=[[ms - 1e3 * r["min_s"]], [1e3 * r["max_s"] - ms]], color="black", lw=0.8, capsize=2)
        overhead = r.get("overhead_s")
        note = f"{ms:.0f} ms" if overhead is None or overhead != overhead else f"{ms:.0f} ms (+{1e3 * overhead:.0f})"
        ax.text(1e3 * r["max_s"] * 1.05, i, note, va="center", fontsize=7)
    floor = [r for r in rows if r["scenario"] == "vLLM prefix hit"]
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
    axes[0].set_xscale("log")
    axes[0].set_yticks(range(len(rows)), labels, fontsize=7)
    axes[0].invert_yaxis()
    fig.suptitle(title + " (green: cross-layer)", fontsize=9)
    fig.tight_layout()
    return fig


# --- accuracy and the connectors side by side (kvlab.accuracy, kvlab.engine) -------------

_PATH_COLOURS = {"recompute": "#7f7f7f", "vLLM prefix-cache hit": "#000000", "no connector": "#7f7f7f",
                 "LMCache": "#2ca02c", "ExampleConnector": "#ff7f0e"}


def _path_colour(name: str) -> str:
    return "#1f77b4" if name.startswith("KVLab") else _PATH_COLOURS.get(name, "#9467bd")


def _rows_labelled(fig: plt.Figure, ax: plt.Axes, labels: Sequence[str], title: str) -> plt.Figure:
    """Name the horizontal bars top to bottom (shared y axis) and finish the figure."""
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def roundtrip_figure(summary: Sequence[dict], title: str = "") -> plt.Figure:
    """KV round trips (rows of kvlab.accuracy.roundtrip_summary) per model and layout (rows)
    and copy method (columns): bit-exact out of run; grey where the method cannot run here."""
    summary = list(summary)
    lines = list(dict.fromkeys((r["model"], r["layout"]) for r in summary))
    methods = list(dict.fromkeys(r["method"] for r in summary))
    cells = {(r["model"], r["layout"], r["method"]): r for r in summary}
    fig, ax = plt.subplots(figsize=(2.6 + 0.9 * len(methods), 0.8 + 0.22 * len(lines)))
    for i, (model, layout) in enumerate(lines):
        for j, method in enumerate(methods):
            cell = cells.get((model, layout, method))
            ran, exact = (cell["round_trips"], cell["bit_exact"]) if cell else (0, 0)
            colour = "#dddddd" if not ran else ("#2ca02c" if exact == ran else "#d62728")
            ax.add_patch(matplotlib.patches.Rectangle((j, i), 1, 1, color=colour, ec="white"))
            ax.text(j + 0.5, i + 0.5, f"{exact}/{ran}" if ran else "n/a", ha="center", va="center", fontsize=6)
    ax.set_xlim(0, len(methods))
    ax.set_ylim(len(lines), 0)
    ax.set_xticks([j + 0.5 for j in range(len(methods))], methods, fontsize=7)
    ax.set_yticks([i + 0.5 for i in range(len(lines))],
                  [f"{layout} ({model.split('/')[-1].split(' ')[0]})" for model, layout in lines], fontsize=6)
    ax.set_title(title or "KV round trips: bit-exact / run (grey: not available here)", fontsize=9)
    fig.tight_layout()
    return fig


def accuracy_figure(generations: Sequence[dict], perplexity: Sequence[dict], scores: Sequence[dict],
                    title: str = "") -> plt.Figure:
    """Per reuse path: the largest logprob difference against recompute and against vLLM's
    own prefix hit (0 drawn at the axis floor), the share of identical generations, and
    task accuracy +/- stderr."""
    fig, axes = plt.subplots(1, 3, figsize=(12, 0.9 + 0.42 * max(len(generations), 1)), sharey=True)
    names = [r["path"] for r in generations]
    colours = [_path_colour(n) for n in names]
    floor = 1e-8
    by_path = {r["path"]: r for r in perplexity}
    for k, (key, marker, label) in enumerate((("max_logprob_diff", "o", "vs recompute"),
                                              ("max_logprob_diff_vs_control", "s", "vs vLLM prefix hit"))):
        values = [max(g[key], by_path[g["path"]][key], floor) for g in generations]
        axes[0].scatter(values, [i + 0.15 * (k - 0.5) for i in range(len(names))], marker=marker, c=colours, label=label)
    axes[0].set_xscale("log")
    axes[0].axvline(floor, color="black", lw=0.6, ls=":")
    axes[0].set_xlabel(f"max |logprob difference| (log; {floor:g} = bitwise equal)")
    axes[0].legend(fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, frameon=False)
    axes[1].barh(range(len(names)), [100 * g["identical_share"] for g in generations], 0.7, color=colours)
    axes[1].set_xlim(0, 105)
    axes[1].set_xlabel("identical greedy generations (%)")
    flexible = {s["path"]: s for s in scores if s["filter"] == "flexible-extract"}
    accuracy = [100 * flexible[n]["accuracy"] for n in names]
    axes[2].barh(range(len(names)), accuracy, 0.7, color=colours,
                 xerr=[100 * flexible[n]["stderr"] for n in names], capsize=3)
    for i, (a, n) in enumerate(zip(accuracy, names)):
        axes[2].text(a, i, f" {a:.1f}% ± {100 * flexible[n]['stderr']:.1f} (n={int(flexible[n]['n'])})", va="center",
                     fontsize=7)
    axes[2].set_xlim(0, max([5.0] + [a + 100 * flexible[n]["stderr"] for a, n in zip(accuracy, names)]) * 1.4)
    axes[2].set_xlabel("task accuracy, flexible-extract (%, +/- stderr)")
    return _rows_labelled(fig, axes[0], names, title)


def comparison_figure(rows: Sequence[dict], title: str = "") -> plt.Figure:
    """Connectors side by side: time to first token cold and warm (with vLLM's own prefix
    hit as the floor), and the effective retrieve throughput a request sees."""
    rows = list(rows)
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.9 + 0.5 * max(len(rows), 1)), sharey=True)
    names = [r["connector"] for r in rows]
    for i, r in enumerate(rows):
        axes[0].barh(i - 0.2, 1e3 * r["cold_s"], 0.38, color="#bbbbbb")
        if r.get("warm_s") is not None:
            axes[0].barh(i + 0.2, 1e3 * r["warm_s"], 0.38, color=_path_colour(r["connector"]))
            axes[0].text(1e3 * r["warm_s"] * 1.05, i + 0.2, f"{1e3 * r['warm_s']:.0f} ms", va="center", fontsize=7)
        axes[0].text(1e3 * r["cold_s"] * 1.05, i - 0.2, f"{1e3 * r['cold_s']:.0f} ms", va="center", fontsize=7)
        axes[0].plot(1e3 * r["floor_s"], i + 0.2, "k|", ms=12)
        gbps = r.get("retrieve_gbps")
        axes[1].barh(i, gbps or 0, 0.6, color=_path_colour(r["connector"]))
        if gbps:
            axes[1].text(gbps, i, f" {gbps:.2f} GB/s", va="center", fontsize=7)
    axes[0].set_xscale("log")
    axes[0].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[0].set_xlabel("time to first token (ms, log)\ngrey: cold; colour: warm; |: the engine's own prefix hit")
    axes[1].set_xlabel("retrieve throughput a request sees (GB/s)\nKV bytes / (warm - prefix hit without connector)")
    return _rows_labelled(fig, axes[0], names, title)
