"""scripts/device-check: its CPU dry run passes end to end (so the script cannot rot on
machines without a GPU), and its summary counts and ranks what it is given."""

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from kvlab.experiments import bench
from kvlab.experiments.device_check import headline, junit_counts, summarize
from kvlab.results import load_results
from kvlab.transfer import METHODS
from kvlab.transfer.registry import method_status

ROOT = Path(__file__).resolve().parents[2]
# the device suite: the transfers, and KVLabConnector's worker side with torch alone
DEVICE_TESTS = ("tests/transfer/test_device.py", "tests/connector/test_worker_device.py")


@pytest.mark.slow
@pytest.mark.extended  # a minute and a half of the GPU suite on the CPU: the extended suite (CI runs it)
def test_dry_run_on_the_cpu(tmp_path):
    """DEVICE=cpu: the device suite runs on the CPU, every method is measured or says why
    not, the layerwise steps run, and the summary says ok."""
    done = subprocess.run([str(ROOT / "scripts" / "device-check")], env={**os.environ, "DEVICE": "cpu", "OUT": str(tmp_path)},
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "device-check-summary.json").read_text())
    assert summary["ok"] and set(summary["steps"]) == {"tests", "bench", "layerwise", "attention"}
    counts = summary["tests"]
    assert counts["failed"] == counts["errors"] == 0
    # every test of the device suite ran: the only skips are the methods that cannot run on
    # this device, each named (skip_unless_runs), so no part of the suite skips unseen
    unavailable = {m for m in METHODS if method_status(m, *_cpu_caches()) is not None}
    skips = [case.find("skipped").get("message", "")
             for case in ElementTree.parse(tmp_path / "device-tests.xml").getroot().iter("testcase")
             if case.find("skipped") is not None]
    assert len(skips) == counts["skipped"] and counts["passed"] + len(skips) == _collected_device_tests()
    assert {skip.split(":")[0].removeprefix("Skipped").strip() for skip in skips} <= unavailable, skips
    assert counts["passed"] >= 0.75 * _collected_device_tests()
    assert summary["fingerprint"]["device"] == "cpu"
    assert any("dma: unavailable" in line for line in summary["rows"]["unavailable"])
    assert {h["direction"] for h in summary["headline"]} == {"offload", "load"}
    assert summary["attention_layerwise"] and len(list(tmp_path.iterdir())) <= 8  # what the device tool brings back


def _cpu_caches():
    from kvlab.cache import allocate, preset
    from kvlab.transfer import host_buffer

    cache = allocate("LBHNC", preset("smollm2-135m").with_(num_layers=2), 4)
    return cache, host_buffer(cache, 2)


def _collected_device_tests() -> int:
    """How many tests the device suite holds on the CPU, as pytest collects them."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "cuda", "-p", "no:cacheprovider",
                           *(str(ROOT / path) for path in DEVICE_TESTS)],
                          env={**os.environ, "KVLAB_DEVICE": "cpu"}, capture_output=True, text=True, timeout=300, cwd=ROOT)
    return len([line for line in done.stdout.splitlines() if "::" in line])


def test_the_script_runs_the_whole_device_suite():
    script = (ROOT / "scripts" / "device-check").read_text()
    assert " ".join(DEVICE_TESTS) in script


def _row(method, layout, direction, ratio, cross=False, **extra):
    return {"record": "row", "status": "ok", "block_ids": "scattered", "target": "host", "model": "m", "tokens": 256,
            "direction": direction, "method": method, "layout": layout, "cross_layer": cross, "ratio": ratio,
            "gbps": 10 * ratio, "ceiling_gbps": 10.0, "segments": 4, **extra}


def test_headline_ranks_per_layer_against_cross_layer():
    rows = [_row("gather", "LBHNC", "load", 0.7), _row("segments", "LHBNC", "load", 0.4),
            _row("gather", "BLHNC", "load", 0.9, cross=True), _row("dma", "BLHNC", "load", 0.95, cross=True),
            _row("gather", "LBHNC", "offload", 0.8), {"status": "unavailable: no", "method": "triton"}]
    load, offload = headline(rows)
    assert (load["direction"], load["per_layer"]["method"], load["cross_layer"]["method"]) == ("load", "gather", "dma")
    assert load["methods"] == {"gather": 0.9, "segments": 0.4, "dma": 0.95}
    assert "cross_layer" not in offload


def test_summary_of_an_empty_folder_is_not_ok(tmp_path):
    """No tests ran and a step failed: the summary says so, and counts nothing."""
    summary = summarize(tmp_path, {"tests": {"rc": 124, "seconds": 150}})
    assert not summary["ok"] and junit_counts(tmp_path / "missing.xml")["passed"] == 0
    assert (tmp_path / "device-check-summary.json").exists()


def test_ratio_spread_flags_noise():
    steady = bench.ratio_spread([1.0] * 5, [0.9] * 5)
    assert steady["ratio"] == pytest.approx(0.9) and not steady["noisy"]
    assert bench.ratio_spread([1.0] * 5, [1.2] * 5)["noisy"]  # faster than one contiguous copy
    assert bench.ratio_spread([1.0, 1.0, 1.0, 1.0], [0.5, 0.9, 0.5, 0.9])["noisy"]  # quartiles far apart
    # beating torch's copy is no noise where the memory bound (the native copy) is not beaten
    assert not bench.ratio_spread([1.0] * 5, [1.2] * 5, bound=0.97)["noisy"]
    assert bench.ratio_spread([1.0] * 5, [1.0] * 5, bound=1.3)["noisy"]


def test_summary_reads_the_newest_run_of_a_reused_folder(tmp_path):
    """A folder a device check ran in before: the summary counts the newest run that measured
    something (the rows load_results keeps), and its fingerprint is the newest run record."""
    path = tmp_path / "02_transfer-cpu-test.jsonl"
    runs = [{"record": "run", "run_id": name, "hardware": "cpu: test", "date": date, "device": "cpu"}
            for name, date in (("old", "2026-01-01"), ("new", "2026-01-02"), ("cut", "2026-01-03"))]
    records = [runs[0], {**_row("gather", "LBHNC", "load", 0.5), "run_id": "old"},
               runs[1], *[{**_row("gather", "LBHNC", d, 0.8), "run_id": "new"} for d in ("load", "offload")], runs[2]]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = summarize(tmp_path, {"bench": {"rc": 0, "seconds": 1}})
    assert summary["rows"]["transfer"] == len(load_results([path])) == 2
    assert summary["fingerprint"]["run_id"] == "cut"
    assert {h["direction"]: h["per_layer"]["ratio"] for h in summary["headline"]} == {"load": 0.8, "offload": 0.8}


def _keys(profile: dict) -> set[tuple]:
    return {(c.geometry.name, c.layout, c.method, c.direction, c.tokens, c.block_ids, c.target)
            for c in bench.configs(profile)}


def test_the_device_check_measures_what_notebook_02_measures():
    """scripts/device-check's sweep (the gpu profile) holds every configuration notebook 02 times
    on a GPU under make run (the standard and ceiling profiles), so one command covers them."""
    gpu = _keys(bench.PROFILES["gpu"])
    for profile in ("standard", "ceiling"):
        assert _keys(bench.PROFILES[profile]) <= gpu, profile
    assert "bench=(--profile gpu)" in (ROOT / "scripts" / "device-check").read_text()
