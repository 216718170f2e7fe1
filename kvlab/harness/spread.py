"""How far a measured number can be trusted: the median of its samples and their spread, and
whether two numbers differ by more than that spread. A comparison a reader may cite states
both; a difference inside the spread is one this run cannot resolve, and is said to be so.

Intervals come from the raw samples where a row keeps them (a bootstrap of the statistic,
seeded, so the same rows always give the same text), else from each side's min-max range
(wider: every pairing of extremes)."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

MIN_SAMPLES = 3  # fewer samples than this on either side: no difference is claimed
RESAMPLES = 2000
CONFIDENCE = 0.95
BOOTSTRAP = f"bootstrap {CONFIDENCE:.0%}"
MIN_MAX = "min-max"
MEDIAN_ONLY = "median only"  # a row that kept no samples: nothing can be claimed from it


@dataclass(frozen=True)
class Estimate:
    """A statistic (``value``: a median, a difference or ratio of medians) with the interval
    it may lie in (``low`` to ``high``, found ``how``), from at least ``samples`` samples a side."""

    value: float
    low: float
    high: float
    samples: int
    how: str = MIN_MAX

    def __post_init__(self) -> None:
        if not all(math.isfinite(x) for x in (self.value, self.low, self.high)):
            raise ValueError(f"an estimate needs finite numbers, got {self.value}, {self.low}, {self.high}")
        if not self.low <= self.value <= self.high:
            raise ValueError(f"an estimate's value {self.value} must lie within its interval {self.low}-{self.high}")
        if self.samples < 1:
            raise ValueError(f"an estimate needs at least one sample, got {self.samples}")

    @property
    def resolved(self) -> bool:
        """Enough samples on every side that the interval means something."""
        return self.samples >= MIN_SAMPLES and self.how != MEDIAN_ONLY

    def excludes(self, reference: float = 0.0) -> bool:
        """Whether this run can tell the statistic from ``reference``: enough samples, and
        the whole interval on one side of it."""
        return self.resolved and (self.low > reference or self.high < reference)

    def scaled(self, factor: float) -> Estimate:
        """The same estimate in other units (seconds to milliseconds: 1e3)."""
        low, high = sorted((self.low * factor, self.high * factor))
        return Estimate(self.value * factor, low, high, self.samples, self.how)


def _checked(values: Sequence[float], what: str) -> list[float]:
    values = [float(v) for v in values]
    if not values:
        raise ValueError(f"{what}: no samples")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"{what}: samples must be finite numbers, got {values}")
    return values


def spread(values: Sequence[float]) -> Estimate:
    """The median of ``values`` and their min-max range."""
    values = _checked(values, "spread")
    return Estimate(statistics.median(values), min(values), max(values), len(values))


def summary(median: float, low: float, high: float, samples: int) -> Estimate:
    """An estimate from a row that kept only its median, min, max and sample count."""
    return Estimate(float(median), float(low), float(high), int(samples))


def median_only(value: float) -> Estimate:
    """A number from a row that kept no samples and no range: shown, never compared."""
    return Estimate(float(value), float(value), float(value), 1, MEDIAN_ONLY)


def _bootstrap(statistic: Callable[..., float], groups: Sequence[list[float]]) -> tuple[float, float]:
    rng = random.Random(0)  # the same rows give the same interval, so rendered text is reproducible
    drawn = sorted(statistic(*([rng.choice(g) for _ in g] for g in groups)) for _ in range(RESAMPLES))
    tail = (1 - CONFIDENCE) / 2
    return drawn[int(tail * RESAMPLES)], drawn[int((1 - tail) * RESAMPLES) - 1]


def _median_difference(a: list[float], b: list[float]) -> float:
    return statistics.median(a) - statistics.median(b)


def _median_ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(a) / statistics.median(b)


def bootstrapped(statistic: Callable[..., float], *groups: Sequence[float]) -> Estimate:
    """``statistic`` of several sets of raw samples (each argument a list of one set's
    samples; e.g. a difference of two overheads, each a warm median minus a floor median),
    with a bootstrap interval that resamples every set."""
    groups = [_checked(g, "bootstrapped") for g in groups]
    value = statistic(*groups)
    fewest = min(len(g) for g in groups)
    if fewest < 2:
        return Estimate(value, value, value, fewest, BOOTSTRAP)
    low, high = _bootstrap(statistic, groups)
    return Estimate(value, min(low, value), max(high, value), fewest, BOOTSTRAP)


def difference(a: Sequence[float], b: Sequence[float]) -> Estimate:
    """median(a) - median(b) of two sets of raw samples, with a bootstrap interval."""
    return bootstrapped(_median_difference, a, b)


def ratio(a: Sequence[float], b: Sequence[float]) -> Estimate:
    """median(a) / median(b) of two sets of positive raw samples, with a bootstrap interval."""
    if min(_checked(b, "ratio")) <= 0:
        raise ValueError(f"a ratio's denominator samples must be positive, got {list(b)}")
    return bootstrapped(_median_ratio, a, b)


def summary_difference(a: Estimate, b: Estimate) -> Estimate:
    """a - b of two estimates known by their ranges only: the interval pairs their extremes."""
    how = MEDIAN_ONLY if MEDIAN_ONLY in (a.how, b.how) else MIN_MAX
    return Estimate(a.value - b.value, a.low - b.high, a.high - b.low, min(a.samples, b.samples), how)


def summary_ratio(a: Estimate, b: Estimate) -> Estimate:
    """a / b of two positive estimates known by their ranges only."""
    if min(a.low, b.low) <= 0:
        raise ValueError(f"a ratio of ranges needs positive ranges, got {a} and {b}")
    how = MEDIAN_ONLY if MEDIAN_ONLY in (a.how, b.how) else MIN_MAX
    return Estimate(a.value / b.value, a.low / b.high, a.high / b.low, min(a.samples, b.samples), how)


SAMPLES_KEY = "samples_s"  # a timing row's raw samples, in seconds


def row_estimate(row: Mapping, key: str = "median_s") -> Estimate:
    """A timing row's statistic: from its raw samples (``samples_s``) when it kept them, else
    its median, min and max (``median_s``, ``min_s``, ``max_s``) and ``samples`` count."""
    raw = row.get(SAMPLES_KEY)
    if key == "median_s" and raw:
        return spread(raw)
    stem = key.removesuffix("median_s")
    low, high = row.get(f"{stem}min_s"), row.get(f"{stem}max_s")
    if low is None or high is None:
        return median_only(row[key])
    return summary(row[key], low, high, row.get("samples") or 1)


def row_difference(a: Mapping, b: Mapping) -> Estimate:
    """median(a) - median(b) of two timing rows: bootstrapped from their raw samples when
    both kept them, else from their min-max ranges."""
    if a.get(SAMPLES_KEY) and b.get(SAMPLES_KEY):
        return difference(a[SAMPLES_KEY], b[SAMPLES_KEY])
    return summary_difference(row_estimate(a), row_estimate(b))
