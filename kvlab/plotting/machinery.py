"""Diagrams of the connector's machinery, drawn from kvlab.connector.step_order (the data a
test checks against a real engine step's recorded calls): the path a prefix hit takes, from
the scheduler's lookup to the KV in the paged cache, and the order of one step's connector
calls in whole-step, layerwise and hooks mode, with where each copy happens."""

from __future__ import annotations

from typing import Sequence

import matplotlib.patches
import matplotlib.pyplot as plt

from kvlab.connector.step_order import MODES, PLACES, PREFIX_HIT_PATH, STEP_ORDER, Hop
from kvlab.plotting.common import (BLUE, DEFAULT_WIDTH, GREEN, GREY, LIGHT_GREY, ORANGE, SKY_BLUE, SMALL, VERMILLION,
                                   WIDTHS, figure_width, paper_figure, wrap)
from kvlab.plotting.common import title as figure_title

TIERS = ("memory", "shm", "disk", "redis", "mooncake")
# where each place of a prefix hit's path is drawn (axes fraction: centre x, centre y) and its process
PLACE_AT = {"request": (0.1, 0.78), "scheduler side: index": (0.33, 0.78), "step metadata": (0.62, 0.78),
            "worker side": (0.62, 0.28), "tiers": (0.91, 0.28), "paged KV cache": (0.33, 0.28)}
PLACE_SIZE = {place: (0.12, 0.3) if place == "tiers" else (0.16, 0.12) for place in PLACE_AT}
SIDE_COLOURS = {"scheduler": SKY_BLUE, "worker": LIGHT_GREY}
COPY_COLOURS = {"load": ORANGE, "save": GREEN}


def _box(ax: plt.Axes, x: float, y: float, text: str, width: float, height: float, colour: str,
         edge: str = GREY, style: str = "-", ink: str = "black") -> None:
    ax.add_patch(matplotlib.patches.FancyBboxPatch((x - width / 2, y - height / 2), width, height,
                                                   boxstyle="round,pad=0.008", facecolor=colour, edgecolor=edge,
                                                   linestyle=style, linewidth=0.8))
    ax.text(x, y, text, ha="center", va="center", fontsize=SMALL, color=ink)


def _page_width(width: str | float) -> float:
    """A diagram's width in inches: the page's (``double``) or wider, since its boxes name
    connector calls in full; a column's width is refused rather than drawn unreadable."""
    inches = figure_width(width)
    if inches < WIDTHS["double"]:
        raise ValueError(f"the connector's diagrams need the page's width ({WIDTHS['double']} in, width='double'); "
                         f"got {width!r} ({inches} in)")
    return inches


def _edge(place: str, toward: str, shift: float) -> tuple[float, float]:
    """Where an arrow from ``place`` to ``toward`` leaves ``place``'s box (shifted sideways by
    ``shift``, so that a way back runs beside the way there)."""
    (x, y), (to_x, to_y) = PLACE_AT[place], PLACE_AT[toward]
    half_width, half_height = (s / 2 + 0.01 for s in PLACE_SIZE[place])
    dx, dy = to_x - x, to_y - y
    reach = min(half_width / abs(dx) if dx else float("inf"), half_height / abs(dy) if dy else float("inf"))
    return x + reach * dx + (shift if not dx else 0), y + reach * dy + (shift if not dy else 0)


@paper_figure
def prefix_hit_figure(path: Sequence[Hop] = PREFIX_HIT_PATH, title: str = "", width: str | float = DEFAULT_WIDTH
                      ) -> plt.Figure:
    """The places a prefix hit passes through and the numbered hops between them, each named
    by the connector call that makes it and what it carries (listed under the drawing)."""
    inches = _page_width(width)
    fig, ax = plt.subplots(figsize=(inches, 2.6 + 0.16 * len(path)), layout="constrained")
    ax.set_axis_off()
    ax.set(xlim=(0, 1), ylim=(-0.02 - 0.085 * len(path), 1))
    for y, process in ((0.78, "engine core process: the scheduler"), (0.28, "worker process: the model runner")):
        ax.add_patch(matplotlib.patches.Rectangle((0.0, y - 0.2), 1.0, 0.4, facecolor="0.97", edgecolor="none"))
        ax.text(0.005, y + 0.18, process, fontsize=SMALL, color="0.35", va="top")
    for place in PLACES:
        text = place if place != "tiers" else "tiers, nearest first\n" + "\n".join(TIERS)
        colour = {"paged KV cache": BLUE, "tiers": LIGHT_GREY}.get(place, SKY_BLUE)
        _box(ax, *PLACE_AT[place], text, *PLACE_SIZE[place], colour, ink="white" if colour == BLUE else "black")
    ways: dict[frozenset, int] = {}
    for number, hop in enumerate(path, 1):
        pair = frozenset((hop.source, hop.target))
        shift = 0.035 * ways.get(pair, 0) * (1 if hop.source < hop.target else -1)
        ways[pair] = ways.get(pair, 0) + 1
        (x0, y0), (x1, y1) = _edge(hop.source, hop.target, shift), _edge(hop.target, hop.source, shift)
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0),
                    arrowprops=dict(arrowstyle="-|>", color=VERMILLION if hop.call == "start_load_kv" else "0.2",
                                    linewidth=1.0, shrinkA=0, shrinkB=0,
                                    linestyle="--" if hop.target == "scheduler side: index" and number > 1 else "-"))
        paired = sum(frozenset((h.source, h.target)) == pair for h in path) > 1
        above = 0 if y0 != y1 else 0.045 if shift > 0 or not paired else -0.045  # beside a level arrow, outside a pair
        ax.text((x0 + x1) / 2, (y0 + y1) / 2 + above, str(number), fontsize=SMALL,
                ha="center", va="center",
                bbox=dict(boxstyle="circle,pad=0.15", facecolor="white", edgecolor="0.2", linewidth=0.6))
        ax.text(0.01, -0.05 - 0.085 * (number - 1), wrap(f"{number}. {hop.call}: {hop.carries}", inches - 0.2, SMALL),
                fontsize=SMALL, va="top")
    figure_title(fig, title or "A prefix hit's path through KVLabConnector (whole-step)")
    return fig


