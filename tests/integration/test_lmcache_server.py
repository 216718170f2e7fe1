"""LMCache's server mode, for real: an ``lmcache server`` started and stopped with nothing
left running, a killed server reported, and vLLM engines on it with SmolLM2 in fp32: the
warm run is served from LMCache and changes nothing; a server killed mid-run makes the
engine recompute. Each engine test takes 30 to 60 s on 2 cores."""

from __future__ import annotations

import contextlib
import importlib.resources
import importlib.util
import os
import signal
import subprocess
import threading
import time

import pytest
from conftest import bitwise, hits, loadable, running, within_split_drift

if importlib.util.find_spec("lmcache") is None:
    pytest.skip("lmcache is not installed", allow_module_level=True)


from kvlab.harness.engine import EngineSpec  # noqa: E402
from kvlab.harness.lmcache import run_on_server  # noqa: E402
from kvlab.runtime.lmcache import LMCacheError, LMCacheServer  # noqa: E402

# starts engines or servers; one of the extended engine suite (`make test-extended`, CI runs it)
pytestmark = [pytest.mark.slow, pytest.mark.extended]
BLOCK_SIZE = 32


def kill(server: LMCacheServer) -> None:
    """SIGKILL the server's whole process group, as a crash would."""
    pids = server.pids()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.process.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while running(pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def stored_chunks(server: LMCacheServer) -> int:
    return server.status()["storage_manager"]["l1_managers"]["_default"]["total_object_count"]


# ---- real servers ---------------------------------------------------------------------------
def test_server_starts_answers_and_stops_leaving_nothing(tmp_path):
    with LMCacheServer(log_path=tmp_path / "server.log") as server:
        pids = server.pids()
        server.ensure_alive()
        assert server.alive and stored_chunks(server) == 0
        assert server.status()["chunk_size"] == 32
    assert pids and running(pids) == []
    server.stop()  # again: nothing to do
    assert not server.alive
    with pytest.raises(LMCacheError, match="is dead"):
        server.ensure_alive()
    assert "LMCache" in (tmp_path / "server.log").read_text()


def test_killed_server_is_reported_and_no_engine_starts(tmp_path):
    with LMCacheServer(log_path=tmp_path / "server.log") as server:
        pids = server.pids()
        kill(server)
        assert not server.alive
        with pytest.raises(LMCacheError, match=r"is dead \(killed by SIGKILL\)"):
            server.ensure_alive()
        began = time.monotonic()
        with pytest.raises(LMCacheError, match="is dead"):
            run_on_server(server, EngineSpec(str(tmp_path), "lmcache"), [[1, 2, 3]])
        assert time.monotonic() - began < 5, "refused before any engine started"
    assert running(pids) == [] and server.pids() == []


def test_failed_runs_name_a_dead_server(tmp_path, monkeypatch):
    """An engine run that fails or hangs: its own error while the server lives, an
    LMCacheError naming the server once it is dead (the engine is a stand-in here)."""
    import kvlab.harness.lmcache

    def crash(spec, prompts, timeout, **options):
        raise RuntimeError("engine crashed")

    def hang_while_the_server_dies(spec, prompts, timeout, **options):
        assert spec.extra == {"port": server.port}
        kill(server)
        raise subprocess.TimeoutExpired("python -m kvlab.harness.engine", timeout)

    spec = EngineSpec(str(tmp_path), "lmcache")
    with LMCacheServer(log_path=tmp_path / "server.log") as server:
        monkeypatch.setattr(kvlab.harness.lmcache, "run_engine", crash)
        with pytest.raises(RuntimeError, match="engine crashed") as failure:
            run_on_server(server, spec, [[1, 2, 3]])
        assert not isinstance(failure.value, LMCacheError)
        monkeypatch.setattr(kvlab.harness.lmcache, "run_engine", hang_while_the_server_dies)
        with pytest.raises(LMCacheError, match="did not finish within 7 s.*port .* is dead"):
            run_on_server(server, spec, [[1, 2, 3]], timeout=7)
    assert server.pids() == []


# ---- engines on a server --------------------------------------------------------------------
def test_warm_run_is_served_by_lmcache_and_identical(smollm2, prompts, tmp_path):
    """LMCache's warm run equals bitwise vLLM's own prefix hit on the cold run's KV (the
    "control" phase: the same prefill split) and the cold run within the split's drift."""
    spec = EngineSpec(smollm2, "lmcache", dtype="float32", max_tokens=8, prefix_caching=True,
                      phases=("cold", "control", "warm"))
    with LMCacheServer(log_path=tmp_path / "server.log") as server:
        result = run_on_server(server, spec, prompts, timeout=300)
        chunks = stored_chunks(server)
        pids = server.pids()
    assert result["lmcache_server_alive"]
    assert hits(result, "cold") == [0, 0]
    # every full chunk before the last prompt token comes from LMCache (chunk = block = 32)
    assert hits(result, "warm") == loadable(prompts)
    assert chunks == sum((len(p) - 1) // BLOCK_SIZE for p in prompts)
    assert bitwise(result, result, "control", "warm") and within_split_drift(result, result, "cold", "warm")
    assert running(pids) == []


def test_server_killed_mid_run_means_recompute(smollm2, prompts, tmp_path):
    """The server dies once the first prompt's chunks are stored: the engine recomputes the
    rest (no hits, same tokens) instead of hanging, and ends in bounded time."""
    with LMCacheServer(log_path=tmp_path / "server.log") as server:
        pids = server.pids()

        def kill_after_first_store() -> None:
            while server.alive and stored_chunks(server) == 0:
                time.sleep(0.05)
            kill(server)

        killer = threading.Thread(target=kill_after_first_store, daemon=True)
        killer.start()
        spec = EngineSpec(smollm2, "lmcache", extra={"mq_timeout": 3}, dtype="float32", max_tokens=8)
        began = time.monotonic()
        result = run_on_server(server, spec, prompts, timeout=240)
        seconds = time.monotonic() - began
        killer.join(10)
    assert not killer.is_alive() and running(pids) == []
    assert not result["lmcache_server_alive"]
    assert hits(result, "warm") == [0, 0]
    assert bitwise(result, result, "cold", "warm"), "both computed whole: the same split"
    assert seconds < 120


def test_lmcaches_redis_backend_round_trips_a_prefix_on_our_server(redis_server):
    """LMCache's own Redis remote backend, through its engine, on kvlab's Redis server: what
    it fetches is what it stored, in two keys per chunk (data and metadata)."""
    import torch

    from kvlab.cache import ModelGeometry
    from kvlab.experiments.lmcache_redis import lmcache_redis_costs

    geometry = ModelGeometry("net", 3, 2, 32, torch.bfloat16, 16)
    row = lmcache_redis_costs(redis_server.url, geometry, tokens=512, chunk_tokens=256, repeats=1)
    assert row["identical"] is True
    assert row["objects_per_chunk"] == 2
    assert row["store_s"] > 0 and row["fetch_s"] > 0
