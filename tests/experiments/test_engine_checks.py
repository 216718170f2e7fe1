"""Engine-level accuracy checks (kvlab.experiments.engine_checks) without an engine: text
windows, task prompts and scoring, the report's comparisons on hand-made results, the
reuse paths, and bad requests refused before an engine starts."""

from __future__ import annotations

import math

import pytest

from kvlab.experiments.engine_checks import (
    CONTROL,
    RECOMPUTE,
    AccuracyCheck,
    AccuracyReport,
    ReusePath,
    against_control,
    reuse_paths,
)
from kvlab.experiments.tasks import DISCRIMINATING, GSMTask, book_text, text_windows


def test_text_windows_are_consecutive_and_checked() -> None:
    windows = text_windows(list(range(100)), 2, 30, 10)
    assert windows == [(list(range(30)), list(range(30, 40))), (list(range(40, 70)), list(range(70, 80)))]
    with pytest.raises(ValueError, match="too short"):
        text_windows(list(range(100)), 3, 30, 10)
    with pytest.raises(ValueError, match="positive"):
        text_windows(list(range(100)), 1, 0, 10)
    assert "2889" in book_text()


def test_gsm_task_prompts_share_the_shots_and_score_like_lm_eval() -> None:
    task = GSMTask(size=4, seed=3, shots=2)
    prompts = task.prompts()
    shared = prompts[0][:prompts[0].rindex("Question:")]
    assert shared.count("####") == 2 and all(p.startswith(shared) for p in prompts)
    assert all(p.endswith("\nAnswer:") for p in prompts)
    answers = [task.dataset[i]["answer"] for i in range(4)]
    completions = [f" so it is {answers[0]}.\n#### {answers[0]}\n\nQuestion: next",  # both filters
                   f" it is {answers[1]}",  # flexible only
                   " #### 1\n\nQuestion: and then " + answers[2],  # wrong; text after the stop ignored
                   ""]
    scores = task.score(completions)
    assert scores["strict-match"]["accuracy"] == 0.25 and scores["flexible-extract"]["accuracy"] == 0.5
    assert math.isclose(scores["flexible-extract"]["stderr"], math.sqrt(0.25 / 3))
    with pytest.raises(ValueError, match="completions"):
        task.score(completions[:2])
    with pytest.raises(ValueError, match="size"):
        GSMTask(size=0)


def test_a_gym_task_asks_short_answers_after_shared_shots() -> None:
    task = DISCRIMINATING.resized(3)
    prompts = task.prompts()
    shared = prompts[0][:prompts[0].rindex("Question:")]
    assert shared.count("Answer: ") == task.shots and all(p.startswith(shared) for p in prompts)
    answers = [str(task.dataset[i]["answer"]) for i in range(3)]
    scores = task.score([f" {answers[0]}\nQuestion: more", f" {answers[1]} and more", ""])
    assert scores == {"exact-match": {"accuracy": 1 / 3, "stderr": pytest.approx(math.sqrt(2 / 9 / 2)), "n": 3}}
    assert "\n" in task.stop and task.label.startswith("chain_sum(")


def _row(prompt: int, tokens: list[int], logprobs: list[float], cached: int = 0) -> dict:
    return {"prompt": prompt, "token_ids": tokens, "logprobs": logprobs, "cached_tokens": cached, "prompt_tokens": 64}


def test_report_compares_each_path_with_recompute_and_the_control() -> None:
    paths = [ReusePath(RECOMPUTE, phase="cold"), ReusePath(CONTROL, prefix_caching=True, phase="floor"),
             ReusePath("KVLab whole-step", "kvlab", damages=("zeroed",))]
    recompute = [_row(0, [1, 2, 3], [-0.1, -0.2, -0.3]), _row(1, [7, 8], [-1.0, -2.0])]
    control = [_row(0, [1, 2, 3], [-0.1, -0.2, -0.35], 32), _row(1, [7, 8], [-1.0, -2.0], 32)]
    kvlab = [_row(0, [1, 2, 4], [-0.1, -0.2, -0.9], 32), _row(1, [7, 8], [-1.0, -2.0], 32)]
    zeroed = [_row(0, [1], [-5.0], 32), _row(1, [7, 8], [-3.0, -4.0], 32)]
    results = {RECOMPUTE: {"phases": {"cold": recompute}}, CONTROL: {"phases": {"floor": control}},
               "KVLab whole-step": {"phases": {"warm": kvlab, "warm-zeroed": zeroed}}}
    report = AccuracyReport(AccuracyCheck("unused", task=GSMTask(size=1)), paths, results, task_size=1)
    generations = {row["path"]: row for row in report.generations()}
    assert generations["KVLab whole-step"]["identical"] == 0
    assert generations["KVLab whole-step"]["first_divergence"] == [2]
    # logprobs compared only before the divergence: position 2 scored different tokens
    assert generations["KVLab whole-step"]["max_logprob_diff"] == 0.0
    assert generations[CONTROL]["max_logprob_diff"] == pytest.approx(0.05)
    perplexity = {row["path"]: row for row in report.perplexity()}
    assert perplexity["KVLab whole-step"]["perplexity"] == pytest.approx(math.exp(1.5))
    assert perplexity["KVLab whole-step"]["max_logprob_diff_vs_control"] == 0.0
    assert perplexity["KVLab whole-step"]["perplexity_zeroed_kv"] == pytest.approx(math.exp(3.5))
    assert perplexity[RECOMPUTE]["perplexity_zeroed_kv"] is None
    judged = {row["path"]: row["no_worse_than_control"] for row in against_control(report.generations())}
    assert judged == {RECOMPUTE: True, CONTROL: True, "KVLab whole-step": False}  # it lost an identical output
    mixed = [{**row, "identical": float("nan")} for row in report.perplexity()]  # as a table of all rows reads back
    assert all(row["no_worse_than_control"] for row in against_control(mixed))
    with pytest.raises(ValueError, match="no 'vLLM prefix-cache hit' row"):
        against_control(report.generations()[2:])
    assert repr(report) == ("AccuracyReport(unused, float32, 3 paths, 1 problems; generations identical to recompute: "
                            "recompute 1/1, vLLM prefix-cache hit 1/1, KVLab whole-step 0/1)")


