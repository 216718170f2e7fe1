"""The worker's failure rules (kvlab.connector.failures), transition by transition: never
save over a failed load, until the scheduler has planned the request again. Through the
connector and real tiers: test_never_wrong.py."""

from __future__ import annotations

from kvlab.connector.failures import FailureRules
from kvlab.connector.messages import SaveSpec


def save(req_id: str, block_ids: list[int], memory: bool = True) -> SaveSpec:
    return SaveSpec(req_id, tuple(f"{req_id}-{b}" for b in block_ids), block_ids, memory=memory, shared=True)


def test_a_failed_load_is_recomputed_once_and_cancels_its_requests_saves_after_the_forward() -> None:
    rules = FailureRules()
    rules.load_failed("a", [3, 4])
    assert not rules.cancels(save("a", [3, 4])), "saves of the step are planned after the forward"
    rules.forward_done()
    assert rules.cancels(save("a", [3, 4])) and rules.cancels(save("a", [7])) and rules.saves_cancelled("a")
    assert rules.take_load_errors() == {3, 4} and rules.take_load_errors() == set(), "vLLM is told once"
    assert rules.take_reports() == (set(), {"a"}, set()), "the scheduler plans it again"
    assert rules.take_reports() == (set(), set(), set())


def test_a_save_of_another_request_that_touches_a_failed_block_is_cancelled_in_that_step_only() -> None:
    rules = FailureRules()
    rules.load_failed("a", [3])
    rules.forward_done()
    assert rules.cancels(save("b", [2, 3])) and not rules.cancels(save("b", [5])) and not rules.saves_cancelled("b")
    rules.forward_done()  # the next step: block 3 was recomputed
    assert not rules.cancels(save("b", [2, 3])) and rules.cancels(save("a", [5]))


def test_replanned_lets_a_request_save_again() -> None:
    rules = FailureRules()
    rules.load_failed("a", [3])
    rules.forward_done()
    rules.replanned({"a"})
    rules.forward_done()
    assert not rules.cancels(save("a", [5])) and not rules.saves_cancelled("a")


def test_a_request_replanned_whose_load_fails_again_stays_cancelled() -> None:
    rules = FailureRules()
    rules.load_failed("a", [3])
    rules.forward_done()
    rules.load_failed("a", [6])
    rules.replanned({"a"})
    rules.forward_done()
    assert rules.cancels(save("a", [7]))


def test_a_cancelled_save_gives_its_memory_chunk_back() -> None:
    rules = FailureRules()
    rules.save_cancelled(save("a", [1, 2]))
    rules.save_cancelled(save("b", [1, 2], memory=False))  # no memory chunk was reserved for it
    assert rules.take_reports() == ({"a-2"}, set(), set())


def test_a_failed_chunk_and_a_missed_tier_are_reported_once() -> None:
    rules = FailureRules()
    rules.chunk_failed("c1")
    rules.tier_missed("shm", "c2")
    rules.tier_missed("shm", "c2")
    assert rules.take_reports() == ({"c1"}, set(), {("shm", "c2")})
    assert rules.take_reports() == (set(), set(), set())


def test_a_finished_request_is_forgotten() -> None:
    rules = FailureRules()
    rules.load_failed("a", [3])
    rules.forward_done()
    rules.finished({"a"})
    assert not rules.saves_cancelled("a")
