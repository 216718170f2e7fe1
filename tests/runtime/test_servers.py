"""``vllm serve`` managed by kvlab.runtime.servers, without starting one: the command and
environment it builds, and the errors it gives before starting (a missing model folder, a
taken port), a process group that ignores SIGTERM killed on stop and at once by kill, and
the layout the connector registered read from the log."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time

import pytest
from conftest import prepared, running

pytest.importorskip("vllm")

from kvlab.runtime.models import SMOLLM2, TINY_LLAMA, model_path  # noqa: E402
from kvlab.runtime.servers import ServerError, VLLMServer  # noqa: E402


# ---- nothing started ------------------------------------------------------------------------
def test_command_carries_the_connector_and_switches():
    server = VLLMServer(prepared(TINY_LLAMA), extra={"store": "cpu"}, port=12345)
    command = server.command()
    assert command[1:3] == ["serve", str(model_path(TINY_LLAMA))]
    assert {"--enforce-eager", "--no-enable-prefix-caching", "--enable-prompt-tokens-details"} <= set(command)
    assert command[command.index("--block-size") + 1] == "32"
    transfer = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector"] == "KVLabConnector"
    assert transfer["kv_connector_extra_config"] == {"store": "cpu"}
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in server.environment(), "vLLM's default process layout"


def test_without_kvlab_the_engine_keeps_vllms_default_processes(monkeypatch):
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    server = VLLMServer(prepared(TINY_LLAMA), connector="none", prefix_caching=True)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in server.environment()
    command = server.command()
    assert "--enable-prefix-caching" in command and "--kv-transfer-config" not in command


def test_missing_model_folder_fails_before_starting(tmp_path):
    server = VLLMServer(tmp_path / "no-model")
    with pytest.raises(FileNotFoundError, match="not a model folder"):
        server.start()
    assert server.process is None


def test_unprepared_model_name_says_how_to_prepare(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_MODELS_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="models prepare"):
        VLLMServer(SMOLLM2).start()


def test_taken_port_fails_before_starting():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = VLLMServer(prepared(TINY_LLAMA), port=taken.getsockname()[1])
        with pytest.raises(ServerError, match="is taken"):
            server.start()
    assert server.process is None


def _group_that_ignores_sigterm(server: VLLMServer) -> list[int]:
    """Stand a shell in for the server: it and a child of it ignore SIGTERM; their pids."""
    server.process = subprocess.Popen(["bash", "-c", 'trap "" TERM; sleep 60 & sleep 60; wait'],
                                      start_new_session=True)
    deadline = time.monotonic() + 5
    while len(server.pids()) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    return server.pids()


def test_stop_kills_a_group_that_ignores_sigterm():
    """A server and a child of it that both ignore SIGTERM are killed after the grace period."""
    server = VLLMServer(TINY_LLAMA, stop_grace=0.5)
    pids = _group_that_ignores_sigterm(server)
    assert len(pids) == 3
    server.stop()
    assert running(pids) == [] and server.process.returncode == -signal.SIGKILL


def test_kill_sigkills_the_whole_group_at_once():
    """As a crash: no SIGTERM and no grace period first, the server and its child gone."""
    server = VLLMServer(TINY_LLAMA, stop_grace=30)
    pids = _group_that_ignores_sigterm(server)
    began = time.monotonic()
    server.kill()
    assert time.monotonic() - began < 5, "not after the 30 s grace period"
    assert len(pids) == 3 and running(pids) == [] and server.process.returncode == -signal.SIGKILL


def test_the_registered_layout_is_read_from_the_servers_log(tmp_path):
    log = tmp_path / "serve.log"
    log.write_text("INFO starting\n(EngineCore pid=7) INFO [worker.py:97] KVLabConnector: rank 0 of 1 registered a "
                   "CPU_BLHNC cache of 96 blocks of 32 tokens (one segment per block, copied with memcpy); tiers "
                   "['memory', 'redis']; cross-layer blocks asked for and granted\n")
    assert VLLMServer(TINY_LLAMA, log_path=log).registered_layout() == "CPU_BLHNC"
    log.write_text("INFO starting\n")
    assert VLLMServer(TINY_LLAMA, log_path=log).registered_layout() is None
