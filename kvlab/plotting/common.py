"""What every figure shares: sizes for a paper's single or double column, one colour-blind
safe palette (Okabe-Ito's eight colours) with one colour per copy method and per reuse path
across all figures, machine names for legends, legends without repeats, log axes labelled in
plain numbers, one run per figure, and titles checked against the rows (saving:
kvlab.plotting.saving)."""

from __future__ import annotations

import functools
import math
import re
import textwrap
from typing import Callable, Iterable, Sequence

import matplotlib.axis
import matplotlib.colors
import matplotlib.font_manager
import matplotlib.pyplot as plt
import matplotlib.textpath
import matplotlib.ticker
from cycler import cycler

from kvlab.cache.geometry import PRESETS
from kvlab.experiments.paths import Reuse
from kvlab.transfer.registry import method_colours

# Widths a figure is drawn at, in inches: text in points then prints at its size when the
# figure is placed at that width (one column of a two-column paper, or both columns).
WIDTHS = {"single": 3.3, "double": 7.0}
DEFAULT_WIDTH = "double"

# Font sizes in points, the smallest readable in print.
SMALL = 7  # tick labels, legends, numbers on bars, footers
MEDIUM = 8  # axis labels, panel titles
LARGE = 9  # figure titles

# Okabe & Ito's colour-blind safe palette, plus greys for what is not data.
BLACK, ORANGE, SKY_BLUE, GREEN = "#000000", "#E69F00", "#56B4E9", "#009E73"
YELLOW, BLUE, VERMILLION, PURPLE = "#F0E442", "#0072B2", "#D55E00", "#CC79A7"
GREY, LIGHT_GREY = "#999999", "#DDDDDD"
CYCLE = (BLUE, ORANGE, GREEN, VERMILLION, PURPLE, SKY_BLUE, YELLOW, BLACK)

# One colour per copy method in every figure: its registry entry's (kvlab/transfer/methods
# register kvlab's own in this palette; a method registered elsewhere brings its own).
# One colour per way of having a prefix's KV (kvlab.experiments.paths): LMCache and vLLM
# take their copy methods' colours, KVLab the colour of its default method (gather).
PATH_COLOURS = {Reuse.RECOMPUTE: GREY, Reuse.VLLM_PREFIX_HIT: BLACK, Reuse.KVLAB_WHOLE_STEP: BLUE,
                Reuse.KVLAB_LAYERWISE: BLUE, Reuse.LMCACHE: ORANGE, Reuse.EXAMPLE_CONNECTOR: PURPLE}
OTHER_PATH = SKY_BLUE  # a label no path claims
# Per-layer against cross-layer layouts, wherever a figure tells them apart.
PER_LAYER, CROSS_LAYER = SKY_BLUE, GREEN

PAPER_RC = {
    "font.size": MEDIUM, "axes.titlesize": MEDIUM, "axes.labelsize": MEDIUM, "xtick.labelsize": SMALL,
    "ytick.labelsize": SMALL, "legend.fontsize": SMALL, "legend.title_fontsize": SMALL, "figure.titlesize": LARGE,
    "axes.prop_cycle": cycler(color=CYCLE), "axes.linewidth": 0.6, "lines.linewidth": 1.2, "lines.markersize": 4,
    "xtick.major.width": 0.6, "ytick.major.width": 0.6, "hatch.linewidth": 0.6, "legend.frameon": False,
}


def figure_width(width: str | float) -> float:
    """Inches for ``width``: "single" (one column), "double" (both), or inches."""
    if isinstance(width, str):
        if width not in WIDTHS:
            raise ValueError(f"width is one of {list(WIDTHS)} or inches, not {width!r}")
        return WIDTHS[width]
    if not 1 <= width <= 20:
        raise ValueError(f"a figure width of {width} inches is not a page's; give 1 to 20 inches or {list(WIDTHS)}")
    return float(width)


def paper_figure(draw: Callable[..., plt.Figure]) -> Callable[..., plt.Figure]:
    """Draw a figure function's figure in the paper style (font sizes in points, the
    palette; an empty first argument is a clear error), including the tick labels
    matplotlib makes later, when the figure is shown."""

    @functools.wraps(draw)
    def drawn(*args, **kwargs) -> plt.Figure:
        # every figure function draws its first argument (rows, fits, layouts): none is an
        # error, not an empty figure that looks like a result
        if args and hasattr(args[0], "__len__") and len(args[0]) == 0:
            raise ValueError(f"{draw.__name__}: nothing to draw (no rows given: were the results loaded?)")
        with plt.rc_context(PAPER_RC):
            fig = draw(*args, **kwargs)
            # Jupyter's inline backend, chosen by the first figure ever drawn, turns
            # interactive mode on: leaving the context must not turn it off again, or no
            # later figure is shown in the notebook
            interactive = plt.isinteractive()
        plt.interactive(interactive)
        for ax in fig.axes:
            ax.tick_params(which="both", labelsize=SMALL)
        return fig

    return drawn


