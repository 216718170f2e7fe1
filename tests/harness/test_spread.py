"""How far a measured difference can be trusted: intervals from raw samples or ranges, and a
difference claimed in words only beyond its interval (kvlab.harness.spread, kvlab.plotting.story.claims)."""

import pytest

from kvlab.plotting.story.claims import against_target, versus
from kvlab.harness.spread import (MEDIAN_ONLY, Estimate, bootstrapped, difference, median_only, ratio, row_difference,
                                  row_estimate, spread, summary_difference)


def test_an_interval_comes_from_the_samples_and_the_same_samples_give_the_same_interval():
    fast, slow = [10.0, 10.5, 9.8, 10.2, 10.1], [12.0, 12.4, 11.9, 12.2, 12.1]
    gap = difference(slow, fast)
    assert gap.value == pytest.approx(2.0) and gap.low > 0 and gap.excludes(0.0)
    assert difference(slow, fast) == gap  # seeded: a rendered text never changes on its own
    assert not difference([10.0, 14.0, 6.0], [10.5, 13.0, 7.0]).excludes(0.0)  # overlapping samples
    assert ratio(slow, fast).low > 1
    assert spread([3.0, 1.0, 2.0]) == Estimate(2.0, 1.0, 3.0, 3)


def test_too_few_samples_or_none_kept_never_resolve():
    assert not difference([12.0, 12.1], [10.0, 10.1]).excludes(0.0)  # two a side: below MIN_SAMPLES
    kept_nothing = median_only(5.0)
    assert kept_nothing.how == MEDIAN_ONLY and not kept_nothing.excludes(0.0)
    assert summary_difference(spread([9.0, 10, 11]), kept_nothing).how == MEDIAN_ONLY
    four = bootstrapped(lambda a, b, c, d: (sum(a) - sum(b)) - (sum(c) - sum(d)), [5, 6, 7], [1, 1, 1], [3, 3, 4], [1, 1, 2])
    assert four.samples == 3 and four.low <= four.value <= four.high


def test_a_timing_row_gives_its_samples_else_its_range_else_its_median_only():
    kept = {"median_s": 2.0, "samples_s": [1.0, 2.0, 3.0]}
    ranged = {"median_s": 2.0, "min_s": 1.5, "max_s": 2.5, "samples": 9}
    bare = {"median_s": 2.0}
    assert row_estimate(kept) == Estimate(2.0, 1.0, 3.0, 3)
    assert row_estimate(ranged) == Estimate(2.0, 1.5, 2.5, 9)
    assert row_estimate(bare).how == MEDIAN_ONLY
    assert row_difference(kept, ranged).how == "min-max" and row_difference(kept, kept).how.startswith("bootstrap")


def test_bad_samples_are_clear_errors():
    with pytest.raises(ValueError, match="no samples"):
        spread([])
    with pytest.raises(ValueError, match="finite"):
        difference([1.0, float("nan")], [1.0])
    with pytest.raises(ValueError, match="denominator samples must be positive"):
        ratio([1.0], [0.0, 1.0])
    with pytest.raises(ValueError, match="within its interval"):
        Estimate(5.0, 1.0, 2.0, 3)


def test_words_claim_a_difference_only_beyond_the_spread_and_judge_targets_on_the_whole_interval():
    told = versus(Estimate(-2.0, -3.0, -1.0, 5, "bootstrap 95%"), "A", "B")
    assert told == "A takes 2.0 ms less than B (95% bootstrap interval 1.0–3.0 ms, 5 samples a side)"
    untold = versus(Estimate(1.0, -0.5, 2.5, 5, "bootstrap 95%"), "A", "B")
    assert untold.startswith("this run cannot tell A from B: A takes 1.0 ms more, within the spread")
    assert "fewer than 3 samples a side" in versus(Estimate(1.0, 0.5, 1.5, 2), "A", "B")
    assert against_target(Estimate(1.4, 1.3, 1.45, 9), 1.5).endswith(": met")
    assert against_target(Estimate(1.6, 1.55, 1.7, 9), 1.5).endswith(": missed")
    assert against_target(Estimate(1.5, 1.4, 1.6, 9), 1.5).endswith(": not decided by this run")
    assert against_target(median_only(1.2), 1.5).endswith(": not decided by this run")
