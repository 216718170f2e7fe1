"""lm-eval's vLLM backend with KVLabConnector, for real: a small CPU run scores as vLLM's own
prefix cache does (bitwise: the same prefill split) while the connector serves the shared
few-shot prefix. (That gsm8k's own task definition loads
in lm-eval, its filters and few-shot sampler: tests/experiments/test_lmeval.py, without an engine.)"""

from __future__ import annotations

import pytest

pytest.importorskip("lm_eval")


from kvlab.experiments.lmeval import compare_connectors, write_gym_task  # noqa: E402
from kvlab.experiments.tasks import DISCRIMINATING  # noqa: E402

# starts engines or servers; one of the extended engine suite (`make test-extended`, CI runs it)
pytestmark = [pytest.mark.slow, pytest.mark.extended]


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def test_a_task_the_model_solves_scores_the_same_with_the_connector(smollm2, tmp_path, offline) -> None:
    """A score above zero (gsm8k-style problems score 0 for a 135M model, so equal scores
    there prove little): sums of two digits, 5 shots. KVLab's generations are bitwise vLLM's
    own prefix cache's (the same prefill split), so its scores are the control's. (Against no
    reuse at all, another split, within a standard error: tests/integration/test_engine_accuracy.py,
    and notebook 06 section 4 through lm-eval.)"""
    folder = write_gym_task(tmp_path / "task", DISCRIMINATING.resized(24), train_size=5)
    rows = compare_connectors(smollm2, folder, ("vllm-prefix-cache", "kvlab"), task="chain_sum_kvlab",
                              limit=24, num_fewshot=5, max_gen_toks=8)
    control, kvlab = (scores(rows, c) for c in ("vllm-prefix-cache", "kvlab"))
    assert control[0][1] > 0.2 and control[0][3] == 24, control
    assert [r[:2] for r in control] == [r[:2] for r in kvlab]
    assert all(r["identical_generations"] == r["problems"] == 24 and r["hit_tokens"] > 0
               for r in rows if r["connector"] == "kvlab")


def scores(rows: list[dict], connector: str) -> list[tuple]:
    """(filter, score, stderr, problems) of one connector's run."""
    return [(r["filter"], r["value"], r["stderr"], r["n"]) for r in rows if r["connector"] == connector]
