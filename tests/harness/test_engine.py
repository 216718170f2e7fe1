"""How kvlab.harness.engine orders its phases and kvlab.harness.compare compares two runs
(no engine started)."""

import pytest

from kvlab.harness.compare import SPLIT_DRIFT, first_difference, gap_through_divergence, one_prompt, same_outputs
from kvlab.harness.engine import EngineSpec, _schedule, run_engine


def run(*rows: tuple[list[int], list[float]], phase: str = "cold") -> dict:
    return {"phases": {phase: [{"prompt": i, "token_ids": t, "logprobs": lp} for i, (t, lp) in enumerate(rows)]}}


def test_the_control_runs_every_prompt_after_cold_and_before_any_warm_run() -> None:
    """vLLM's own prefix hit on the cold run's KV: a "warm" run empties vLLM's prefix cache,
    so a control after it would be served by the connector, or by KV the connector loaded."""
    schedule = _schedule(("cold", "control", "warm", "warm-zeroed"), 2, batch=False)
    assert schedule == [("cold", [0]), ("cold", [1]), ("control", [0]), ("control", [1]),
                        ("warm", [0]), ("warm", [1]), ("warm-zeroed", [0]), ("warm-zeroed", [1])]


@pytest.mark.parametrize("phase", ["control", "floor"])
def test_vllms_own_prefix_hit_needs_prefix_caching(tmp_path, phase) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=f"the {phase} phase needs prefix caching on"):
        run_engine(EngineSpec(str(tmp_path), phases=("cold", phase)), [[1, 2, 3]])


def test_a_flipped_near_tie_is_within_the_drift_and_damaged_kv_is_not() -> None:
    cold = run(([5, 6, 7, 8], [-0.5, -0.69310, -0.2, -0.1]))
    same = run(([5, 6, 7, 8], [-0.5, -0.69310, -0.2, -0.1]))
    # another prefill split: 1e-5 of drift flips the near-tie at position 1 (ln 2 either way)
    flipped = run(([5, 9, 3, 3], [-0.50001, -0.69312, -2.0, -3.0]))
    # a damaged KV: the same tokens at first, logprobs far off, then another token
    damaged = run(([5, 9, 7, 8], [-0.9, -0.2, -0.2, -0.1]))
    assert first_difference([5, 6], [5, 6]) is None and first_difference([5, 6], [5, 9]) == 1
    assert first_difference([5, 6], [5]) == 1
    assert same_outputs(cold, same, "cold", "cold") == {"identical": 1, "prompts": 1, "max_logprob_diff": 0.0,
                                        "max_gap_through_divergence": 0.0}
    near = same_outputs(cold, flipped, "cold", "cold")
    assert near["identical"] == 0 and near["max_logprob_diff"] > 1  # after the flip the contexts differ
    gap = near["max_gap_through_divergence"]
    assert gap == pytest.approx(2e-5) and gap <= SPLIT_DRIFT
    assert gap_through_divergence(damaged["phases"]["cold"][0], cold["phases"]["cold"][0]) == pytest.approx(0.4931)
    assert same_outputs(cold, damaged, "cold", "cold")["max_gap_through_divergence"] > SPLIT_DRIFT


def test_one_prompt_of_several_is_held_against_another_engine_s_run_of_it() -> None:
    """An engine given prompts A and B, the other given B alone: B's rows, numbered prompt 0,
    compare with the other's, and only the phases asked for are kept."""
    def row(prompt, tokens):
        return {"prompt": prompt, "prompt_tokens": 64, "token_ids": tokens, "logprobs": [-0.5] * len(tokens)}

    both = {"phases": {"warm": [row(0, [1, 2]), row(1, [3, 4])], "floor": [row(0, [1, 2]), row(1, [3, 4])]}}
    alone = {"phases": {"control": [row(0, [3, 4])]}}
    b = one_prompt(both, prompt=1)
    assert b == {"phases": {"warm": [row(0, [3, 4])], "floor": [row(0, [3, 4])]}}
    assert same_outputs(alone, b, "control", "warm")["identical"] == 1
    assert same_outputs(alone, one_prompt(both, prompt=0), "control", "warm")["identical"] == 0
    assert set(one_prompt(both, ("floor",))["phases"]) == {"floor"}


def test_weight_loads_run_after_the_other_phases_in_their_order() -> None:
    schedule = _schedule(("cold", "reload-1", "warm", "reload-0"), 1, batch=False)
    assert schedule == [("cold", [0]), ("warm", [0]), ("reload-1", [0]), ("reload-0", [0])]


@pytest.mark.parametrize("reloads, phases, error", [
    ([{"weights": "W", "how": "copy"}], ("reload-0",), "how in"),
    ([{"weights": "/nonexistent", "how": "path"}], ("reload-0",), "no model folder"),
    ([{"weights": "W", "how": "path"}], ("reload-1",), "must name each"),
    ([{"weights": "W", "how": "path", "reset": "all"}], ("reload-0",), "reset in"),
])
def test_bad_weight_loads_are_clear_errors(tmp_path, reloads, phases, error) -> None:
    (tmp_path / "config.json").write_text("{}")
    reloads = [{k: (str(tmp_path) if v == "W" else v) for k, v in r.items()} for r in reloads]
    with pytest.raises((ValueError, FileNotFoundError), match=error):
        run_engine(EngineSpec(str(tmp_path), phases=("cold", *phases), reloads=tuple(reloads)), [[1, 2, 3]])


@pytest.mark.parametrize("field, value", [("num_gpu_blocks", 0), ("max_num_seqs", -1), ("num_gpu_blocks", 2.5)])
def test_a_bad_small_cache_setting_is_a_clear_error(tmp_path, field, value) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=f"{field} must be a positive integer"):
        run_engine(EngineSpec(str(tmp_path), **{field: value}), [[1, 2, 3]])
