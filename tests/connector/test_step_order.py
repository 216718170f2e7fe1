"""The machinery diagrams' data (kvlab.connector.step_order): one step per mode, the copies of
what a step does, and vLLM's rule for where start_load_kv goes. The data itself is checked
against a real engine step in tests/integration/test_backend_engine.py."""

import pytest

from kvlab.connector.step_order import MODES, PREFIX_HIT_PATH, STEP_ORDER, step_calls


def test_every_mode_has_the_same_scheduler_calls_and_one_forward():
    for mode in MODES:
        calls = STEP_ORDER[mode]
        assert [c.name for c in calls if c.side == "scheduler"] == [
            "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "update_connector_output"]
        layers = [i for i, c in enumerate(calls) if c.per_layer]
        assert layers == list(range(layers[0], layers[-1] + 1)), "the per-layer calls run together, in the forward"


def test_a_step_without_a_load_calls_start_load_kv_after_the_forward():
    names = [c.name for c in step_calls("hooks", loads=False)]
    assert names.index("start_load_kv") == max(i for i, c in enumerate(step_calls("hooks", loads=False)) if c.per_layer) + 1
    assert [c.name for c in step_calls("hooks")][4] == "start_load_kv", "a step that loads: before the forward"


def test_a_step_keeps_only_the_copies_of_what_it_does():
    saves = step_calls("whole-step", loads=False, saves=True)
    assert {c.name: (c.copies, c.queues) for c in saves if c.copies or c.queues} == {"wait_for_save": ((), ("save",))}
    loads = step_calls("layerwise", loads=True, saves=False)
    assert {c.name: (c.copies, c.queues) for c in loads if c.copies or c.queues} == {"start_load_kv": ((), ("load",))}


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match=r"unknown mode 'async'; choose from \['whole-step', 'layerwise', 'hooks'\]"):
        step_calls("async")


def test_a_prefix_hit_follows_the_order_of_a_whole_step_step():
    order = [c.name for c in STEP_ORDER["whole-step"]]
    hops = [hop.call for hop in PREFIX_HIT_PATH]
    assert [order.index(call) for call in hops] == sorted(order.index(call) for call in hops)
