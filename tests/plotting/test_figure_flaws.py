"""The flaws a reviewer finds by eye in a paper figure, measured: every figure function drawn
from the committed results as its notebook draws it (test_paper_figures.FIGURES, and every
memory map the notebooks draw) has no bar running past its axes, readable tick labels on every
numeric axis, a visible artist behind every legend entry, no legend taller than the plots,
no line jumping at one x, no series hidden under an identical one, no panel of zeros,
hatching only for noise, and memory maps whose colours stay apart and whose footnote is true
of every layout drawn."""

import contextlib
import functools
import itertools

import matplotlib

matplotlib.use("Agg")

import matplotlib.collections  # noqa: E402
import matplotlib.colors  # noqa: E402
import matplotlib.container  # noqa: E402
import matplotlib.image  # noqa: E402
import matplotlib.lines  # noqa: E402
import matplotlib.markers  # noqa: E402
import matplotlib.patches  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from test_paper_figures import FIGURES, LLAMA, PAGE_WIDE, committed, ttft_rows  # noqa: E402

from kvlab.cache import Holds, Layout, preset, register_layout, unregister_layout  # noqa: E402
from kvlab.plotting import memory_map, miniature, network_tier_figure, ttft_figure  # noqa: E402


@contextlib.contextmanager
def notebook_05_layout():
    """BNLHC registered as notebook 07 registers it, while the block runs."""
    register_layout(Layout(name="BNLHC", family="a notebook's idea", order="BNLHSD", view_order="BHNSD",
                           view_shape=("B", "H", "N", "SD"), shape_text="per-layer [B, H, N, C] views",
                           note="cross-layer and token-major", requires=Holds.KV))
    try:
        yield
    finally:
        unregister_layout("BNLHC")


# every memory map notebooks 01 and 07 draw, as (layouts, model, memory_map's other arguments)
MAP_CALLS = {
    "memory_map_vllm": (["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BHLNC"], LLAMA, {}),
    "memory_map_generations": (["flash_attn_v0.12", "flash_attn_v0.12_cross", "flash_attn_v0.26", "CPU_LBHNC"],
                               LLAMA, {}),
    "memory_map_ascend": (["ascend_kv_tuple", "LBNHC", "BLNHC"], LLAMA, {}),
    "memory_map_mla": (["mla_v0.12", "LBHNC", "BLHNC", "ascend_mla_tuple"], preset("deepseek-v2-lite"),
                       {"colour_by": ("layer", "block", "token")}),
    "memory_map_lmcache_chunks": (["KV_2LTD", "KV_T2D"], LLAMA, {"num_blocks": 4, "moved_blocks": (0, 1, 2, 3)}),
    "memory_map_new_layout": (["BLHNC", "BNLHC"], LLAMA, {"moved_blocks": (1, 4)}),
}


def draw_map(name: str, **kw) -> plt.Figure:
    layouts, model, arguments = MAP_CALLS[name]
    with notebook_05_layout():
        return memory_map(layouts, miniature(model), **arguments, **kw)


MAPS = {name: functools.partial(draw_map, name) for name in MAP_CALLS if name != "memory_map_vllm"}  # that one: FIGURES

def beyond(store: str, name: str):
    """Notebook 04's figure of one store beyond Redis (03_beyond_mooncake, 03_beyond_cluster)."""
    def draw(**kw):
        mine = [r for r in committed("03_beyond") if r["kind"] == "prefix" and r["store"] == store]
        return network_tier_figure(mine, f"{mine[0]['model']}: a {mine[0]['tokens']}-token prefix through {name} "
                                         f"({mine[0]['hardware']})", **kw)
    return draw


def ttft_within_a_decade(**kw):
    """03_ttft as a run without recompute draws it: every dot within one decade (a log axis
    then labels its minor ticks, as 4×10¹ unless told otherwise)."""
    rows = [r for r in ttft_rows() if r["scenario"] != "recompute"]
    return ttft_figure(rows, f"{rows[0]['model']}: time to first token, {int(rows[0]['prompt_tokens'])}-token prompts "
                             f"({rows[0]['hardware']})", **kw)


