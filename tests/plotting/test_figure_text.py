"""Every paper figure, drawn from the committed results as its notebook draws it, keeps its
text where a reader can read it, measured with matplotlib's own extents after the layout
engine ran: numbers and notes written in an axes stay inside its frame and off its
reference lines, nothing runs off the figure or over other text, titles take at most two
lines, no text lies under a legend, a legend beside the plots leaves them the width, and a
double-column figure fits a page. The checks a figure function outside this change fails
still are listed in NOT_YET, each expected to fail until mended."""

import contextlib
import math

import matplotlib

matplotlib.use("Agg")

import matplotlib.path  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.text  # noqa: E402
import pytest  # noqa: E402
from matplotlib.transforms import Bbox  # noqa: E402
from test_paper_figures import FIGURES, PAGE_WIDE  # noqa: E402

SLACK = 0.5  # pixels: extents are rounded to them
MAX_HEIGHT = 6.0  # inches of a double-column figure: with its caption, it fits a page
MAX_SIDE_LEGEND = 0.25  # of the figure's width, for a legend beside the plots


@contextlib.contextmanager
def drawn_texts():
    """The texts matplotlib really draws while the block runs (tick labels outside the view
    and empty strings are made but never drawn)."""
    texts = []
    draw = matplotlib.text.Text.draw

    def recording(text, renderer):
        draw(text, renderer)
        if text.get_visible() and text.get_text().strip():
            texts.append(text)

    matplotlib.text.Text.draw = recording
    try:
        yield texts
    finally:
        matplotlib.text.Text.draw = draw


def draw(name: str, width: str):
    fig = FIGURES[name](width=width)
    with drawn_texts() as texts:
        fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    return fig, {text: text.get_window_extent(renderer) for text in texts}, renderer


def inside(box: Bbox, frame: Bbox) -> bool:
    return (box.x0 >= frame.x0 - SLACK and box.y0 >= frame.y0 - SLACK and box.x1 <= frame.x1 + SLACK
            and box.y1 <= frame.y1 + SLACK)


def outline(box: Bbox, degrees: float = 0) -> matplotlib.path.Path:
    """The rectangle a text at ``degrees`` fills, from the upright ``box`` around it that
    matplotlib reports (same centre; its sides solved back from the box's), less SLACK on each side."""
    cos, sin = abs(math.cos(math.radians(degrees))), abs(math.sin(math.radians(degrees)))
    if sin < 1e-6:  # level: the box is the text
        width, height = box.width, box.height
    elif cos < 1e-6:  # on its side
        width, height = box.height, box.width
    else:
        width = (box.width * cos - box.height * sin) / (cos ** 2 - sin ** 2)
        height = (box.height * cos - box.width * sin) / (cos ** 2 - sin ** 2)
    half = [(x * (width / 2 - SLACK), y * (height / 2 - SLACK)) for x, y in ((-1, -1), (1, -1), (1, 1), (-1, 1))]
    turn = math.radians(degrees)
    return matplotlib.path.Path([(box.x0 + box.width / 2 + x * math.cos(turn) - y * math.sin(turn),
                                  box.y0 + box.height / 2 + x * math.sin(turn) + y * math.cos(turn)) for x, y in half],
                                closed=True)


def overlap(a: matplotlib.path.Path, b: matplotlib.path.Path) -> bool:
    return a.intersects_path(b, filled=True)


def legends(fig: plt.Figure) -> list:
    return list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]


def reference_lines(ax: plt.Axes) -> list[tuple[str, float]]:
    """The axes-spanning lines (axhline, axvline) in ``ax``, as ("y" or "x", pixel)."""
    found = []
    for line in ax.lines:
        if line.get_transform() == ax.get_yaxis_transform():
            found.append(("y", ax.transData.transform((0, line.get_ydata()[0]))[1]))
        elif line.get_transform() == ax.get_xaxis_transform():
            found.append(("x", ax.transData.transform((line.get_xdata()[0], 0))[0]))
    return found


def crosses(box: Bbox, line: tuple[str, float]) -> bool:
    axis, at = line
    low, high = (box.y0, box.y1) if axis == "y" else (box.x0, box.x1)
    return low + SLACK < at < high - SLACK


CASES = [(name, width) for name in sorted(FIGURES) for width in ("single", "double")
         if width == "double" or name not in PAGE_WIDE]

