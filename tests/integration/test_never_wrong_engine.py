"""KVLabConnector never serves wrong KV inside vLLM's CPU engine, whatever fails (issue 25):
each run is compared bitwise with the same-split control, vLLM's own prefix cache fed the
same requests in the same order, so every hit splits every prefill as the control's does.

- The deterministic sequence that poisoned the store (a shared-memory chunk evicted by a
  worker, then promised by the scheduler, its load failed, and the blocks saved anyway).
- A small KV cache under concurrent requests: vLLM preempts requests while the connector
  saves and loads, and the same requests come back after unique ones pushed them out.
- The load test itself, small: hooks mode on a cross-layer cache, its Redis tier killed
  half-way, every request answered and within its drift of its same-split control.
- New weights loaded into the running engine (an RL trainer's ``reload_weights``, from a
  path and from an iterator, with and without a reset): no hit, the new weights' tokens."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest
from conftest import bitwise, hits, within_split_drift

pytest.importorskip("vllm")

from kvlab.harness.engine import EngineSpec, run_engine  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.extended]
MIB = 1 << 20


@pytest.fixture(scope="module")
def book_ids(smollm2: str) -> list[int]:
    from transformers import AutoTokenizer

    from kvlab.experiments.tasks import book_text

    return AutoTokenizer.from_pretrained(smollm2)(book_text())["input_ids"]


@pytest.fixture
def shm_folder():
    """A shared-memory folder of this test's own."""
    path = Path("/dev/shm") / f"kvlab-test-{uuid.uuid4().hex[:12]}"
    yield str(path)
    shutil.rmtree(path, ignore_errors=True)


def poisoning_sequence(ids: list[int]) -> list[list[int]]:
    """Issue 25's reproduction, scaled to 32 MiB budgets: a ~500-token prefix l0 with suffix
    s0 twice, four unique 300-token prompts (they push l0 out of the memory and shared-memory
    budgets, not off disk), then l0 with suffix s1 twice and with s2 twice."""
    l0 = ids[2000:2500]
    suffixes = [ids[3000 + 100 * i: 3000 + 100 * i + 30 + 15 * i] for i in range(3)]
    unique = [ids[4000 + 700 * i: 4000 + 700 * i + 300] for i in range(4)]
    with_suffix = [l0 + s for s in suffixes]
    return [with_suffix[0]] * 2 + unique + [with_suffix[1]] * 2 + [with_suffix[2]] * 2


def test_a_failed_load_never_poisons_the_store(smollm2, book_ids, shm_folder, tmp_path) -> None:
    """Tiers memory, shared memory and disk, 32 MiB of memory and of shared memory (l0's two
    chunks of SmolLM2 fp32 and little more), one request at a time: every output equals vLLM's
    own prefix cache fed the same sequence, bitwise, with the same hits. (Before the fix the
    scheduler promised l0's evicted shared-memory files, the load failed, and the step saved
    the unfilled blocks: the later l0 requests were wrong.)"""
    sequence = poisoning_sequence(book_ids)
    common = {"model": smollm2, "dtype": "float32", "max_tokens": 4, "phases": ("cold",)}
    extra = {"tiers": ["memory", "shm", "disk"], "shm": {"path": shm_folder, "bytes": 32 * MIB},
             "disk": {"path": str(tmp_path / "disk")}, "store_bytes": 32 * MIB}
    control = run_engine(EngineSpec(**common, prefix_caching=True), sequence)
    kvlab = run_engine(EngineSpec(**common, connector="kvlab", extra=extra), sequence)
    assert hits(kvlab, "cold") == hits(control, "cold")
    assert min(hits(kvlab, "cold")[-4:]) >= 480, "l0 came back from the connector"
    assert bitwise(control, kvlab, "cold", "cold")
    stats = kvlab["connector"]["default"]
    assert stats["store"]["evicted"] > 0, "the budgets were full: l0 left memory and shared memory"