# the other figures the notebooks draw with the same functions, from other rows
OTHER_CALLS = {"beyond_mooncake": beyond("mooncake", "Mooncake Store"),
               "beyond_cluster": beyond("redis cluster", "a 3-node Redis Cluster"),
               "ttft_within_a_decade": ttft_within_a_decade}
DRAWN = {**FIGURES, **MAPS, **OTHER_CALLS}
CASES = [(name, width) for name in sorted(DRAWN) for width in ("single", "double")
         if width == "double" or name not in PAGE_WIDE]


@pytest.fixture(scope="module", params=CASES, ids=[f"{name}-{width}" for name, width in CASES])
def figure(request):
    name, width = request.param
    fig = DRAWN[name](width=width)
    fig.canvas.draw()
    yield name, width, fig
    plt.close(fig)


def pixels(artist) -> matplotlib.transforms.Bbox:
    return artist.get_window_extent(artist.figure.canvas.get_renderer())


# --- bars and ticks -----------------------------------------------------------------------------


def bar_ends(ax: plt.Axes) -> list[tuple[str, float, float]]:
    """Every bar's (label, value end, the axis's far view limit), whiskers included."""
    ends = []
    for bars in (c for c in ax.containers if isinstance(c, matplotlib.container.BarContainer)):
        horizontal = bars.orientation == "horizontal"
        low, high = sorted(ax.get_xlim() if horizontal else ax.get_ylim())
        for patch in bars.patches:
            end = patch.get_x() + patch.get_width() if horizontal else patch.get_y() + patch.get_height()
            ends.append((bars.get_label(), end, high))
        if bars.errorbar is not None:
            for line in bars.errorbar.lines[2]:
                for segment in line.get_segments():
                    far = max(segment[:, 0] if horizontal else segment[:, 1])
                    ends.append((f"{bars.get_label()} whisker", far, high))
    return ends


def test_no_bar_runs_past_its_axes(figure):
    name, width, fig = figure
    clipped = [(label, round(end, 3), round(high, 3)) for ax in fig.axes for label, end, high in bar_ends(ax)
               if end > high + 1e-9 * max(abs(high), 1)]
    assert not clipped, f"{name} ({width}): bars cut off by the axes: {clipped[:4]}"


def test_a_share_of_the_ceiling_above_one_is_drawn_whole():
    """A standard run on an Intel Xeon measured a method at 1.43x the ceiling, beyond the fixed 0-1.3 axis."""
    from test_paper_figures import transfer_here

    from kvlab.plotting import transfer_ratios

    rows = [{**r, "ratio": 1.43, "ratio_q3": 1.5} if r["method"] == "memcpy" else r for r in transfer_here()]
    fig = transfer_ratios(rows, LLAMA.name, 1024)
    fig.canvas.draw()
    assert all(end <= high for ax in fig.axes for _, end, high in bar_ends(ax))
    plt.close(fig)


def labelled_ticks(axis) -> list[str]:
    """The tick labels a reader sees on ``axis``: drawn, in view, not empty."""
    low, high = sorted(axis.get_view_interval())
    ticks = [*axis.get_major_ticks(), *axis.get_minor_ticks()]
    locs = [*axis.get_majorticklocs(), *axis.get_minorticklocs()]
    shown = []
    for tick, loc in zip(ticks, locs):
        label = tick.label1 if tick.label1.get_visible() else tick.label2
        if (tick.label1.get_visible() or tick.label2.get_visible()) and label.get_text().strip() \
                and low - 1e-12 <= loc <= high + 1e-12:
            shown.append(label.get_text())
    return shown


