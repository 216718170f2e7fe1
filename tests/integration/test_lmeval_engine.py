"""lm-eval's vLLM backend with KVLabConnector, for real: a small CPU run scores the same
with and without the connector while the connector serves the shared few-shot prefix."""

from __future__ import annotations

import pytest

pytest.importorskip("lm_eval")


from kvlab.experiments.lmeval import compare_connectors, write_gym_task, write_task  # noqa: E402
from kvlab.experiments.tasks import DISCRIMINATING  # noqa: E402

# starts engines or servers; one of the extended engine suite (`make test-extended`, CI runs it)
pytestmark = [pytest.mark.slow, pytest.mark.extended]


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def test_connector_changes_no_score_and_serves_the_few_shot_prefix(smollm2, tmp_path, offline) -> None:
    folder = write_task(tmp_path / "task", size=4, train_size=2)
    rows = compare_connectors(smollm2, folder, ("none", "kvlab"), limit=2, num_fewshot=2, max_gen_toks=8)
    scores = {c: [(r["filter"], r["metric"], r["value"], r["n"]) for r in rows if r["connector"] == c]
              for c in ("none", "kvlab")}
    assert scores["none"] == scores["kvlab"] and {r[0] for r in scores["none"]} == {"strict-match", "flexible-extract"}
    kvlab = [r for r in rows if r["connector"] == "kvlab"]
    assert all(r["identical_generations"] == r["problems"] == 2 for r in kvlab)  # fp32: the same generations
    assert all(r["hit_tokens"] > 0 for r in kvlab)


def test_a_task_the_model_solves_scores_the_same_with_the_connector(smollm2, tmp_path, offline) -> None:
    """A score above zero (gsm8k-style problems score 0 for a 135M model, so equal scores
    there prove little): sums of two digits, 5 shots, the same score and generations."""
    folder = write_gym_task(tmp_path / "task", DISCRIMINATING.resized(24), train_size=5)
    rows = compare_connectors(smollm2, folder, ("none", "kvlab"), task="chain_sum_kvlab", limit=24, num_fewshot=5,
                              max_gen_toks=8)
    none, kvlab = ([r for r in rows if r["connector"] == c] for c in ("none", "kvlab"))
    assert none[0]["value"] > 0.2 and none[0]["n"] == 24, none
    assert [(r["filter"], r["value"]) for r in none] == [(r["filter"], r["value"]) for r in kvlab]
    assert all(r["identical_generations"] == r["problems"] == 24 and r["hit_tokens"] > 0 for r in kvlab)
