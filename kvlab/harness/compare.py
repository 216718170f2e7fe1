"""Compare engine runs (kvlab.harness.engine results): a phase's timing row, and whether two
runs gave the same outputs, bitwise or within the drift of a differently split prefill."""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from kvlab.harness.spread import SAMPLES_KEY


def one_prompt(result: dict, phases: Sequence[str] | None = None, **match: Any) -> dict:
    """The rows of ``result`` (of ``phases``, all by default) whose fields hold ``match``
    (``prompt_tokens=2048``, ``prompt=1``), each numbered prompt 0: one prompt's runs of an
    engine given several, to time on their own and to hold against another engine's run of
    that prompt with :func:`same_outputs`."""
    return {"phases": {phase: [{**r, "prompt": 0} for r in runs if all(r[k] == v for k, v in match.items())]
                       for phase, runs in result["phases"].items() if phases is None or phase in phases}}


def summarize(name: str, result: dict, phase: str, **labels: Any) -> dict:
    """One table row: median, min and max first-token time of a phase over its prompts
    (and repeats), and every sample (``samples_s``, to the microsecond), so that a reading
    can put an interval on a difference."""
    rows = result["phases"][phase]
    times = [r["seconds"] for r in rows]
    return {
        "scenario": name, "phase": phase, **labels, "samples": len(rows),
        "prompt_tokens": statistics.median(r["prompt_tokens"] for r in rows),
        "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
        SAMPLES_KEY: [round(t, 6) for t in times],
        "cached_tokens": statistics.median(r["cached_tokens"] for r in rows),
    }


# The bound within which a run that splits the prefill differently (a connector hit computes
# only the suffix; a run without one, the whole prompt) must agree with it: fp32 sums taken in
# another order move SmolLM2's chosen-token logprobs by about 1e-5 (an MLA miniature's by
# 4e-4), a damaged KV by 1e-3 to 10. Against the same-split control (vLLM's own prefix hit)
# the bound is 0: bitwise.
SPLIT_DRIFT = 1e-3


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two token lists differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def gap_through_divergence(row: dict, reference: dict) -> float:
    """Largest chosen-token logprob difference of two greedy generations from the start up
    to and including their first different token. Where a small drift flips a near-tie, the
    two chosen tokens were nearly equally likely, so their logprobs differ by no more than
    the drift there either; a damaged KV moves them far apart before or at the flip."""
    diverge = first_difference(row["token_ids"], reference["token_ids"])
    upto = len(row["token_ids"]) if diverge is None else diverge + 1
    return max([0.0] + [abs(p - q) for p, q in zip(row["logprobs"][:upto], reference["logprobs"][:upto])])


def same_outputs(a: dict, b: dict, phase_a: str = "cold", phase_b: str = "warm") -> dict:
    """Do two runs agree, prompt by prompt: how many prompts gave identical tokens every
    time, the largest chosen-token logprob difference, and the largest one up to each
    prompt's first different token (:func:`gap_through_divergence`, to hold against
    :data:`SPLIT_DRIFT` when the runs split the prefill differently)."""
    reference = {row["prompt"]: row for row in a["phases"][phase_a]}
    same: dict[int, bool] = {}
    diff = gap = 0.0
    for row in b["phases"][phase_b]:
        ref = reference[row["prompt"]]
        same[row["prompt"]] = same.get(row["prompt"], True) and row["token_ids"] == ref["token_ids"]
        diff = max([diff] + [abs(p - q) for p, q in zip(row["logprobs"], ref["logprobs"])])
        gap = max(gap, gap_through_divergence(row, ref))
    return {"identical": sum(same.values()), "prompts": len(same), "max_logprob_diff": diff,
            "max_gap_through_divergence": gap}
