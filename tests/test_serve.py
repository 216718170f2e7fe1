"""``vllm serve`` with KVLabConnector, end to end over HTTP: the same prompt twice on one
server (vLLM's prefix cache off, so the second is served from the connector), then again on
a new server over the same disk store. The two tests that start servers are marked slow
(about 65 s together on 2 cores) but stay in the default run: they are the only tests of
the connector behind ``vllm serve``. The tests above them start nothing."""

from __future__ import annotations

import importlib.resources
import json
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import running

pytest.importorskip("vllm")

from kvlab.models import SMOLLM2, TINY_LLAMA, model_path  # noqa: E402
from kvlab.serve import ServerError, VLLMServer  # noqa: E402

BLOCK_SIZE = 32
MAX_TOKENS = 16


def prepared(name: str) -> str:
    try:
        model_path(name)
    except FileNotFoundError as error:
        pytest.skip(str(error))
    return name


@pytest.fixture(scope="module")
def text() -> str:
    """About 620 SmolLM2 tokens of a Project Gutenberg story that reasoning_gym ships."""
    gym = pytest.importorskip("reasoning_gym")
    story = (importlib.resources.files(gym) / "data" / "in_the_year_2889.txt").read_text()
    return story[5000:7600]


def cached_tokens(response: dict) -> int:
    return response["usage"]["prompt_tokens_details"]["cached_tokens"]


def loadable_tokens(response: dict) -> int:
    """Full blocks before the last prompt token, which vLLM always computes itself."""
    return (response["usage"]["prompt_tokens"] - 1) // BLOCK_SIZE * BLOCK_SIZE


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
    assert server.environment()["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


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


def test_stop_kills_a_group_that_ignores_sigterm():
    """A server and a child of it that both ignore SIGTERM are killed after the grace period."""
    server = VLLMServer(TINY_LLAMA, stop_grace=0.5)
    server.process = subprocess.Popen(["bash", "-c", 'trap "" TERM; sleep 60 & sleep 60; wait'],
                                      start_new_session=True)
    deadline = time.monotonic() + 5
    while len(server.pids()) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = server.pids()
    assert len(pids) == 3
    server.stop()
    assert running(pids) == [] and server.process.returncode == -signal.SIGKILL


# ---- real servers ---------------------------------------------------------------------------
@pytest.mark.slow
def test_connector_serves_repeats_and_survives_a_restart(tmp_path, text):
    extra = {"store": "disk", "disk_path": str(tmp_path / "kv")}
    # fp32: bf16 tokens depend on which CPU's kernels ran them (tested against a control elsewhere)
    common = {"model": prepared(f"{SMOLLM2}-fp32"), "dtype": "float32", "extra": extra, "prefix_caching": False,
              "block_size": BLOCK_SIZE}

    with VLLMServer(**common, log_path=tmp_path / "first.log") as server:
        first_pids = server.pids()
        cold = server.complete(text, MAX_TOKENS)
        warm = server.complete(text, MAX_TOKENS)
        # tenants: another salt, or none, never gets a salted tenant's KV, as vLLM's prefix cache
        salted = [cached_tokens(server.complete(text, MAX_TOKENS, cache_salt=salt)) for salt in ("a", "b", "a")]
    assert len(first_pids) >= 2, "the API server and its engine core are separate processes"
    assert running(first_pids) == []
    assert cold["usage"]["prompt_tokens"] > 500
    assert cached_tokens(cold) == 0
    assert cached_tokens(warm) == loadable_tokens(warm) > 0, "the repeat comes from the connector's store"
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    assert salted == [0, 0, loadable_tokens(warm)]
    assert any(Path(extra["disk_path"]).iterdir()), "chunks were written through to disk"

    with VLLMServer(**common, log_path=tmp_path / "second.log") as server:
        second_pids = server.pids()
        restarted = server.complete(text, MAX_TOKENS)
    assert running(second_pids) == []
    assert cached_tokens(restarted) == loadable_tokens(restarted) > 0, "a new server reads the disk store"
    assert restarted["choices"][0]["text"] == cold["choices"][0]["text"]


@pytest.mark.slow
def test_bad_extra_config_fails_start_up_and_leaves_nothing(tmp_path):
    server = VLLMServer(prepared(TINY_LLAMA), dtype="float32", extra={"colour": "blue"},
                        log_path=tmp_path / "bad.log")
    with pytest.raises(ServerError, match="exited with code") as failure:
        server.start()
    assert "unknown kv_connector_extra_config key" in str(failure.value)
    assert server.process.poll() is not None
    assert server.pids() == []
