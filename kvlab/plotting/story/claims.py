"""The words around the numbers: Markdown rendered from result rows, so a notebook's or a
document's prose says what the rows on the page say. A number comes with its sample count
and spread, a comparison claims a difference only where it exceeds the spread (else it says
this run cannot tell the two apart), and every reading names the run it quotes."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Iterable

from kvlab.harness.spread import BOOTSTRAP, MEDIAN_ONLY, MIN_SAMPLES, Estimate
from kvlab.plotting.common import as_records, short_hardware


@dataclass(frozen=True)
class Takeaways:
    """Points shown as a Markdown bullet list (plain lines where Markdown is not rendered)."""
    points: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("no takeaways: the rows given hold none of the numbers they are read from")

    def markdown(self) -> str:
        return "\n".join(f"- {point}" for point in self.points)

    def _repr_markdown_(self) -> str:
        return self.markdown()

    def __str__(self) -> str:
        return self.markdown()


class Headline:
    """A notebook's headline near its top, filled in by its takeaways cell once the notebook
    has run to its end: a reader meets the result first, read from the same run's rows as
    the takeaways below (in a notebook; elsewhere it shows nothing)."""

    WAITING = "*The headline of this run appears here once the notebook has run to its end (its takeaways).*"

    def __init__(self) -> None:
        from IPython.display import Markdown, display

        self._handle = display(Markdown(self.WAITING), display_id=True)

    def show(self, points: Takeaways) -> Takeaways:
        """Show ``points`` in the headline's place as well; returns them, to be shown where called."""
        from IPython.display import Markdown

        if self._handle is not None:
            self._handle.update(Markdown(f"**This run's headline** (read from its rows, as the takeaways at the end "
                                         f"are):\n\n{points.markdown()}"))
        return points


def takeaways(*points: str | None) -> Takeaways:
    """Takeaways from ready-made points; a None point (its rows were missing) is left out."""
    return Takeaways(tuple(point for point in points if point))


@dataclass(frozen=True)
class Prose:
    """Paragraphs of Markdown read from result rows: what a notebook shows where it would
    otherwise type numbers, so its text follows the results when the rows change."""
    text: str

    def markdown(self) -> str:
        return self.text

    def _repr_markdown_(self) -> str:
        return self.text

    def __str__(self) -> str:
        return self.text


def prose(*sentences: str | None) -> Prose:
    """One paragraph of the sentences given; None sentences (rows missing) are left out, and
    a paragraph left empty says so rather than vanish."""
    kept = [s for s in sentences if s]
    return Prose(" ".join(kept) if kept else "*No rows of this run hold the numbers this text is read from.*")


def paragraphs(*parts: Prose | str | None) -> Prose:
    """Several paragraphs, blank-line separated."""
    return Prose("\n\n".join(str(p) for p in parts if p))


def number(value: Any) -> bool:
    """A measured number (numpy's and pandas' too), not a missing one (None, NaN, pd.NA)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)


def span(values: Iterable[float], unit: str = "", digits: int = 0) -> str:
    """``low–high`` (or one value) with thousands separators."""
    values = sorted(values)
    low, high = f"{values[0]:,.{digits}f}", f"{values[-1]:,.{digits}f}"
    return f"{low}{unit}" if low == high else f"{low}–{high}{unit}"


def _unit(unit: str) -> str:
    return unit if unit in ("×", "%") else f" {unit}" if unit else ""


def amount(value: float, unit: str = "ms", digits: int = 1) -> str:
    """``12.3 ms``, ``1.73×``, ``45%``."""
    return f"{value:,.{digits}f}{_unit(unit)}"


def interval(estimate: Estimate, unit: str = "ms", digits: int = 1) -> str:
    """How far ``estimate`` can be trusted, in words: its interval and sample count."""
    if estimate.how == MEDIAN_ONLY:
        return "its samples were not kept"
    if estimate.samples == 1:
        return "one sample"
    if estimate.low == estimate.high:
        return f"{estimate.samples} samples, all equal"
    kind = "95% bootstrap interval" if estimate.how == BOOTSTRAP else "min–max"
    return (f"{kind} {estimate.low:,.{digits}f}–{estimate.high:,.{digits}f}{_unit(unit)}, "
            f"{estimate.samples} samples{' a side' if estimate.how == BOOTSTRAP else ''}")


def quantity(estimate: Estimate, unit: str = "ms", digits: int = 1) -> str:
    """``12.3 ms (min–max 11.9–13.0 ms, 9 samples)``; a median whose samples were not kept
    is shown bare (:func:`medians_only` says so once for a whole reading)."""
    if estimate.how == MEDIAN_ONLY:
        return amount(estimate.value, unit, digits)
    return f"{amount(estimate.value, unit, digits)} ({interval(estimate, unit, digits)})"


def medians_only(*estimates: Estimate | None) -> str | None:
    """The note a reading adds when some of its numbers are medians whose samples its rows
    did not keep: shown, but never compared."""
    if any(e is not None and e.how == MEDIAN_ONLY for e in estimates):
        return ("Numbers shown without an interval are medians whose samples these rows did not keep: no "
                "difference is claimed from them.")
    return None


def versus(difference: Estimate, subject: str, other: str, unit: str = "ms", digits: int = 1,
           more: str = "more", less: str = "less") -> str:
    """``subject`` against ``other`` through their ``difference`` (subject - other): the
    difference claimed only where its interval excludes zero, else said to be unresolved."""
    word = more if difference.value > 0 else less
    if difference.value < 0:  # said as "less", so shown as a positive amount
        difference = Estimate(-difference.value, -difference.high, -difference.low, difference.samples, difference.how)
    if difference.excludes(0.0):
        return (f"{subject} takes {amount(abs(difference.value), unit, digits)} {word} than {other} "
                f"({interval(difference, unit, digits)})")
    if difference.how == MEDIAN_ONLY:
        return (f"this run cannot tell {subject} from {other}: {subject} takes "
                f"{amount(abs(difference.value), unit, digits)} {word}, but the samples were not kept to compare")
    why = f"fewer than {MIN_SAMPLES} samples a side" if not difference.resolved else "the interval spans zero"
    return (f"this run cannot tell {subject} from {other}: {subject} takes {amount(abs(difference.value), unit, digits)} "
            f"{word}, within the spread ({interval(difference, unit, digits)}; {why})")


def against_target(estimate: Estimate, target: float, at_most: bool = True, unit: str = "×", digits: int = 2) -> str:
    """Whether ``estimate`` meets a target, judged on its whole interval: met, missed, or
    undecided when the interval straddles the target."""
    inside = estimate.high <= target if at_most else estimate.low >= target
    outside = estimate.low > target if at_most else estimate.high < target
    verdict = "met" if inside and estimate.resolved else "missed" if outside and estimate.resolved else \
        "not decided by this run"
    bound = "at most" if at_most else "at least"
    return f"{quantity(estimate, unit, digits)} against a target of {bound} {amount(target, unit, digits)}: {verdict}"


def source(rows: Any) -> str:
    """Whose run the rows are: machine, profile and date of each run among them."""
    runs = dict.fromkeys((short_hardware(r.get("hardware")), r.get("profile") or "unrecorded",
                          str(r.get("run_date") or "")[:10]) for r in as_records(rows))
    return "; ".join(f"{hardware}, {profile} profile{f', {date}' if date else ''}" for hardware, profile, date in runs)


def quoted(rows: Any) -> str:
    """``(run: AMD EPYC (2 cores), paper profile, 2026-11-30)``: the note a reading ends with."""
    return f"(run: {source(rows)})"
