"""Engine-level accuracy (kvlab.experiments.engine_checks), for real: SmolLM2-135M fp32
through recompute, vLLM's own prefix hit (the control) and KVLabConnector, whole-step and
layerwise."""

from __future__ import annotations

import math

import pytest

from kvlab.experiments.engine_checks import (
    RECOMPUTE,
    AccuracyCheck,
    against_control,
    reuse_paths,
)
from kvlab.experiments.tasks import GSMTask

pytestmark = pytest.mark.slow  # starts engines, servers or notebook kernels


def test_kvlab_reuse_changes_nothing_in_fp32(smollm2: str) -> None:
    """Recompute, the control and KVLabConnector (whole-step, layerwise) on a trained
    model: identical generations; logprobs bitwise equal to vLLM's own prefix hit (which
    itself differs from recompute only by the compute path); the text continuation was
    scored on reloaded KV (zeroed KV gives another perplexity)."""
    check = AccuracyCheck(smollm2, task=GSMTask(size=2, shots=2), max_tokens=16, windows=1,
                          prefix_tokens=256, scored_tokens=16, paths=reuse_paths()[:4])
    report = check.run()
    assert all(row["no_worse_than_control"] for row in against_control(report.perplexity()))
    for row in report.generations():
        assert row["identical"] == 2, row
        assert row["max_logprob_diff_vs_control"] == 0.0 or row["path"] == RECOMPUTE, row
        assert row["path"] == RECOMPUTE or row["reused_tokens"] > 0, row
    for row in report.perplexity():
        assert row["path"] == RECOMPUTE or row["reused_prefix_tokens"] == 224, row
        if row["path"] != RECOMPUTE:
            assert row["max_logprob_diff_vs_control"] == 0.0, row
            assert row["max_logprob_diff"] <= 1e-4, row
        if row["perplexity_zeroed_kv"] is not None:
            assert abs(math.log(row["perplexity_zeroed_kv"] / row["perplexity"])) > 0.5, row
    assert all(row["within_stderr"] for row in report.task_scores())
