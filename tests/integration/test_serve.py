"""``vllm serve`` with KVLabConnector, end to end over HTTP: the same prompt twice on one
server (vLLM's prefix cache off, so the second is served from the connector), tenants kept
apart by cache salts, then again on a new server over the same disk store; a bad extra
config fails start-up and leaves nothing running."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

import pytest
from conftest import prepared, running

pytest.importorskip("vllm")

from kvlab.runtime.models import SMOLLM2, TINY_LLAMA  # noqa: E402
from kvlab.runtime.servers import ServerError, VLLMServer  # noqa: E402

pytestmark = pytest.mark.slow  # starts engines, servers or notebook kernels
BLOCK_SIZE = 32
MAX_TOKENS = 16


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


# ---- real servers ---------------------------------------------------------------------------
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


def test_bad_extra_config_fails_start_up_and_leaves_nothing(tmp_path):
    server = VLLMServer(prepared(TINY_LLAMA), dtype="float32", extra={"colour": "blue"},
                        log_path=tmp_path / "bad.log")
    with pytest.raises(ServerError, match="exited with code") as failure:
        server.start()
    assert "unknown kv_connector_extra_config key" in str(failure.value)
    assert server.process.poll() is not None
    assert server.pids() == []
