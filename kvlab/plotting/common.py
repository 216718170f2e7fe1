"""What every figure shares: byte counts for people, row-labelled tables, and saving for
papers (PNG + SVG, byte-reproducible)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

import matplotlib.pyplot as plt


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if float(n).is_integer() else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def provenance(rows: Iterable[dict]) -> str:
    """Where a figure's numbers come from: each machine and the profile it ran under."""
    rows = rows.to_dict("records") if hasattr(rows, "to_dict") else rows
    runs = dict.fromkeys((r.get("hardware") or "this machine", r.get("profile") or "unrecorded") for r in rows)
    return "measured on " + "; ".join(f"{hardware}, {profile} profile" for hardware, profile in runs)


def save_figure(fig: plt.Figure, name: str, figures_dir: str | Path, formats: Sequence[str] = ("png", "svg"),
                source: Iterable[dict] | None = None) -> list[Path]:
    """Save ``fig`` as ``figures_dir/name.{png,svg}`` (PNG for reading, SVG/PDF for papers).
    With ``source`` (the result rows drawn), a footer names their machines and profiles."""
    if source is not None:
        fig.text(0.995, 0.0, provenance(source), ha="right", va="top", fontsize=6, color="0.35")
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


def _ok(rows: Iterable[dict], **match) -> list[dict]:
    return [r for r in rows if r.get("status") == "ok" and all(r.get(k) == v for k, v in match.items())]


def _rows_labelled(fig: plt.Figure, ax: plt.Axes, labels: Sequence[str], title: str) -> plt.Figure:
    """Name the horizontal bars top to bottom (shared y axis) and finish the figure."""
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig
