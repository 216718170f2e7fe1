"""``vllm serve`` with KVLabConnector, end to end over HTTP: the seed's command verbatim (vLLM's
defaults, its own process layout), a repeat served from the connector once vLLM's prefix
cache is emptied, tenants kept apart by cache salts; a bad extra config fails start-up and
leaves nothing running. (A new process reading a shared store: test_connector_vllm.py and
test_faults_engine.py.)"""

from __future__ import annotations

import importlib.resources
import json
import re

import pytest
from conftest import prepared, running

pytest.importorskip("vllm")

from kvlab.connector.metrics import PROM_COUNTERS  # noqa: E402
from kvlab.harness.compare import SPLIT_DRIFT, gap_through_divergence  # noqa: E402
from kvlab.runtime.models import SMOLLM2, TINY_LLAMA  # noqa: E402
from kvlab.runtime.servers import ServerError, VLLMServer  # noqa: E402

# starts engines or servers; one of the extended engine suite (`make test-extended`, CI runs it)
pytestmark = [pytest.mark.slow, pytest.mark.extended]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def text() -> str:
    """About 620 SmolLM2 tokens of a Project Gutenberg story that reasoning_gym ships."""
    gym = pytest.importorskip("reasoning_gym")
    story = (importlib.resources.files(gym) / "data" / "in_the_year_2889.txt").read_text()
    return story[5000:7600]


def cached_tokens(response: dict) -> int:
    return response["usage"]["prompt_tokens_details"]["cached_tokens"]


# ---- real servers ---------------------------------------------------------------------------
SEED_EXTRA = {"enable_cross_layers_blocks": True}


def test_the_seeds_command_verbatim_serves_repeats_from_the_connector(tmp_path, text):
    """``vllm serve <model> --kv-transfer-config '{..."kv_connector_extra_config":
    {"enable_cross_layers_blocks":true}}'`` with vLLM's defaults for everything else (its
    process layout, prefix caching on, block size, bf16, compilation); only the KV space a
    small machine has, ``--enable-prompt-tokens-details``, vLLM's development endpoint
    that empties its own prefix cache, and its stats logged every second (not every 10 s).
    A repeat after that reset is served by the connector and says so in ``cached_tokens``,
    with the text of vLLM's own prefix-cache repeat; tenants (cache salts) stay apart as in
    vLLM's prefix cache. The connector's counters reach vLLM's ``/metrics`` and its stats
    line, and its one registration line vLLM's log."""
    server = VLLMServer(prepared(SMOLLM2), extra=SEED_EXTRA, vllm_defaults=True,
                        env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_LOG_STATS_INTERVAL": "1"},
                        log_path=tmp_path / "serve.log")
    with server:
        assert server.command()[2:] == [
            str(server.model_folder), "--host", "127.0.0.1", "--port", str(server.port), "--enable-prompt-tokens-details",
            "--kv-transfer-config", json.dumps({"kv_connector": "KVLabConnector", "kv_connector_module_path":
                                                "kvlab.connector", "kv_role": "kv_both",
                                                "kv_connector_extra_config": SEED_EXTRA})]
        pids = server.pids()
        cold = server.complete(text, MAX_TOKENS)
        vllm_repeat = server.complete(text, MAX_TOKENS)  # vLLM's own prefix cache
        assert server.reset_prefix_cache()
        connector_repeat = server.complete(text, MAX_TOKENS)  # vLLM's cache is empty: the connector
        assert server.reset_prefix_cache()
        salted = [cached_tokens(server.complete(text, MAX_TOKENS, cache_salt=salt)) for salt in ("a", "b")]
        assert server.reset_prefix_cache()
        salted.append(cached_tokens(server.complete(text, MAX_TOKENS, cache_salt="a")))
        counters = server.kvlab_counters()
    assert len(pids) >= 3, "API server, engine core and worker are separate processes"
    assert running(pids) == []
    reused = cached_tokens(vllm_repeat)  # full blocks before the last prompt token, whatever vLLM's block size
    assert cached_tokens(cold) == 0 and reused > cold["usage"]["prompt_tokens"] // 2
    assert cached_tokens(connector_repeat) == reused, "the connector served every block vLLM's cache did"
    # both repeats compute the last tokens on top of the cold run's KV: the same text, bf16 or not
    assert connector_repeat["choices"][0]["text"] == vllm_repeat["choices"][0]["text"]
    assert salted == [0, 0, reused]
    # through vLLM's stats (worker and scheduler sides) to its Prometheus endpoint
    assert set(counters) == set(PROM_COUNTERS), counters
    assert counters["hit_tokens"] >= reused and counters["loaded_blocks"] > 0 and counters["saved_blocks"] > 0
    assert counters["load_errors"] == counters["save_errors"] == 0
    # kvlab's lines reach vLLM's own log (vllm serve configures only the "vllm" logger): one per worker
    log = (tmp_path / "serve.log").read_text()
    # the seed's request granted: vLLM's own allocator built one block-major buffer (kvlab's backend reads it)
    assert len(re.findall(r"KVLabConnector: rank 0 of 1 registered a CPU_BLHNC cache of \d+ blocks of \d+ tokens "
                          r"\(one segment per block, copied with memcpy\); tiers \['memory'\]; "
                          r"cross-layer blocks asked for and granted", log)) == 1
    assert "Using BLHNC KV cache layout" in log
    assert log.count("KVLabConnector: rank") == 1
    # and vLLM's periodic stats line (the scheduler's hits, the worker's loads)
    stats_line = r"KV Transfer metrics: lookups=\d+, hit_tokens=(\d+), loaded_blocks=(\d+)"
    logged = [tuple(map(int, m)) for m in re.findall(stats_line, log)]
    assert any(hits and loads for hits, loads in logged), logged


def test_bad_extra_config_fails_start_up_and_leaves_nothing(tmp_path):
    server = VLLMServer(prepared(TINY_LLAMA), dtype="float32", extra={"colour": "blue"},
                        log_path=tmp_path / "bad.log")
    with pytest.raises(ServerError, match="exited with code") as failure:
        server.start()
    assert "unknown kv_connector_extra_config key" in str(failure.value)
    assert server.process.poll() is not None
    assert server.pids() == []


@pytest.mark.parametrize("name, options", [(SMOLLM2 + "-fp32", {}),
                                           ("mini-deepseek-v2", {"block_size": 16, "attention_backend": "CPU_MLA"})])
def test_the_seeds_request_replayed_with_the_openai_client(tmp_path, text, name, options):
    """vllm-ascend #2039's check: its prompt, 10 tokens, temperature 0, through `vllm serve`
    with the connector asked for cross-layer blocks, vLLM's prefix cache off and eager mode,
    sent with the official openai client (completions and chat); then a long request twice,
    the repeat served from the connector (nothing else can: vLLM's prefix cache is off) with
    the same text. For SmolLM2 and for the MLA miniature."""
    from kvlab.experiments.seed_plan import SEED_MAX_TOKENS, SEED_PROMPT, SeedReplay

    replay = SeedReplay(prepared(name), text, log_path=tmp_path / "serve.log", **options)
    rows = {(row["request"], row["api"]): row for row in replay.run()}
    for api in ("completions", "chat"):
        seed = rows["seed prompt", api]
        assert seed["completion_tokens"] == len(seed["token_ids"]) == SEED_MAX_TOKENS, seed
    assert rows["seed prompt", "completions"]["prompt_tokens"] < len(SEED_PROMPT)
    first, repeat = rows["long, first", "completions"], rows["long, repeat", "completions"]
    block_size = options.get("block_size", 32)
    assert first["cached_tokens"] == 0
    assert repeat["cached_tokens"] == (first["prompt_tokens"] - 1) // block_size * block_size
    # the repeat computes its last prompt tokens on top of the loaded KV, the first run the whole
    # prompt: another prefill split, and no same-split control (the seed turns vLLM's prefix cache
    # off), so the same logprobs within the split's drift, up to and including any near-tie the
    # drift flips on this CPU (a damaged KV moves them by far more)
    assert len(repeat["logprobs"]) == len(repeat["token_ids"]) and len(first["logprobs"]) == len(first["token_ids"])
    assert gap_through_divergence(repeat, first) <= SPLIT_DRIFT
    assert all(row["layout"] for row in rows.values()), "the registration line names the cache layout"