def panels(count: int, width: str | float, panel_height: float, sharey: bool = False,
           min_panel_width: float = 2.2) -> tuple[plt.Figure, list[plt.Axes]]:
    """``count`` panels side by side where the width gives each ``min_panel_width`` inches,
    else stacked (one column), each ``panel_height`` inches tall."""
    inches = figure_width(width)
    across = inches / count >= min_panel_width
    rows, columns = (1, count) if across else (count, 1)
    fig, axes = plt.subplots(rows, columns, figsize=(inches, panel_height * rows), sharey=sharey, squeeze=False,
                             layout="constrained")
    return fig, list(axes.flat)


def wrap(text: str, inches: float, size: float = MEDIUM) -> str:
    """``text`` broken into lines that fit ``inches`` at ``size`` points (DejaVu Sans)."""
    columns = max(int(inches * 72 / (0.6 * size)), 10)
    return "\n".join(textwrap.fill(line, columns, break_long_words=False, break_on_hyphens=False)
                     for line in text.split("\n"))


_TEXT = matplotlib.textpath.TextToPath()


@functools.lru_cache(maxsize=4096)
def text_inches(text: str, size: float = SMALL) -> float:
    """The width of ``text``'s longest line at ``size`` points (DejaVu Sans, as drawn)."""
    font = matplotlib.font_manager.FontProperties(size=size)
    return max(_TEXT.get_text_width_height_descent(line, font, ismath=False)[0] for line in text.split("\n")) / 72


def footnote(fig: plt.Figure, text: str) -> None:
    """A caption-like note under everything drawn (the layout engine keeps room for it)."""
    fig.supxlabel(wrap(text, fig.get_figwidth(), SMALL), fontsize=SMALL, color="0.25")


def title(fig: plt.Figure, text: str) -> None:
    """The figure's title, wrapped to its width."""
    if text:
        fig.suptitle(wrap(text, fig.get_figwidth(), LARGE), fontsize=LARGE)


def method_colour(method: str) -> str:
    return method_colours().get(method, GREY)


def path_colour(label: str) -> str:
    """The colour of the path a recorded label names (kvlab.experiments.paths.Reuse.of)."""
    path = Reuse.of(label)
    return PATH_COLOURS[path] if path is not None else OTHER_PATH


def connector_colour(connector: str) -> str:
    """The colour of the paths an engine connector ("none", "kvlab", ...) serves."""
    return next((PATH_COLOURS[path] for path in Reuse if path.connector == connector), OTHER_PATH)


def short_hardware(hardware: str | None) -> str:
    """A machine's name for a legend: "cpu: Intel(R) Xeon(R) Processor (2 cores)" reads
    "cpu: Intel Xeon (2 cores)", "cuda: NVIDIA H200" reads "cuda: H200"."""
    if not hardware:
        return "this machine"
    name = re.sub(r"\((R|TM)\)|\b(CPU|Processor|NVIDIA|\d+-Core)\b|@ *[\d.]+ *GHz", " ", hardware)
    return re.sub(r"\s+", " ", name).replace("( ", "(").replace(" )", ")").replace(" :", ":").strip()


def model_name(model: str) -> str:
    """A model as readers know it rather than as a folder, path or hub id names it: a
    studied model by its published name (".../smollm2-135m-instruct-bf16" and
    "HuggingFaceTB/SmolLM2-135M-Instruct" read "SmolLM2-135M-Instruct"), another by its last part."""
    last = str(model).rstrip("/").split("/")[-1]
    known = (geometry.name.split("/")[-1] for geometry in PRESETS.values())
    return next((name for name in known if last.lower().startswith(name.lower())), last)


def readable(text: str, rows: Iterable[dict]) -> str:
    """``text`` (a title a notebook writes from its rows) with each row's model by its
    :func:`model_name` and each machine by its :func:`short_hardware`."""
    for model, hardware in dict.fromkeys((r.get("model"), r.get("hardware")) for r in as_records(rows)):
        for raw, plain in ((model, model_name), (hardware, short_hardware)):
            if isinstance(raw, str) and raw:
                text = text.replace(raw, plain(raw))
    return text


