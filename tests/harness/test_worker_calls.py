"""What an engine sends its workers (kvlab.harness.worker_calls): the clock times each
connector call once however often it is started and gives the class back untouched, and the
damage control damages the connector's memory chunks and puts them back."""

from __future__ import annotations

import textwrap

import pytest
import torch

pytest.importorskip("vllm")

from kvlab.cache import ModelGeometry  # noqa: E402
from kvlab.harness import worker_calls  # noqa: E402
from kvlab.harness.driver import connector_pair, prefill, register  # noqa: E402

SLOW = textwrap.dedent('''
    class SlowConnector:
        calls = []

        def __init__(self, vllm_config, role, kv_cache_config=None):
            pass

        def start_load_kv(self, context):
            self.calls.append("load")

        def wait_for_layer_load(self, name):
            pass

        def save_kv_layer(self, name, kv, meta):
            pass

        def wait_for_save(self):
            self.calls.append("save")
''')


class Ticks:
    """A perf_counter that moves one second per reading: a call timed once takes exactly 1 s."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


@pytest.fixture
def slow_connector(tmp_path, monkeypatch):
    (tmp_path / "slow_connector.py").write_text(SLOW)
    monkeypatch.syspath_prepend(str(tmp_path))
    import slow_connector

    transfer = {"kv_connector": "SlowConnector", "kv_connector_module_path": "slow_connector", "kv_role": "kv_both"}
    yield slow_connector.SlowConnector, transfer
    worker_calls._CLOCK.uninstall()


def test_the_clock_times_each_call_once_however_often_it_is_started(slow_connector, monkeypatch) -> None:
    cls, transfer = slow_connector
    original = cls.__dict__["start_load_kv"]
    monkeypatch.setattr(worker_calls, "time", Ticks())
    worker_calls.start_clock(None, transfer)
    worker_calls.start_clock(None, transfer)  # an engine that starts it again
    connector = cls(None, None)
    connector.start_load_kv(None)
    connector.wait_for_save()
    spent = worker_calls.read_clock(None)
    assert spent == {"load_s": 1.0, "save_s": 1.0}, "each call timed once (wrapped twice: 4 s each)"
    assert worker_calls.read_clock(None) == {"load_s": 0.0, "save_s": 0.0}, "a read starts the next count"
    worker_calls._CLOCK.uninstall()
    assert cls.__dict__["start_load_kv"] is original, "the class has its own method back"
    connector.start_load_kv(None)
    assert worker_calls.read_clock(None)["load_s"] == 0.0 and cls.calls == ["load", "save", "load"]


def test_damage_control_damages_the_memory_chunks_and_undo_puts_them_back(fresh_stores) -> None:
    geometry = ModelGeometry("tiny", 2, 2, 16, torch.float32, 16)
    scheduler, worker = connector_pair(geometry, 8)
    register(worker, "vllm>=0.29 LBNHC", geometry, 8)
    prefill(scheduler, worker, "a", list(range(48)), [0, 1, 2])
    chunks = worker.store.memory_chunks()
    assert chunks, "the prefill stored chunks in memory"
    before = [[t.clone() for t in chunk.buffer.storage] for chunk in chunks]
    worker_calls.damage_memory(None, "zeroed")
    assert all(not t.any() for chunk in chunks for t in chunk.buffer.storage)
    worker_calls.undo_damage(None)
    assert all(torch.equal(t, saved) for chunk, kept in zip(chunks, before)
               for t, saved in zip(chunk.buffer.storage, kept))
    with pytest.raises(ValueError, match="unknown damage"):
        worker_calls.damage_memory(None, "sunburn")
