"""The load test's parts that need no server (kvlab.experiments.load_test): its prompts, the
fault injector, the same-split control plan and the summary. The run itself:
``python -m kvlab loadtest`` (docs/reliability.md gives its figures)."""

from __future__ import annotations

import threading

import pytest

from kvlab.experiments.load_test import BLOCK, LoadTest, control_plan, summarize_load


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
             "control_cached_tokens": 64},
            {"request": 1, "cached_tokens": 0, "failed": None, "identical": False, "gap": 0.5, "first_difference": 2,
             "control_cached_tokens": 0},
            {"request": 2, "failed": "HTTPError"}]
    summary = summarize_load(rows)
    assert summary["failed"] == 1 and summary["identical"] == 1 and summary["within_drift"] == 1
    assert summary["differing_tokens"] == 1 and summary["max_gap"] == 0.5 and summary["control_split_matched"] == 2


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