@paper_figure
def step_calls_figure(order: dict[str, Sequence] = STEP_ORDER, title: str = "", width: str | float = DEFAULT_WIDTH
                      ) -> plt.Figure:
    """One column per mode: the connector calls of a step that loads a prefix hit and saves
    new chunks, top to bottom in vLLM's order, coloured by side; the per-layer calls of the
    forward bracketed; a filled tag where a call copies KV before it returns, a hollow one
    where it hands the copy to a thread of the connector's."""
    inches = _page_width(width)
    modes = [mode for mode in MODES if mode in order]
    rows = max(len(order[mode]) for mode in modes)
    fig, axes = plt.subplots(1, len(modes), figsize=(inches, 0.8 + 0.21 * rows), layout="constrained")
    for ax, mode in zip(axes if len(modes) > 1 else [axes], modes):
        calls = order[mode]
        ax.set_axis_off()
        ax.set(xlim=(0, 1), ylim=(rows + 0.2, -0.9), title=mode)
        for row, call in enumerate(calls):
            label = call.name + (" (hooks)" if call.caller == "hooks" else "")
            _box(ax, 0.49, row, label, 0.78, 0.72, SIDE_COLOURS[call.side], edge=VERMILLION if call.caller == "hooks"
                 else GREY, style="--" if call.per_layer else "-")
            for offset, (kind, filled) in enumerate([(c, True) for c in call.copies] + [(q, False) for q in call.queues]):
                ax.add_patch(matplotlib.patches.Rectangle((0.9 + 0.05 * offset, row - 0.3), 0.045, 0.6,
                                                          facecolor=COPY_COLOURS[kind] if filled else "white",
                                                          edgecolor=COPY_COLOURS[kind], linewidth=1.2))
        layers = [row for row, call in enumerate(calls) if call.per_layer]
        ax.plot([0.075, 0.06, 0.06, 0.075], [layers[0] - 0.35, layers[0] - 0.35, layers[-1] + 0.35, layers[-1] + 0.35],
                color="0.3", linewidth=0.8)
        ax.text(0.03, (layers[0] + layers[-1]) / 2, "×L", ha="center", va="center", rotation=90, fontsize=SMALL,
                color="0.3")
    keys = [matplotlib.patches.Patch(facecolor=SIDE_COLOURS["scheduler"], edgecolor=GREY, label="scheduler side"),
            matplotlib.patches.Patch(facecolor=SIDE_COLOURS["worker"], edgecolor=GREY, label="worker side"),
            matplotlib.patches.Patch(facecolor="white", edgecolor=VERMILLION, label="made by the hooks"),
            matplotlib.patches.Patch(facecolor=ORANGE, label="copies a load before returning"),
            matplotlib.patches.Patch(facecolor="white", edgecolor=ORANGE, label="starts a load's copy thread"),
            matplotlib.patches.Patch(facecolor="white", edgecolor=GREEN, label="queues a save on the saver thread")]
    note = ("In a step that loads nothing, vLLM calls start_load_kv after launching the forward (vLLM >= 0.32). "
            "Checked against the calls of a real engine step (tests/integration/test_backend_engine.py).")
    fig.legend(handles=keys, loc="outside lower center", ncol=3, fontsize=SMALL, title=wrap(note, inches - 0.3, SMALL),
               title_fontsize=SMALL)
    figure_title(fig, title or "One step's KVLabConnector calls, a prefix hit loaded and new chunks saved")
    return fig