def test_preempted_requests_under_a_small_kv_cache_keep_their_kv_right(tiny_llama: Path, shm_folder, tmp_path) -> None:
    """16 concurrent requests of ~250 tokens (8 blocks; four shared prefixes, four suffixes
    each), each generating 64 tokens, into a KV cache of 28 blocks of 32 tokens: three requests
    fit, their decodes outgrow the blocks left, and vLLM preempts requests while the connector
    saves and loads (and loads again when they resume). Then the same 16 again. No request
    fails, the connector hits, and every output is within the stated drift of an engine without
    a connector under the same pressure (a hit splits the prefill differently; wrong KV moves
    logprobs by far more). The small random Llama keeps it fast; the load test
    (``python -m kvlab loadtest``) does the same to SmolLM2 through ``vllm serve``."""
    prompts = [list(range(1000 + 300 * i, 1000 + 300 * i + 220)) + list(range(9000 + 50 * j, 9000 + 50 * j + 20 + 5 * j))
               for i in range(4) for j in range(4)]
    common = {"model": str(tiny_llama), "dtype": "float32", "max_tokens": 64, "batch": True,
              "phases": ("cold", "warm"), "num_gpu_blocks": 28, "max_num_seqs": 16, "max_model_len": 800}
    extra = {"tiers": ["memory", "shm", "disk"], "shm": {"path": shm_folder}, "disk": {"path": str(tmp_path / "disk")}}
    none = run_engine(EngineSpec(**common), prompts)
    kvlab = run_engine(EngineSpec(**common, connector="kvlab", extra=extra), prompts)
    stats = kvlab["connector"]["default"]
    assert stats["preemptions"] > 0, "the small cache forced preemptions"
    assert sum(hits(kvlab, "warm")) > 0 and stats["saved_blocks"] > 0
    for phase in ("cold", "warm"):
        assert len(kvlab["phases"][phase]) == len(prompts)
        assert within_split_drift(none, kvlab, phase, phase), phase


def test_the_load_test_serves_on_when_its_remote_tier_is_killed_half_way(tiny_llama: Path, tmp_path: Path) -> None:
    """``python -m kvlab loadtest --mode hooks --cross-layer --remote redis`` in small: 12
    requests from 4 clients through ``vllm serve``, Redis SIGKILLed once 6 are answered. Every
    request answered, each within its drift of its same-split control, on a cache registered
    cross-layer, and the kill between requests answered before it and sent after it."""
    from kvlab.experiments.load_test import LoadTest

    test = LoadTest(str(tiny_llama), tmp_path, requests=12, clients=4, max_tokens=4, tier_bytes=16 * MIB,
                    mode="hooks", cross_layer=True, remote="redis")
    result = test.run(list(range(10_000)))
    assert result["failed"] == 0 and result["within_drift"] == result["requests_sent"] == 12
    assert result["layout"] == "CPU_BLHNC" and result["faults"]["remote-kill"] == 1
    before, after = result["before_kill"]["requests_sent"], result["after_kill"]["requests_sent"]
    assert before >= 1 and after >= 1 and before + after <= 12


def _perturbed_copy(source: Path, target: Path, scale: float) -> Path:
    """The model's folder with every weight matrix scaled: other weights, same shapes."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    for path in target.glob("*.safetensors"):
        tensors = load_file(path)
        save_file({name: t * scale if t.dim() == 2 else t for name, t in tensors.items()}, path,
                  metadata={"format": "pt"})
    return target


def test_weights_loaded_into_a_running_engine_never_meet_old_kv(tiny_llama: Path, tmp_path: Path) -> None:
    """An RL trainer's flow: weights B, A, B, A loaded into a running engine by
    ``reload_weights`` from a path and from an iterator, with no reset, with
    ``reset_prefix_cache()`` and with ``reset_prefix_cache(reset_connector=True)``. After
    every load: no hit, and bitwise the tokens of an engine without a connector doing the same
    loads (vLLM's reload gives slightly other logprobs than an engine started on those weights)."""
    a = tmp_path / "a"
    shutil.copytree(tiny_llama, a)
    b = _perturbed_copy(tiny_llama, tmp_path / "b", 1.5)
    prompts = [list(range(1000 + 7 * i, 1300 + 7 * i)) for i in range(2)]
    reloads = ({"weights": str(b), "how": "path", "reset": "none"},
               {"weights": str(a), "how": "iterator", "reset": "none"},
               {"weights": str(b), "how": "iterator", "reset": "prefix"},
               {"weights": str(a), "how": "path", "reset": "connector"})
    common = {"dtype": "float32", "max_tokens": 8, "reloads": reloads,
              "phases": ("cold", "warm", "reload-0", "reload-1", "reload-2", "reload-3")}
    kvlab = run_engine(EngineSpec(str(a), "kvlab", **common), prompts)
    control = run_engine(EngineSpec(str(a), **common), prompts)  # the same loads, no connector
    assert hits(kvlab, "warm") == [288, 288], "the connector serves the weights it was computed with"
    for index in range(len(reloads)):
        phase = f"reload-{index}"
        assert hits(kvlab, phase) == [0, 0], f"{reloads[index]}: no KV of other weights"
        assert bitwise(control, kvlab, phase, phase), reloads[index]
    assert not within_split_drift(kvlab, kvlab, "cold", "reload-0"), "new weights, other outputs: old KV would show"