def numeric_axes(fig: plt.Figure):
    """(axes, axis) for every axis of ``fig`` whose ticks stand for numbers: not row or
    column names (set_yticks with labels), not an axis with no labels (a map, a shared one)."""
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            if isinstance(axis.get_major_formatter(), matplotlib.ticker.FixedFormatter):
                continue
            if labelled_ticks(axis):
                yield ax, axis


def test_every_numeric_axis_has_readable_tick_labels(figure):
    """At least three labelled ticks (two where ticks sit at the measured values), and plain
    numbers rather than mathtext products such as 4×10¹."""
    name, width, fig = figure
    sparse, products = [], []
    for ax, axis in numeric_axes(fig):
        labels = labelled_ticks(axis)
        least = 2 if isinstance(axis.get_major_locator(), matplotlib.ticker.FixedLocator) else 3
        if len(labels) < least:
            sparse.append((ax.get_title() or ax.get_xlabel(), axis.axis_name, labels))
        products += [label for label in labels if "\\times" in label]
    assert not sparse, f"{name} ({width}): axes with too few labelled ticks: {sparse}"
    assert not products, f"{name} ({width}): tick labels as mathtext products: {products[:4]}"


# --- legends -----------------------------------------------------------------------------------

NEUTRAL = 0.02  # a colour whose channels differ by less than this is a grey (a key for a style, not a series)


def rgba(colour) -> np.ndarray:
    return np.asarray(matplotlib.colors.to_rgba(colour))


def neutral(colour) -> bool:
    channels = rgba(colour)[:3]
    return channels.max() - channels.min() < NEUTRAL


def same_colour(a, b) -> bool:
    return np.allclose(rgba(a)[:3], rgba(b)[:3], atol=1.5 / 255)


def marker_shape(marker) -> np.ndarray | None:
    style = matplotlib.markers.MarkerStyle(marker)
    if not style.is_filled() and marker in ("None", "", " ", None):
        return None
    vertices = style.get_path().transformed(style.get_transform()).vertices
    return vertices / max(np.abs(vertices).max(), 1e-12)


