"""kvlab.experiments.peers' verdict on an engine B: bitwise against the same-split control,
and within the split's drift of A's whole prefill; a damaged KV fails the first."""

from __future__ import annotations

import pytest

from kvlab.experiments.peers import _against, mooncake_peers
from kvlab.harness.compare import SPLIT_DRIFT

CONTROL = {"token_ids": [5, 6, 7, 8], "logprobs": [-0.5, -1.25, -0.75, -2.0]}


def test_the_control_itself_is_identical_and_within_drift_of_cold() -> None:
    cold = {"token_ids": [5, 6, 7, 8], "logprobs": [-0.5, -1.25 + 1e-5, -0.75, -2.0]}  # another split
    verdict = _against(CONTROL, cold, dict(CONTROL))
    assert verdict["identical_to_control"] and verdict["logprob_diff_vs_control"] == 0.0
    assert verdict["gap_to_cold"] == pytest.approx(1e-5) and verdict["within_split_drift_of_cold"]


def test_a_damaged_kv_fails_the_control_even_with_the_same_tokens() -> None:
    damaged = {"token_ids": [5, 6, 7, 8], "logprobs": [-0.5, -1.25, -0.75 - 2 * SPLIT_DRIFT, -2.0]}
    verdict = _against(CONTROL, CONTROL, damaged)
    assert not verdict["identical_to_control"] and verdict["logprob_diff_vs_control"] == pytest.approx(2 * SPLIT_DRIFT)
    assert not verdict["within_split_drift_of_cold"]


def test_one_bit_off_is_not_identical() -> None:
    off = {"token_ids": [5, 6, 7, 8], "logprobs": [-0.5, -1.25, -0.75, -2.0000000000000004]}
    assert not _against(CONTROL, CONTROL, off)["identical_to_control"]


@pytest.mark.parametrize("peers", [("vLLM's own",), ()])
def test_unknown_peers_are_refused(tmp_path, peers) -> None:
    with pytest.raises(ValueError, match="peers must name some of"):
        mooncake_peers(tmp_path, peers=peers)
