"""What RL trainers do to a running engine, through the installed vLLM's own code (0.33's in
`make conformance`): sleep mode with saves still in flight, and weight-transfer sessions, after
which no KV of the old weights may be served."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from kvlab.cache import ModelGeometry  # noqa: E402
from kvlab.connector.weights import forget_epoch  # noqa: E402
from kvlab.harness.driver import connector_pair, prefill, register, schedule, step, vllm_request  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_stores")

GEOMETRY = ModelGeometry("tiny", 2, 2, 16, torch.float32, 16)
PROMPT = list(range(4 * GEOMETRY.block_size + 3))  # 4 full blocks


def engine(extra: dict | None = None):
    scheduler, worker = connector_pair(GEOMETRY, 16, extra)
    register(worker, "vllm>=0.29 LBHNC", GEOMETRY, 16)
    for tensor in worker.cache.storage:
        tensor.view(torch.int32).random_()
    return scheduler, worker


def blocks(worker, block_ids: list[int]) -> list[torch.Tensor]:
    return [view[block_ids].view(torch.int32).clone() for view in worker.cache.layers.values()]  # bits: random ones hold NaNs


def test_sleep_waits_for_saves_in_flight_and_wake_up_serves_them_bitwise(held_saves) -> None:
    """``unregister_kv_caches`` (before ``Worker.sleep`` suspends the KV memory) returns only
    once the queued saves have read it; while asleep a step that moves KV is refused; after
    ``restore_kv_caches`` the stored prefix loads back bit for bit into other blocks."""
    scheduler, worker = engine()
    release = held_saves(worker.worker)
    request = vllm_request("a", PROMPT)
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, None, 0)
    step(scheduler, worker, schedule("a", PROMPT, [0, 1, 2, 3, 4], 0))
    assert worker.stats.saved_blocks == 0, "the save is still in flight"
    expected = blocks(worker, [0, 1, 2, 3])
    threading.Timer(0.2, release.set).start()  # the save goes on while sleep waits for it
    worker.unregister_kv_caches()
    assert worker.stats.saved_blocks == 4, "sleep waited for the save to read the KV"
    worker.unregister_kv_caches()  # idempotent
    for tensor in worker.cache.storage:  # what sleep does to the KV memory's contents
        tensor.zero_()
    scheduler.request_finished(request, [0, 1, 2, 3, 4])
    with pytest.raises(RuntimeError, match="while the KV cache sleeps"):
        prefill(scheduler, worker, "b", PROMPT, [5, 6, 7, 8, 9])
    worker.restore_kv_caches()
    worker.restore_kv_caches()  # idempotent
    assert prefill(scheduler, worker, "c", PROMPT, [10, 11, 12, 13, 14])["hit_tokens"] == 4 * GEOMETRY.block_size
    assert all(torch.equal(a, b) for a, b in zip(expected, blocks(worker, [10, 11, 12, 13])))


class FakeTransfer:
    """A weight-transfer engine that takes the chunks it is given (vLLM's real ones move them
    over NCCL or IPC: GPU only); the session around it is vLLM's own Worker code."""

    supports_draft_weight_update = False

    def __init__(self) -> None:
        self.calls: list[str] = []

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, update_info: dict) -> None:
        self.calls.append("update")

    def finish_weight_update(self) -> None:
        self.calls.append("finish")

    def reset_weight_update_target(self) -> None:
        self.calls.append("reset")


def vllm_worker(scheduler) -> tuple[object, FakeTransfer]:
    """The installed vLLM's Worker (its weight-transfer session methods), around this engine's config."""
    from vllm.v1.worker.gpu_worker import Worker

    worker = Worker.__new__(Worker)  # no device to initialise: only the session's bookkeeping runs
    transfer = FakeTransfer()
    worker.vllm_config, worker.weight_transfer_engine, worker.rank = scheduler._vllm_config, transfer, 0
    worker._weight_update_active = worker._weight_update_is_draft = False
    worker.model_runner = SimpleNamespace(reset_lora_state=lambda: None)
    return worker, transfer


def test_a_weight_transfer_session_never_meets_old_kv() -> None:
    """``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` bypass the model
    runner's ``reload_weights``: still, every prefix stored before the session, and every
    prefix a request stored while the weights were half loaded, misses after it."""
    scheduler, worker = engine()
    assert prefill(scheduler, worker, "a", PROMPT, [0, 1, 2, 3, 4])["hit_tokens"] == 0
    assert prefill(scheduler, worker, "b", PROMPT, [5, 6, 7, 8, 9])["hit_tokens"] == 4 * GEOMETRY.block_size
    vllm, transfer = vllm_worker(scheduler)
    try:
        vllm.start_weight_update()
        assert prefill(scheduler, worker, "c", PROMPT, [0, 1, 2, 3, 4])["hit_tokens"] == 0, "half-loaded weights"
        vllm.update_weights({"names": ["w"]})
        vllm.finish_weight_update()
        assert transfer.calls == ["start", "update", "finish", "reset"], "vLLM's session ran"
        assert prefill(scheduler, worker, "d", PROMPT, [5, 6, 7, 8, 9])["hit_tokens"] == 0, "new weights"
        assert prefill(scheduler, worker, "e", PROMPT, [0, 1, 2, 3, 4])["hit_tokens"] == 4 * GEOMETRY.block_size
    finally:
        forget_epoch(scheduler._vllm_config.kv_transfer_config.engine_id)