def same_shape(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    return a is not None and b is not None and a.shape == b.shape and np.allclose(a, b, atol=1e-6)


def collection_shape(collection) -> np.ndarray | None:
    paths = collection.get_paths()
    if not paths:
        return None
    vertices = paths[0].vertices
    return vertices / max(np.abs(vertices).max(), 1e-12)


def in_view(ax: plt.Axes, box) -> bool:
    """Whether at least one pixel of ``box`` lies inside ``ax``."""
    frame = ax.get_window_extent()
    return box.x1 >= frame.x0 and box.x0 <= frame.x1 and box.y1 >= frame.y0 and box.y0 <= frame.y1


def line_shown(ax: plt.Axes, line: matplotlib.lines.Line2D, dashes: bool) -> bool:
    """Whether ``line`` shows inside ``ax``: a marker in view, or (``dashes``) a stretch of line
    at least 2 pixels long across it."""
    xy = line.get_transform().transform(np.column_stack([line.get_xdata(orig=False), line.get_ydata(orig=False)]))
    xy = xy[np.isfinite(xy).all(axis=1)]
    frame = ax.get_window_extent()
    if not dashes:
        return bool(((xy[:, 0] >= frame.x0 - 1) & (xy[:, 0] <= frame.x1 + 1) & (xy[:, 1] >= frame.y0 - 1)
                     & (xy[:, 1] <= frame.y1 + 1)).any())
    low, high = np.maximum(xy.min(axis=0), [frame.x0, frame.y0]), np.minimum(xy.max(axis=0), [frame.x1, frame.y1])
    return len(xy) >= 2 and bool((high >= low).all()) and max(high - low) >= 2


def line_key_drawn(axes: list[plt.Axes], key: matplotlib.lines.Line2D) -> bool:
    """A visible line or scatter with the key's marker, dashes and (unless a grey style key) colour."""
    marker, dashes = marker_shape(key.get_marker()), key.get_linestyle() not in ("None", "", " ")
    for ax in axes:
        for line in ax.lines:
            if not line.get_visible() or (not neutral(key.get_color()) and not same_colour(line.get_color(), key.get_color())):
                continue
            if marker is not None and not same_shape(marker_shape(line.get_marker()), marker):
                continue
            if dashes and (line.get_linestyle() != key.get_linestyle()):
                continue
            if line_shown(ax, line, dashes):
                return True
        if not dashes and marker is not None:  # a marker key also stands for a scatter
            for dots in (c for c in ax.collections if isinstance(c, matplotlib.collections.PathCollection)):
                colours = [*dots.get_facecolors(), *dots.get_edgecolors()]
                if (same_shape(collection_shape(dots), marker) and len(dots.get_offsets())
                        and (neutral(key.get_color()) or any(same_colour(c, key.get_color()) for c in colours))):
                    return True
    return False


def patch_key_drawn(axes: list[plt.Axes], key: matplotlib.patches.Patch) -> bool:
    """A visible patch, bar, span or image pixel in the key's colour (any colour for a grey
    key), hatched as the key is."""
    face, hatch = key.get_facecolor(), key.get_hatch() or None
    colours = [face] if not neutral(face) else [key.get_edgecolor()] if not neutral(key.get_edgecolor()) else []
    for ax in axes:
        for patch in ax.patches:
            if patch.get_visible() and (patch.get_hatch() or None) == hatch and in_view(ax, pixels(patch)) \
                    and min(pixels(patch).width, pixels(patch).height) >= 1 \
                    and (not colours or any(same_colour(c, colours[0]) for c in (patch.get_facecolor(), patch.get_edgecolor()))):
                return True
        for spans in (c for c in ax.collections if isinstance(c, matplotlib.collections.PolyCollection)):
            boxes = [path.transformed(spans.get_transform()).get_extents() for path in spans.get_paths()]
            if spans.get_visible() and (not colours or any(same_colour(c, colours[0]) for c in spans.get_facecolors())) \
                    and any(min(box.width, box.height) >= 1 and in_view(ax, box) for box in boxes):
                return True
        for image in ax.images:
            pixels_drawn = np.asarray(image.get_array())[..., :3].reshape(-1, 3)
            if np.isclose(pixels_drawn, rgba((colours or [face])[0])[:3], atol=1.5 / 255).all(axis=1).any():
                return True
    return False


def key_drawn(axes: list[plt.Axes], key) -> bool:
    if isinstance(key, matplotlib.lines.Line2D):
        return line_key_drawn(axes, key)
    if isinstance(key, matplotlib.patches.Patch):
        return patch_key_drawn(axes, key)
    if isinstance(key, matplotlib.collections.PathCollection):  # a scatter's own entry
        colour = [*key.get_facecolors(), *key.get_edgecolors()][0]
        return any(same_shape(collection_shape(dots), collection_shape(key)) and len(dots.get_offsets())
                   and (neutral(colour) or any(same_colour(c, colour) for c in [*dots.get_facecolors(),
                                                                                 *dots.get_edgecolors()]))
                   for ax in axes for dots in ax.collections if isinstance(dots, matplotlib.collections.PathCollection))
    return True  # a handle kind no figure draws yet


def keyed_axes(fig: plt.Figure, legend) -> list[plt.Axes]:
    """The axes a legend speaks for: its row of maps for a key beside a row, else every axes."""
    owner = legend.axes if legend in [ax.get_legend() for ax in fig.axes] else None
    if owner is None or not owner.axison:
        return fig.axes
    return [ax for ax in fig.axes if abs(ax.get_position().y0 - owner.get_position().y0) < 1e-6]


def legends(fig: plt.Figure) -> list:
    return list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]


