"""kvlab's fork server (kvlab.runtime.forkserver): a job forked from it runs as ``python -m``
would, with its own environment, output and exit code; a job whose environment it cannot
give runs plainly; a job past its time is killed with its processes."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from kvlab.runtime.forkserver import ForkServer

PROBE = """import json, os, sys
print("probe ran")
if os.environ.get("PROBE_FAIL"):
    raise SystemExit(3)
if os.environ.get("VLLM_PROBE_SLEEP"):
    import time
    time.sleep(float(os.environ["VLLM_PROBE_SLEEP"]))
json.dump({"env": dict(os.environ), "argv": sys.argv, "parent": os.getppid(), "preloaded": "json" in sys.modules},
          open(sys.argv[2], "w"))
"""


@pytest.fixture
def server(tmp_path):
    (tmp_path / "kvlab_probe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    with_server = ForkServer(env, preload=("json",))
    yield with_server
    with_server.close()


def test_a_forked_job_runs_as_python_m_with_its_own_environment(server, tmp_path):
    out, log = tmp_path / "out.json", tmp_path / "out.log"
    env = {**server.env, "VLLM_PROBE": "yes"}
    assert server.run("kvlab_probe", ["job", str(out)], env, log, timeout=60) == 0
    ran = json.loads(out.read_text())
    assert ran["env"]["VLLM_PROBE"] == "yes" and ran["argv"][1:] == ["job", str(out)]
    assert ran["parent"] == server.process.pid and ran["preloaded"]
    assert log.read_text() == "probe ran\n"
    assert server.run("kvlab_probe", ["job", str(out)], {**server.env, "PROBE_FAIL": "1"}, log, 60) is None, \
        "a variable read at import may differ: such a job runs plainly"


def test_a_failed_job_gives_its_exit_code_and_a_slow_one_is_killed(server, tmp_path):
    log = tmp_path / "out.log"
    server.env["PROBE_FAIL"] = "1"  # as if the server had started with it
    assert server.run("kvlab_probe", ["job", str(tmp_path / "out.json")], server.env, log, 60) == 3
    assert "probe ran" in log.read_text()
    del server.env["PROBE_FAIL"]
    with pytest.raises(subprocess.TimeoutExpired):
        server.run("kvlab_probe", ["job", str(tmp_path / "slow.json")], {**server.env, "VLLM_PROBE_SLEEP": "30"}, log,
                   timeout=1)
    assert not (tmp_path / "slow.json").exists(), "killed, not waited for"
    assert server.run("kvlab_probe", ["job", str(tmp_path / "out.json")], server.env, log, 60) == 0, "serves on"


def test_run_child_gives_the_same_result_forked_or_not(tmp_path, monkeypatch):
    """kvlab.runtime.processes.run_child forks where it can; KVLAB_FORK_SERVER=0 starts plainly."""
    from kvlab.runtime import processes

    (tmp_path / "kvlab_probe.py").write_text(PROBE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setattr("kvlab.runtime.forkserver.PRELOADED", ("json",))
    results = {}
    for fork in ("1", "0"):
        monkeypatch.setenv("KVLAB_FORK_SERVER", fork)
        results[fork] = processes.run_child("kvlab_probe", {}, "the probe", 60, {"VLLM_PROBE": fork})
    assert results["0"]["parent"] == os.getpid() and results["1"]["parent"] != os.getpid(), "forked from the server"
    assert results["1"]["preloaded"] and {r["env"]["VLLM_PROBE"] for r in results.values()} == {"1", "0"}
    assert results["1"]["env"]["OMP_NUM_THREADS"] == results["0"]["env"]["OMP_NUM_THREADS"] == "1", "pinned"
    monkeypatch.setenv("PROBE_FAIL", "1")
    with pytest.raises(RuntimeError, match=r"the probe failed \(exit 3\):\nprobe ran"):
        processes.run_child("kvlab_probe", {}, "the probe", 60)


def test_a_process_forked_from_the_owner_does_not_share_its_server(server):
    """Jobs of a process forked from the server's owner would interleave on its pipes: the
    server is not its child, so to it the server is gone."""
    pid = os.fork()
    if pid == 0:
        os._exit(0 if not server.accepts(server.env) else 1)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert server.accepts(server.env)
