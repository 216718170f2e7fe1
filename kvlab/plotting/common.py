"""What every figure shares: sizes for a paper's single or double column, one colour-blind
safe palette (Okabe-Ito's eight colours) with one colour per copy method and per reuse path
across all figures, machine names for legends, legends without repeats, and saving for
papers (PNG, SVG and PDF with embedded fonts, byte-reproducible)."""

from __future__ import annotations

import functools
import re
import textwrap
from pathlib import Path
from typing import Callable, Collection, Iterable, Sequence

import matplotlib.colors
import matplotlib.font_manager
import matplotlib.pyplot as plt
import matplotlib.textpath
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
# Applied when saving: fonts embedded as TrueType (editable, accepted by publishers), SVG
# glyph ids from a fixed salt, so the same figure gives the same bytes.
SAVE_RC = {"pdf.fonttype": 42, "ps.fonttype": 42, "svg.fonttype": "path", "svg.hashsalt": "kvlab"}
FORMATS = ("png", "svg", "pdf")


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


def with_hardware(label: str, hardware: str | None, machines: Collection[str | None]) -> str:
    """``label`` naming its machine when the figure shows several (with one, the legend's
    title names it: see :func:`machine_title`)."""
    return f"{label}, {short_hardware(hardware)}" if len(set(machines)) > 1 else label


def machine_title(machines: Collection[str | None]) -> str | None:
    """The one machine a figure shows, for its legend's title (None when it shows several)."""
    machines = set(machines)
    return short_hardware(next(iter(machines))) if len(machines) == 1 else None


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


def plural(count: int, word: str) -> str:
    """'1 segment', '1,024 segments'."""
    return f"{count:,} {word}{'s' * (count != 1)}"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if float(n).is_integer() else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def provenance(rows: Iterable[dict]) -> str:
    """Where a figure's numbers come from: each machine and the profile it ran under, and each
    published source (a row with ``published``: kvlab.plotting.gpu_model.citations) with its hardware."""
    rows = as_records(rows)
    published = dict.fromkeys(f"{r['published']} ({r.get('hardware') or 'hardware not stated'})"
                              for r in rows if r.get("published"))
    runs = dict.fromkeys((r.get("hardware") or "this machine", r.get("profile") or "unrecorded") for r in rows
                         if not r.get("published"))
    measured = "measured on " + "; ".join(f"{hardware}, {profile} profile" for hardware, profile in runs)
    if not published:
        return measured
    cited = "published: " + "; ".join(published)
    return f"{measured}; {cited}" if runs else cited


def save_figure(fig: plt.Figure, name: str, figures_dir: str | Path, formats: Sequence[str] = FORMATS,
                source: Iterable[dict] | None = None) -> list[Path]:
    """Save ``fig`` as ``figures_dir/name.{png,svg,pdf}`` (PNG for reading, SVG and PDF for
    papers), the same bytes for the same figure (clean git diffs). With ``source`` (the
    result rows drawn), a footer names their machines and profiles."""
    unknown = set(formats) - set(FORMATS)
    if unknown:
        raise ValueError(f"save_figure writes {FORMATS}, not {sorted(unknown)}")
    fig.canvas.draw()  # laid out, then kept so: saving crops the figure, and a legend placed
    fig.set_layout_engine("none")  # on the figure's edge would move with the crop
    for legend in fig.legends:
        legend.set_bbox_to_anchor((0, 0, 1, 1), transform=fig.transFigure)
    if source is not None:  # below everything drawn
        bottom = fig.get_tightbbox(fig.canvas.get_renderer()).y0 / fig.get_figheight()
        fig.text(0.995, min(bottom, 0.0), wrap(provenance(source), fig.get_figwidth(), SMALL), ha="right", va="top",
                 fontsize=SMALL, color="0.35")
    figures_dir = Path(figures_dir)
    figures_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        path = figures_dir / f"{name}.{fmt}"
        with plt.rc_context(SAVE_RC):
            fig.savefig(path, dpi=300, bbox_inches="tight", pad_inches=0.03,
                        metadata={"svg": {"Date": None}, "pdf": {"CreationDate": None}}.get(fmt))
        paths.append(path)
    return paths


def _ok(rows: Iterable[dict], **match) -> list[dict]:
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
    ax.grid(axis="y", color=LIGHT_GREY, lw=0.5)
    for y, end, text in zip(ys, ends or values, texts):
        ax.annotate(text, (end, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=SMALL)


def _rows_labelled(fig: plt.Figure, axes: Sequence[plt.Axes], labels: Sequence[str], title_text: str,
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