# Checks that figure functions outside this change fail still, by (figure, width, check): each
# is expected to fail until its function is mended, and then to be taken off this list.
NOT_YET: dict[tuple[str, str, str], str] = {}


@pytest.fixture(scope="module", params=CASES, ids=[f"{name}-{width}" for name, width in CASES])
def figure(request):
    fig, texts, renderer = draw(*request.param)
    yield (*request.param, fig, texts, renderer)
    plt.close(fig)


def verdict(name: str, width: str, check: str, problems: list, what: str) -> None:
    """Pass on no ``problems``; a check on NOT_YET must fail (xfail), and passing says to take it off."""
    reason = NOT_YET.get((name, width, check))
    if reason and problems:
        pytest.xfail(reason)
    assert not reason, f"{name} ({width}) passes its {check} check now: take it off NOT_YET"
    assert not problems, f"{name} ({width}): {what}: {problems}"


def test_numbers_and_notes_stay_inside_their_axes(figure):
    name, width, fig, texts, _ = figure
    outside = [t.get_text() for ax in fig.axes for t in ax.texts
               if t in texts and not inside(texts[t], ax.get_window_extent())]
    verdict(name, width, "axes", outside, "text runs out of its axes")


def test_numbers_and_notes_keep_off_reference_lines(figure):
    name, width, fig, texts, _ = figure
    crossing = [t.get_text() for ax in fig.axes for t in ax.texts
                if t in texts and any(crosses(texts[t], line) for line in reference_lines(ax))]
    verdict(name, width, "lines", crossing, "text crosses a reference line")


def test_no_text_runs_off_the_figure(figure):
    name, width, fig, texts, _ = figure
    outside = [t.get_text() for t, box in texts.items() if not inside(box, fig.bbox)]
    verdict(name, width, "figure", outside, "text beyond the figure's edge")


def test_no_text_lies_over_another(figure):
    """Tick labels, numbers and notes each readable: none overlaps another (a legend's own are its business)."""
    name, width, fig, texts, _ = figure
    own = {text for legend in legends(fig) for text in [*legend.get_texts(), legend.get_title()]}
    free = [(t, outline(box, t.get_rotation())) for t, box in texts.items() if t not in own]
    over = [(a.get_text(), b.get_text()) for i, (a, shape) in enumerate(free) for b, other in free[i + 1:]
            if overlap(shape, other)]
    verdict(name, width, "texts", over, "texts over each other")


@pytest.mark.parametrize("figure", [case for case in CASES if case[1] == "double"], indirect=True,
                         ids=[name for name, width in CASES if width == "double"])
def test_titles_take_at_most_two_lines(figure):
    """At the width the notebooks draw them (a caller's long title may take three lines in one column)."""
    name, width, fig, _, _ = figure
    titles = [fig.get_suptitle()] + [t.get_text() for ax in fig.axes
                                     for t in (ax.title, ax._left_title, ax._right_title)]
    verdict(name, width, "titles", [t for t in titles if t.count("\n") >= 2], "titles of three lines or more")


def test_no_text_lies_under_a_legend(figure):
    name, width, fig, texts, renderer = figure
    under = []
    for legend in legends(fig):
        own = set(legend.get_texts()) | {legend.get_title()}
        box = outline(legend.get_window_extent(renderer))
        under += [t.get_text() for t, extent in texts.items()
                  if t not in own and overlap(outline(extent, t.get_rotation()), box)]
    verdict(name, width, "legend", under, "text under a legend")


def test_a_legend_beside_the_plots_leaves_them_the_width(figure):
    name, width, fig, _, renderer = figure
    plots = [ax.get_window_extent() for ax in fig.axes]
    wide = []
    for legend in legends(fig):
        box = legend.get_window_extent(renderer)
        beside = box.x0 >= max(p.x1 for p in plots) - SLACK or box.x1 <= min(p.x0 for p in plots) + SLACK
        if beside and box.width > MAX_SIDE_LEGEND * fig.bbox.width:
            wide.append(f"{box.width / fig.bbox.width:.0%} of the width")
    verdict(name, width, "side legend", wide, f"a legend beside the plots wider than {MAX_SIDE_LEGEND:.0%}")


def test_a_double_column_figure_fits_a_page(figure):
    name, width, fig, _, _ = figure
    tall = [f"{fig.get_figheight():.1f} in"] if width == "double" and fig.get_figheight() > MAX_HEIGHT else []
    verdict(name, width, "page", tall, f"taller than {MAX_HEIGHT} in")