def test_every_legend_entry_stands_for_something_drawn(figure):
    name, width, fig = figure
    missing = [text.get_text() for legend in legends(fig) for key, text in zip(legend.legend_handles, legend.get_texts())
               if not key_drawn(keyed_axes(fig, legend), key)]
    assert not missing, f"{name} ({width}): legend entries with nothing visible drawn like them: {missing}"


def test_no_legend_is_taller_than_the_plots(figure):
    name, width, fig = figure
    plots = [ax.get_window_extent().height for ax in fig.axes if ax.get_visible() and ax.axison]
    tallest = max(plots, default=fig.bbox.height)  # a diagram (no axes drawn): the figure itself
    tall = [f"{pixels(legend).height / tallest:.1f}x" for legend in legends(fig) if pixels(legend).height > tallest]
    assert not tall, f"{name} ({width}): a legend taller than the tallest plot: {tall}"


def test_hatching_means_noisy_in_every_figure(figure):
    """One meaning across the paper: a hatched bar is a noisy measurement."""
    name, width, fig = figure
    hatched = [text.get_text() for legend in legends(fig) for key, text in zip(legend.legend_handles, legend.get_texts())
               if isinstance(key, matplotlib.patches.Patch) and key.get_hatch() and "noisy" not in text.get_text()]
    assert not hatched, f"{name} ({width}): hatching keyed as something else than noise: {hatched}"


# --- series --------------------------------------------------------------------------------------


def data_lines(ax: plt.Axes) -> list[matplotlib.lines.Line2D]:
    """The lines that draw data (not reference lines across the axes, not 2-point marks, not
    whisker caps, not a diagram's shapes)."""
    if not ax.axison:  # a diagram's shapes, not data
        return []
    return [line for line in ax.lines if line.get_visible() and len(line.get_xdata()) > 2
            and line.get_linestyle() not in ("None", "", " ")
            and line.get_transform() not in (ax.get_xaxis_transform(), ax.get_yaxis_transform())]


def test_no_line_jumps_at_one_x(figure):
    """A line with two values at one x draws a vertical jump no measurement made."""
    name, width, fig = figure
    jumping = [line.get_label() for ax in fig.axes for line in data_lines(ax)
               if len(set(np.asarray(line.get_xdata(), float))) < len(line.get_xdata())]
    assert not jumping, f"{name} ({width}): lines jumping at one x: {jumping}"


def test_no_series_hides_under_another(figure):
    """Two series whose every point falls within 2 pixels of the other's look like one."""
    name, width, fig = figure
    hidden = []
    for ax in fig.axes:
        for a, b in itertools.combinations(data_lines(ax), 2):
            if len(a.get_xdata()) == len(b.get_xdata()):
                here, there = (line.get_transform().transform(np.asarray(line.get_xydata(), float)) for line in (a, b))
                if np.all(np.linalg.norm(here - there, axis=1) < 2):
                    hidden.append((a.get_label(), b.get_label()))
    assert not hidden, f"{name} ({width}): series drawn over another: {hidden[:4]}"


def panel_values(ax: plt.Axes) -> list[float]:
    """The values a panel draws along its value axis: bar lengths and dots' positions."""
    values = []
    for bars in (c for c in ax.containers if isinstance(c, matplotlib.container.BarContainer)):
        values += [p.get_width() if bars.orientation == "horizontal" else p.get_height() for p in bars.patches]
    for dots in (c for c in ax.collections if isinstance(c, matplotlib.collections.PathCollection)):
        values += [float(v) for v in np.asarray(dots.get_offsets())[:, 0]] if ax.get_yticklabels() else []
    return values


def test_no_panel_draws_only_zeros(figure):
    """A panel whose every value is 0 says one thing, in a sentence's worth of ink."""
    name, width, fig = figure
    zeros = [ax.get_xlabel() for ax in fig.axes if (values := panel_values(ax)) and not any(values)]
    assert not zeros, f"{name} ({width}): panels of zeros: {zeros}"