def test_reuse_paths_and_bad_path_lists() -> None:
    names = [p.name for p in reuse_paths()]
    assert names[:2] == [RECOMPUTE, CONTROL] and "LMCache" not in names
    assert "LMCache" in [p.name for p in reuse_paths(lmcache=True)]
    short = [p.name for p in reuse_paths(lmcache=True, layerwise=False, example=False)]
    assert short == [RECOMPUTE, CONTROL, "KVLab whole-step", "LMCache"]
    assert ReusePath("x", "kvlab", damages=("zeroed",)).phases == ("cold", "warm", "warm-zeroed")
    with pytest.raises(ValueError, match="first two paths"):
        AccuracyCheck("unused", paths=[ReusePath("KVLab", "kvlab")]).run()


def test_bad_requests_are_refused_before_an_engine_starts(tmp_path) -> None:
    from kvlab.experiments.ttft import connector_comparison, run_any_engine
    from kvlab.harness.engine import EngineSpec, run_engine

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    spec = EngineSpec(str(model), max_model_len=256, max_tokens=16)
    with pytest.raises(ValueError, match="at least one non-empty prompt"):
        run_engine(spec, [])
    with pytest.raises(ValueError, match="at least one non-empty prompt"):
        connector_comparison(str(model), [], tmp_path)
    with pytest.raises(ValueError, match="does not fit in max_model_len=256"):
        run_engine(spec, [list(range(250))])
    with pytest.raises(ValueError, match="one entry per prompt"):
        run_engine(spec, [[1, 2]], forced=[[3], [4]])
    with pytest.raises(ValueError, match="LMCacheServer"):
        run_any_engine(EngineSpec(str(model), connector="lmcache"), [[1, 2]])
    with pytest.raises(FileNotFoundError, match="no model folder"):
        AccuracyCheck(str(tmp_path / "missing"), paths=reuse_paths()[:2]).run()


def test_batch_invariance_a_build_cannot_run_is_a_plain_reason_without_an_engine(monkeypatch) -> None:
    """Checked before measuring: a row says why in words, never an exception's text."""
    pytest.importorskip("vllm")
    from kvlab.experiments import engine_checks

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was started for a mode this build cannot run")

    monkeypatch.setattr(engine_checks, "run_engine", no_engine)
    monkeypatch.setattr("vllm.triton_utils.HAS_TRITON", False)
    row = engine_checks.batch_invariance("m", [[1, 2, 3]])
    assert row["available"] is False and row["reason"].startswith("this vLLM build has no Triton backend here")


def test_an_engine_that_fails_fails_the_run_instead_of_becoming_a_row(monkeypatch) -> None:
    pytest.importorskip("vllm")
    from kvlab.experiments import architectures, engine_checks

    def broken(*args, **kwargs):
        raise RuntimeError("engine kvlab on m failed (exit 1):\nTypeError: 'function' object is not subscriptable")

    monkeypatch.setattr(engine_checks, "batch_invariance_unavailable", lambda: None)
    monkeypatch.setattr(engine_checks, "run_engine", broken)
    with pytest.raises(RuntimeError, match="not subscriptable"):
        engine_checks.batch_invariance("m", [[1, 2, 3]])
    monkeypatch.setattr(architectures, "run_any_engine", broken)
    with pytest.raises(RuntimeError, match="not subscriptable"):
        architectures.architecture_rows(("smollm2-135m-instruct-fp32",), paths=("whole-step",))
