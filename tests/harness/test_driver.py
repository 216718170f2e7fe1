"""The stand-in engine (kvlab.harness.driver) behaves as vLLM's does where a test relies on
it: each tensor-parallel rank has tiers of its own, and a lookup that keeps waiting for
saves ends in an error, not a hang."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from kvlab.cache import ModelGeometry  # noqa: E402
from kvlab.harness import driver  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_stores")

GEOMETRY = ModelGeometry("tiny", 2, 2, 16, torch.float32, 16)


def test_each_rank_has_its_own_memory_tier() -> None:
    _, workers = driver.connector_group(GEOMETRY, 8, workers=2)
    assert [(w.worker.rank, w.worker.workers) for w in workers] == [(0, 2), (1, 2)]
    assert workers[0].store is not workers[1].store
    _, (alone,) = driver.connector_group(GEOMETRY, 8)
    assert (alone.worker.rank, alone.worker.workers) == (0, 1)


def test_a_rank_is_taken_before_the_cache_and_within_the_group() -> None:
    _, worker = driver.connector_pair(GEOMETRY, 8)
    with pytest.raises(ValueError, match="rank 2 is not one of 2 workers"):
        worker.act_as_rank(2, 2)
    driver.register(worker, "vllm>=0.29 LBNHC", GEOMETRY, 8)
    with pytest.raises(RuntimeError, match="before its cache is registered"):
        worker.act_as_rank(0, 2)


def test_a_lookup_that_never_settles_is_an_error(monkeypatch) -> None:
    scheduler, worker = driver.connector_pair(GEOMETRY, 8)
    driver.register(worker, "vllm>=0.29 LBNHC", GEOMETRY, 8)
    monkeypatch.setattr(scheduler, "get_num_new_matched_tokens", lambda request, computed: (None, False))
    monkeypatch.setattr(driver, "MAX_LOOKUP_STEPS", 3)
    with pytest.raises(RuntimeError, match="still waited on pending saves after 3 empty steps"):
        driver.prefill(scheduler, worker, "a", list(range(32)), [0, 1])
