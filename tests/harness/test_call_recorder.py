"""The call recorder (kvlab.harness.call_recorder) names every KVLabConnector call of a step in
order, with the copies each made before it returned and those it handed to a thread of the
connector's (the context it runs in follows the copy there), and gives the class and the copy
methods back untouched. Driven here without an engine (kvlab.harness.driver); in a real engine
step: tests/integration/test_backend_engine.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from kvlab.cache import ModelGeometry  # noqa: E402
from kvlab.connector import KVLabConnector, reset_stores  # noqa: E402
from kvlab.connector.step_order import STEP_CALL_NAMES, StepCall  # noqa: E402
from kvlab.harness.call_recorder import CallRecorder, forward_steps, recorded_calls  # noqa: E402
from kvlab.harness.driver import connector_pair, prefill, register  # noqa: E402
from kvlab.transfer.registry import ALL_METHODS, get_method  # noqa: E402

GEOMETRY = ModelGeometry("recorder-test", 3, 2, 16, torch.float32, 16)


def _run(layerwise: bool) -> list[dict]:
    reset_stores()
    extra = {"chunk_size": 32, "layerwise": layerwise}
    scheduler, worker = connector_pair(GEOMETRY, 16, extra)
    register(worker, "vllm>=0.29 LBHNC", GEOMETRY, 16)
    recorder = CallRecorder(STEP_CALL_NAMES)
    recorder.install()
    try:
        prompt = list(range(3 * GEOMETRY.block_size + 1))
        prefill(scheduler, worker, "cold", prompt, [0, 2, 4, 6], layerwise=layerwise)
        worker.worker.flush()
        prefill(scheduler, worker, "hit", prompt, [8, 10, 12, 14], layerwise=layerwise)
        worker.worker.flush()
        return recorder.read()
    finally:
        recorder.uninstall()


def _copies(calls: list[StepCall]) -> dict[str, tuple]:
    return {c.name: (c.copies, c.queues) for c in calls if c.copies or c.queues}


def test_whole_step_copies_a_hit_in_start_load_kv_and_queues_its_saves():
    events = _run(layerwise=False)
    assert {e["side"] for e in events if "call" in e} == {"scheduler", "worker"}
    calls = [e["call"] for e in events if "call" in e]
    first = calls.index("build_connector_meta")
    assert calls[first - 2:first + 3] == ["get_num_new_matched_tokens", "update_state_after_alloc",
                                           "build_connector_meta", "bind_connector_metadata", "start_load_kv"]
    origins = {e["index"]: e["call"] for e in events if "call" in e}
    made = {(e["copy"], origins.get(e["origin"])) for e in events if "copy" in e}
    assert made == {("save", "wait_for_save"), ("load", "start_load_kv")}


def test_layerwise_copies_go_to_threads_and_name_the_call_that_queued_them():
    events = _run(layerwise=True)
    steps = forward_steps(events)
    assert len(steps) == 2, "the cold prefill and the hit: the steps that ran the layers"
    cold, hit = (recorded_calls(step) for step in steps)
    assert _copies(cold) == {"save_kv_layer": ((), ("save",))}
    assert _copies(hit) == {"start_load_kv": ((), ("load",))}
    assert [c.name for c in hit if c.per_layer] == ["wait_for_layer_load", "save_kv_layer"]


def test_layers_that_differ_are_refused():
    def call(index, name, layer):
        return {"index": index, "call": name, "side": "worker", "layer": layer, "caller": "vllm", "thread": "t"}
    step = [call(0, "wait_for_layer_load", "a"), call(1, "save_kv_layer", "a"), call(2, "wait_for_layer_load", "b")]
    with pytest.raises(ValueError, match="the layers' calls differ"):
        recorded_calls(step)


def test_a_copy_on_the_calls_own_thread_is_made_in_it_and_one_elsewhere_queued():
    step = [{"index": 0, "call": "wait_for_save", "side": "worker", "layer": None, "caller": "vllm", "thread": "main"},
            {"copy": "save", "origin": 0, "thread": "kvlab-save_0"},
            {"index": 1, "call": "start_load_kv", "side": "worker", "layer": None, "caller": "vllm", "thread": "main"},
            {"copy": "load", "origin": 1, "thread": "main"}]
    assert _copies(recorded_calls(step)) == {"wait_for_save": ((), ("save",)), "start_load_kv": (("load",), ())}


def test_uninstall_gives_the_class_and_the_copy_methods_back():
    before = dict(KVLabConnector.__dict__)
    methods = {name: get_method(name) for name in ALL_METHODS}
    recorder = CallRecorder(STEP_CALL_NAMES)
    recorder.install()
    assert KVLabConnector.__dict__["start_load_kv"] is not before["start_load_kv"]
    assert "bind_connector_metadata" in KVLabConnector.__dict__  # the base class's, recorded on the subclass
    recorder.uninstall()
    assert dict(KVLabConnector.__dict__) == before
    assert {name: get_method(name) for name in ALL_METHODS} == methods
