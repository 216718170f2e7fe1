"""The load test's parts that need no engine (kvlab.experiments.load_test): its prompts, its
settings, the fault injector, the remote tier's kill, the same-split control plan and the
summary. The run itself: ``python -m kvlab loadtest`` (docs/reliability.md gives its figures)."""

from __future__ import annotations

import threading

import pytest

from kvlab.cli import main
from kvlab.connector.config import ConnectorConfig
from kvlab.experiments.load_test import (BLOCK, REMOTE_KILL, KillOnce, LoadTest, around_the_kill, control_plan,
                                         summarize_load)
from kvlab.runtime.configs import kv_transfer_config
from kvlab.runtime.mooncake import MooncakeStore
from kvlab.runtime.redis import RedisServer


@pytest.fixture
def model(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    return str(tmp_path / "model")


def test_prompts_share_prefixes_and_are_reproducible(model, tmp_path) -> None:
    test = LoadTest(model, tmp_path, requests=64)
    ids = list(range(10_000))
    prompts = test.prompts(ids)
    assert prompts == LoadTest(model, tmp_path, requests=64).prompts(ids)
    shared = sum(p[:450] == ids[450 * (p[0] // 450): 450 * (p[0] // 450) + 450] for p in prompts if p[0] < 3600)
    assert len(prompts) == 64 and shared >= 32
    with pytest.raises(ValueError, match="8000 token ids"):
        test.prompts(ids[:100])


def test_bad_plans_are_refused(model, tmp_path) -> None:
    with pytest.raises(ValueError, match="clients"):
        LoadTest(model, tmp_path, clients=0)
    with pytest.raises(ValueError, match="fault_interval_s"):
        LoadTest(model, tmp_path, fault_interval_s=0)
    with pytest.raises(ValueError, match="tier_bytes"):
        LoadTest(model, tmp_path, tier_bytes=-1)
    with pytest.raises(ValueError, match="connector"):
        LoadTest(model, tmp_path, connector="lmcache")
    with pytest.raises(FileNotFoundError):
        LoadTest(str(tmp_path / "nothing"), tmp_path)
    with pytest.raises(ValueError, match="mode must be one of .'whole-step', 'layerwise', 'hooks'., got 'fast'"):
        LoadTest(model, tmp_path, mode="fast")
    with pytest.raises(ValueError, match="cross_layer must be True or False"):
        LoadTest(model, tmp_path, cross_layer="yes")
    with pytest.raises(ValueError, match="remote must be one of .'redis', 'mooncake'. or None, got 'memcached'"):
        LoadTest(model, tmp_path, remote="memcached")
    for setting in ({"mode": "hooks"}, {"cross_layer": True}, {"remote": "redis"}):
        with pytest.raises(ValueError, match="connector 'none' is vLLM's own prefix cache"):
            LoadTest(model, tmp_path, connector="none", **setting)


def test_the_command_refuses_the_load_tests_settings_for_other_measurements(capsys) -> None:
    assert main(["loadtest", "--measure", "integrity", "--cross-layer"]) == 2
    assert "--mode, --cross-layer and --remote set up the load test (--measure serve), not --measure integrity" \
        in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["loadtest", "--remote", "memcached"])
    assert "invalid choice: 'memcached'" in capsys.readouterr().err


def test_the_connector_runs_in_its_mode_on_a_cross_layer_cache_with_the_remote_tier_last(model, tmp_path) -> None:
    folders = {"shm": tmp_path / "shm", "disk": tmp_path / "disk"}
    plain = LoadTest(model, tmp_path).connector_extra(folders)
    assert plain["tiers"] == ["memory", "shm", "disk"] and "layerwise" not in plain
    assert "enable_cross_layers_blocks" not in plain
    test = LoadTest(model, tmp_path, mode="hooks", cross_layer=True, remote="redis", tier_bytes=32 << 20)
    with test.remote_store(tmp_path) as redis:
        assert isinstance(redis, RedisServer) and redis.maxmemory_mb == 128
        extra = test.connector_extra(folders, redis)
        config = ConnectorConfig.parse(extra)  # what the engine will be given, checked as it will check it
    assert config.tier_names == ("memory", "shm", "disk", "redis") and config.tier_settings["redis"].url == redis.url
    assert config.layerwise and config.hooks and config.enable_cross_layers_blocks
    assert kv_transfer_config("kvlab", extra)["kv_load_failure_policy"] == "recompute", "a failed load recomputes"
    assert LoadTest(model, tmp_path, connector="none").connector_extra(folders) == {}
    assert isinstance(LoadTest(model, tmp_path, remote="mooncake").remote_store(tmp_path), MooncakeStore)


def test_the_remote_kill_is_planned_half_way_for_each_remote_tier(model, tmp_path) -> None:
    redis, mooncake = RedisServer(), MooncakeStore()
    assert LoadTest(model, tmp_path).faults == {"shm-vanish": 0, "disk-damage": 0, "disk-vanish": 0}
    test = LoadTest(model, tmp_path, requests=241, remote="redis")
    assert test.faults[REMOTE_KILL] == 0
    assert test.remote_kill(redis).at == 120 and test.remote_kill(redis).kill == redis.kill
    killer = LoadTest(model, tmp_path, requests=1, remote="mooncake").remote_kill(mooncake)
    assert killer.at == 1 and killer.kill == mooncake.kill_master


def test_the_remote_tiers_server_is_killed_once_by_the_answer_half_way(tmp_path) -> None:
    import redis

    kills = []
    with RedisServer(log_path=tmp_path / "redis.log", maxmemory_mb=16) as server:
        client = server.client()

        def kill() -> None:
            kills.append(server.process.pid)
            server.kill()

        killer = KillOnce(kill, at=5)
        for now in range(4):
            killer.answer(float(now))
        assert client.ping() and kills == [] and killer.killed_at_s is None
        killer.answer(4.5)
        assert killer.killed_at_s == 4.5 and len(kills) == 1 and server.process.poll() is not None
        with pytest.raises(redis.ConnectionError):
            client.ping()
        answering = [threading.Thread(target=killer.answer, args=(5.0 + i,)) for i in range(16)]
        for thread in answering:
            thread.start()
        for thread in answering:
            thread.join()
    assert len(kills) == 1 and killer.answered == 21 and killer.killed_at_s == 4.5


def test_the_injector_removes_and_damages_chunk_files(model, tmp_path) -> None:
    folders = {"shm": tmp_path / "shm", "disk": tmp_path / "disk"}
    for folder in folders.values():
        folder.mkdir()
        for i in range(4):
            (folder / f"{i:032x}.kvchunk").write_bytes(bytes(4096))
    test = LoadTest(model, tmp_path, fault_interval_s=0.01)
    stop = threading.Event()
    thread = threading.Thread(target=test.inject, args=(folders, stop))
    thread.start()
    while test.faults["disk-damage"] < 1 or test.faults["shm-vanish"] < 1:
        stop.wait(0.01)
    stop.set()
    thread.join()
    assert test.faults["shm-vanish"] >= 1 and test.faults["disk-damage"] >= 1
    disk = list(folders["disk"].iterdir())
    assert len(list(folders["shm"].iterdir())) < 4, "shared-memory files vanished"
    assert len(disk) < 4 or any(p.read_bytes() != bytes(4096) for p in disk), "a disk file was damaged"


def test_the_control_hits_exactly_what_each_response_reports_cached() -> None:
    prompts = [list(range(100)), list(range(1000, 1070))]
    rows = [{"request": 0, "cached_tokens": 64, "failed": None}, {"request": 1, "cached_tokens": 0, "failed": None},
            {"request": 0, "cached_tokens": 64, "failed": None}, {"request": 0, "cached_tokens": 0, "failed": "x"}]
    requests, salts, where = control_plan(rows, prompts)
    assert requests == [prompts[0][:65], prompts[0], prompts[1]] and salts[0] == salts[1] != salts[2]
    assert where == {(0, 64): 1, (1, 0): 2}
    with pytest.raises(ValueError, match="whole blocks"):
        control_plan([{"request": 0, "cached_tokens": BLOCK + 1, "failed": None}], prompts)


def test_the_summary_counts_failures_and_differences() -> None:
    rows = [{"request": 0, "cached_tokens": 64, "failed": None, "identical": True, "gap": 0.0, "first_difference": None,
             "control_cached_tokens": 64, "sent_s": 0.0, "answered_s": 1.5},
            {"request": 1, "cached_tokens": 0, "failed": None, "identical": False, "gap": 0.5, "first_difference": 2,
             "control_cached_tokens": 0, "sent_s": 1.0, "answered_s": 2.0},
            {"request": 2, "failed": "HTTPError", "sent_s": 1.0, "answered_s": 4.0}]
    summary = summarize_load(rows)
    assert summary["failed"] == 1 and summary["identical"] == 1 and summary["within_drift"] == 1
    assert summary["differing_tokens"] == 1 and summary["max_gap"] == 0.5 and summary["control_split_matched"] == 2
    assert summary["longest_request_s"] == 3.0, "a failed request's wait counts too"


def test_around_the_kill_sorts_requests_by_when_they_were_answered_and_sent() -> None:
    def row(request: int, sent_s: float, answered_s: float, cached: int) -> dict:
        return {"request": request, "cached_tokens": cached, "failed": None, "sent_s": sent_s, "answered_s": answered_s}

    rows = [row(0, 0.0, 1.0, 64), row(1, 0.5, 2.0, 0), row(2, 1.5, 3.5, 32),  # answered by the kill at 2.0, or across
            row(3, 2.5, 3.0, 0), row(4, 2.1, 6.1, 96)]  # sent after it
    around = around_the_kill(rows, killed_at_s=2.0)
    before, after = around["before_kill"], around["after_kill"]
    assert (before["requests_sent"], before["hits"], before["cached_tokens"]) == (2, 1, 64)
    assert (after["requests_sent"], after["hits"], after["cached_tokens"]) == (2, 1, 96)
    assert before["longest_request_s"] == 1.5 and after["longest_request_s"] == pytest.approx(4.0)


def test_the_integrity_costs_measure_both_checks_and_the_copy_beside_them() -> None:
    from kvlab.experiments.load_test import integrity_costs
    from kvlab.transfer.methods.memcpy import native_library

    costs = integrity_costs(nbytes=1 << 20, repeats=3)
    assert costs["crc32c_best_gb_s"] > 0 and costs["hmac_sha256_best_gb_s"] > 0
    assert costs.get("stream_copy_best_gb_s", 0) > 0 or isinstance(native_library(), str)
    assert costs["crc32c_best_s"] <= costs["crc32c_median_s"]
    with pytest.raises(ValueError, match="positive"):
        integrity_costs(nbytes=0)


def test_the_memory_measurement_needs_enough_text(model) -> None:
    from kvlab.experiments.load_test import worker_memory

    with pytest.raises(ValueError, match="token ids for 400 prompts"):
        worker_memory(model, list(range(100)))