def unique_legend(where: plt.Axes | plt.Figure, axes: Iterable[plt.Axes] | None = None, **kwargs):
    """A legend on ``where`` naming each label of ``axes``' artists (default: ``where``'s
    own axes) once, in the order first drawn."""
    axes = list(axes) if axes is not None else (where.axes if isinstance(where, plt.Figure) else [where])
    unique = {}
    for ax in axes:
        handles, labels = ax.get_legend_handles_labels()
        for handle, label in zip(handles, labels):
            unique.setdefault(label, handle)
    return where.legend(list(unique.values()), list(unique), **kwargs) if unique else None


def legend_labels(fig: plt.Figure) -> list[str]:
    """Every label of every legend in ``fig`` (the figure's and its axes')."""
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    return [text.get_text() for legend in legends for text in legend.get_texts()]


def as_records(rows: Iterable[dict] | None) -> list[dict]:
    """Result rows as dicts, whether a list of them or a pandas DataFrame (None: none)."""
    return [] if rows is None else rows.to_dict("records") if hasattr(rows, "to_dict") else list(rows)


def newest_run(rows: Iterable[dict]) -> list[dict]:
    """The rows of the newest run among ``rows`` (by its date; rows without one are one run):
    a paper figure draws one machine and one profile. Two runs of the same date from
    different machines or profiles are refused rather than mixed."""
    rows = as_records(rows)
    runs: dict[tuple, list[dict]] = {}
    for row in rows:
        runs.setdefault((row.get("hardware"), row.get("profile"), row.get("run_date")), []).append(row)
    if len(runs) <= 1:
        return rows
    dates = {key: key[2] or "" for key in runs}
    newest = max(dates.values())
    latest = [key for key, date in dates.items() if date == newest]
    if len(latest) > 1:
        raise ValueError(f"rows of {len(latest)} runs dated {newest!r} on different machines or profiles "
                         f"({[key[:2] for key in latest]}): a paper figure draws one run; pass that run's rows")
    return runs[latest[0]]


TOKEN_COUNT = re.compile(r"(\d[\d,]*)[- ]tokens?\b")


def one_run(rows: Iterable[dict], title: str = "", *keys: str) -> tuple[list[dict], str]:
    """The rows a figure draws (:func:`newest_run` of ``rows``) and its ``title`` (one a
    notebook writes from its rows), refused where it says what the drawn rows do not: a
    token count ("2048-token", "512 tokens") none of them measured under ``keys``
    ("tokens", "prompt_tokens"), or a machine whose run is not drawn."""
    given = as_records(rows)
    drawn = newest_run(given)
    measured_counts = {int(r[key]) for r in drawn for key in keys if isinstance(r.get(key), (int, float))
                       and r[key] == r[key]}
    named = {int(count.replace(",", "")) for count in TOKEN_COUNT.findall(title)}
    if measured_counts and named - measured_counts:
        raise ValueError(f"the title names {sorted(named - measured_counts)} tokens, but the rows drawn measured "
                         f"{sorted(measured_counts)} tokens: {title!r}")
    drawn_machines = {r.get("hardware") for r in drawn}
    other = [h for h in dict.fromkeys(r.get("hardware") for r in given)
             if h and h not in drawn_machines and (h in title or short_hardware(h) in title)]
    if other:
        raise ValueError(f"the title names {other[0]!r}, whose run this figure does not draw (it draws the newest, "
                         f"{sorted(map(str, drawn_machines))}): {title!r}")
    return drawn, title


class PlainLogLocator(matplotlib.ticker.LogLocator):
    """Ticks of a log axis at round numbers, as many as its length holds labels for, decided
    when the ticks are drawn (after every change to the axis's range): evenly spaced ones
    (100, 150, 200) within a decade, else at 1, 2 and 5 of each decade, at 1 and 3, or at
    each power of ten (every few where even those would crowd)."""

    def tick_values(self, vmin: float, vmax: float):
        low, high = sorted((vmin, vmax))
        if low <= 0:  # no range yet (nothing drawn): matplotlib's own ticks
            return super().tick_values(vmin, vmax)
        decades = math.log10(high / low)
        if decades < 1:
            even = matplotlib.ticker.MaxNLocator(nbins="auto" if self.axis else 6, steps=[1, 2, 2.5, 5, 10],
                                                 min_n_ticks=3)
            even.set_axis(self.axis)
            ticks = even.tick_values(low, high)
            return ticks[ticks > 0]
        room = self.axis.get_tick_space() if self.axis is not None else 9
        if isinstance(self.axis, matplotlib.axis.XAxis):  # matplotlib allows 3 ems a label; a long number takes more
            room = max(2, int(room * 3 / (0.6 * len(plain_number(high)) + 1)))
        choices = [(1, 2, 5), (1, 3), (1,)]
        counts = [sum(low <= sub * 10.0 ** k <= high for sub in subs
                      for k in range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)) for subs in choices]
        fitting = next((i for i, count in enumerate(counts) if count <= room), len(choices) - 1)
        readable = max((i for i, count in enumerate(counts) if count >= 3), default=0)  # at least 3 labels
        self.set_params(subs=choices[min(fitting, readable)])
        return super().tick_values(vmin, vmax)


