"""Saving a paper figure: PNG, SVG and PDF with embedded fonts, the same bytes for the same
figure; a footer naming the one machine and profile its numbers were measured on (several only
for a figure that compares machines by design); and, in a notebook, the figure shown with a
caption and alt text (kvlab.plotting.report puts them on the page)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Sequence

import matplotlib
import matplotlib.pyplot as plt

from kvlab.plotting.common import SMALL, as_records, legend_labels, wrap

# Applied when saving: fonts embedded as TrueType (editable, accepted by publishers), SVG
# glyph ids from a fixed salt, so the same figure gives the same bytes.
SAVE_RC = {"pdf.fonttype": 42, "ps.fonttype": 42, "svg.fonttype": "path", "svg.hashsalt": "kvlab"}
FORMATS = ("png", "svg", "pdf")
IMAGE = "image/png"


def runs(rows: Iterable[dict]) -> list[tuple[str, str]]:
    """Each (machine, profile) the rows were measured with, in order (published rows, which
    another project measured, apart: see :func:`provenance`)."""
    return list(dict.fromkeys((r.get("hardware") or "this machine", r.get("profile") or "unrecorded")
                              for r in as_records(rows) if not r.get("published")))


def provenance(rows: Iterable[dict]) -> str:
    """Where a figure's numbers come from: each machine and the profile it ran under, and each
    published source (a row with ``published``: kvlab.plotting.gpu_model.citations) with its
    hardware, kept apart from this project's measurements."""
    rows = as_records(rows)
    published = dict.fromkeys(f"{r['published']} ({r.get('hardware') or 'hardware not stated'})"
                              for r in rows if r.get("published"))
    measured = runs(rows)
    text = "measured on " + "; ".join(f"{hardware}, {profile} profile" for hardware, profile in measured)
    if not published:
        return text
    cited = "published: " + "; ".join(published)
    return f"{text}; {cited}" if measured else cited


def flat(text: str) -> str:
    """Text as one line (titles and labels are wrapped to fit the figure)."""
    return " ".join(text.split())


def caption(fig: plt.Figure, name: str, footer: str | None = None) -> str:
    """What a figure shows, for the report under it: its title (or its panels'), and where
    its numbers were measured."""
    titles = [fig.get_suptitle()] if fig.get_suptitle() else [ax.get_title() for ax in fig.axes if ax.get_title()]
    shown = "; ".join(dict.fromkeys(flat(t) for t in titles)) or name
    return f"{shown}." + (f" {footer[0].upper()}{footer[1:]}." if footer else "")


def alt_text(fig: plt.Figure, name: str, footer: str | None = None) -> str:
    """A description of ``fig`` for a reader who cannot see it: the caption, each panel's
    axes and what the legend names."""
    panels = []
    for ax in fig.axes:
        axes = [f"{axis} {flat(label)}" for axis, label in (("x:", ax.get_xlabel()), ("y:", ax.get_ylabel())) if label]
        if axes or ax.get_title():
            panels.append(", ".join(([flat(ax.get_title())] if ax.get_title() else []) + axes))
    keys = list(dict.fromkeys(flat(label) for label in legend_labels(fig)))
    text = f"Figure {name}: {caption(fig, name, footer)}"
    if panels:
        text += f" {'Panels' if len(panels) > 1 else 'Panel'}: " + "; ".join(dict.fromkeys(panels)) + "."
    return text + (f" Legend: {', '.join(keys)}." if keys else "")


def shown_in_a_notebook() -> bool:
    """Whether figures are drawn into a notebook's output (matplotlib's inline backend in a kernel)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None and "inline" in matplotlib.get_backend()


# matplotlib names an SVG's clip paths and markers by a hash of their coordinates as floats,
# whose last bits differ between CPUs (another SIMD width, another rounding) where the
# drawing does not: "p" or "m" and ten hex digits.
_HASHED_ID = re.compile(r'id="([pm][0-9a-f]{10})"')


def number_svg_ids(path: Path) -> None:
    """Rename the SVG's hashed clip-path and marker ids by order of appearance, so the same
    drawing gives the same bytes on every machine."""
    text = path.read_text()
    names = {old: f"{old[0]}{index}" for index, old in enumerate(dict.fromkeys(_HASHED_ID.findall(text)))}
    if names:
        text = re.sub("|".join(names), lambda match: names[match.group(0)], text)
        path.write_text(text)


def save_figure(fig: plt.Figure, name: str, figures_dir: str | Path, formats: Sequence[str] = FORMATS,
                source: Iterable[dict] | None = None, compares_machines: bool = False) -> list[Path]:
    """Save ``fig`` as ``figures_dir/name.{png,svg,pdf}`` (PNG for reading, SVG and PDF for
    papers), the same bytes for the same figure (clean git diffs). With ``source`` (the
    result rows drawn), a footer names their machine and profile: one of each, unless the
    figure ``compares_machines`` by design (a figure mixing runs unawares is refused). In a
    notebook, the figure is shown here, with its caption and alt text as the image's
    metadata, and closed (so not shown twice)."""
    unknown = set(formats) - set(FORMATS)
    if unknown:
        raise ValueError(f"save_figure writes {FORMATS}, not {sorted(unknown)}")
    footer = None
    if source is not None:
        measured = runs(source)
        if len(measured) > 1 and not compares_machines:
            raise ValueError(f"{name}: a paper figure shows one machine and one profile, and these rows come from "
                             f"{measured}: draw the newest run (kvlab.results.results_for), or pass "
                             f"compares_machines=True for a figure comparing them by design")
        footer = provenance(source)
    fig.canvas.draw()  # laid out, then kept so: saving crops the figure, and a legend placed
    fig.set_layout_engine("none")  # on the figure's edge would move with the crop
    for legend in fig.legends:
        legend.set_bbox_to_anchor((0, 0, 1, 1), transform=fig.transFigure)
    if footer is not None:  # below everything drawn
        bottom = fig.get_tightbbox(fig.canvas.get_renderer()).y0 / fig.get_figheight()
        fig.text(0.995, min(bottom, 0.0), wrap(footer, fig.get_figwidth(), SMALL), ha="right", va="top",
                 fontsize=SMALL, color="0.35")
    figures_dir = Path(figures_dir)
    figures_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        path = figures_dir / f"{name}.{fmt}"
        with plt.rc_context(SAVE_RC):
            fig.savefig(path, dpi=300, bbox_inches="tight", pad_inches=0.03,
                        metadata={"svg": {"Date": None}, "pdf": {"CreationDate": None}}.get(fmt))
        if fmt == "svg":
            number_svg_ids(path)
        paths.append(path)
    if shown_in_a_notebook():
        from IPython.display import display

        display(fig, metadata={IMAGE: {"alt": alt_text(fig, name, footer), "caption": caption(fig, name, footer)}})
        plt.close(fig)
    return paths