def plain_number(value: float) -> str:
    """A tick's number in few characters: '0.5', '2', '1,000', '30k', '1M', '100M'."""
    for least, unit, suffix in ((1e9, 1e9, "G"), (1e6, 1e6, "M"), (1e5, 1e3, "k")):
        if abs(value) >= least:
            return f"{value / unit:,.10g}{suffix}"
    return f"{value:,.10g}"


def plain_log_ticks(axis) -> None:
    """A log ``axis`` labelled in plain numbers (0.5, 2, 1,000; never 4×10¹) at
    :class:`PlainLogLocator`'s ticks, its minor ticks unlabelled."""
    axis.set_major_locator(PlainLogLocator(numticks="auto"))
    axis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: plain_number(value)))
    axis.set_minor_formatter(matplotlib.ticker.NullFormatter())


def measured(value) -> bool:
    """A number was recorded: not None, and not NaN (what a missing one becomes in a DataFrame)."""
    return value is not None and value == value


def signed(value: float) -> str:
    """'+11', '−33' (a typographic minus)."""
    return f"{value:+.0f}".replace("-", "−")


def over_own_floor(ms: float, floor_ms: float | None) -> str:
    """A warm time's note: its milliseconds and how far it sits from the same engine's own
    prefix hit (the floor drawn on its row), or that it sits below it."""
    if floor_ms is None or floor_ms != floor_ms:
        return f"{ms:.0f} ms"
    return f"{ms:.0f} ms ({signed(ms - floor_ms)}{': below' if ms < floor_ms else ' over'} own floor)"


def plural(count: int, word: str) -> str:
    """'1 segment', '1,024 segments'."""
    return f"{count:,} {word}{'s' * (count != 1)}"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if float(n).is_integer() else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def ok_rows(rows: Iterable[dict], **match) -> list[dict]:
    """The rows measured without error (status "ok") whose fields equal ``match``."""
    return [r for r in rows if r.get("status") == "ok" and all(r.get(k) == v for k, v in match.items())]


def room_for_numbers(fig: plt.Figure, ax: plt.Axes, chars: int) -> None:
    """Widen ``ax``'s x range so numbers of ``chars`` characters written right of its
    longest bar stay inside it (on a log scale too)."""
    fig.get_layout_engine().execute(fig)
    share = min(chars * 0.6 * SMALL / (ax.get_window_extent().width * 72 / fig.dpi), 0.6)
    low, high = ax.get_xlim()
    if ax.get_xscale() == "log":
        ax.set_xlim(low, high * (high / low) ** (share / (1 - share)))
    else:
        ax.set_xlim(low, high + (high - low) * share / (1 - share))


def ink(colour) -> str:
    """Black or white, whichever reads better on ``colour`` (text inside a bar; by the WCAG
    contrast of its luminance)."""
    linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in matplotlib.colors.to_rgb(colour)]
    return "black" if 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2] > 0.179 else "white"


def dots(ax: plt.Axes, ys: Sequence[float], values: Sequence[float], colours: Sequence, texts: Sequence[str],
         ends: Sequence[float] | None = None) -> None:
    """Values spanning decades as dots on a log axis (a bar's length from an arbitrary floor
    means nothing there), each with its text right of it (or of its whisker's ``ends``) and
    a faint line to its row's label."""
    ax.scatter(values, ys, s=20, c=colours, zorder=3)
    ax.set_xscale("log")
    plain_log_ticks(ax.xaxis)
    ax.grid(axis="y", color=LIGHT_GREY, lw=0.5)
    for y, end, text in zip(ys, ends or values, texts):
        ax.annotate(text, (end, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=SMALL)


def rows_labelled(fig: plt.Figure, axes: Sequence[plt.Axes], labels: Sequence[str], title_text: str,
                  room: Sequence[int] = ()) -> plt.Figure:
    """Finish panels of horizontal bars sharing their rows (``sharey``): row labels wrapped to
    a third of the figure's width, the first row on top, the title, and on each panel room
    for numbers of ``room[i]`` characters right of the bars."""
    axes[0].set_yticks(range(len(labels)), [wrap(label, fig.get_figwidth() / 3, SMALL) for label in labels])
    axes[0].invert_yaxis()
    title(fig, title_text)
    for ax, chars in zip(axes, room):
        room_for_numbers(fig, ax, chars)
    return fig
