"""kvlab's CPU attention backend inside vLLM's CPU engine (SmolLM2-135M, fp32): the seed's
cross-layer request granted by vLLM's own allocator, the Ascend-style hooks called from
the attention forward, layerwise loads and saves, each layout and mode from each tier, a
cross-layer engine reading a per-layer one's chunks; and each mode's connector calls,
recorded, as the machinery diagrams draw them.

Every engine's cold run is bitwise plain CPU_ATTN's (an engine with kvlab's plugin turned
off: the same kernels, so the same bits); every connector hit is bitwise vLLM's own prefix
hit in the same engine (the same prefill split); zeroed or shifted KV moves the outputs.
Each engine runs in its own process (kvlab.harness.engine)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import bitwise, hits, loadable

pytest.importorskip("vllm")

from kvlab.connector.step_order import step_calls  # noqa: E402
from kvlab.harness.call_recorder import forward_steps, recorded_calls  # noqa: E402
from kvlab.harness.engine import EngineSpec, run_engine  # noqa: E402

# starts engines; one of the extended engine suite (`make test-extended`, CI runs it)
pytestmark = [pytest.mark.slow, pytest.mark.extended]
CONTROLLED = ("cold", "control", "warm")
SHARED = "warm-disk"  # the memory tier emptied: the shared tier serves
DAMAGED = ("warm-zeroed", "warm-block-shift")  # the memory tier's chunks damaged (so no SHARED phase before them)
BACKEND = "kvlab.connector.backend.KVLabCPUAttentionBackend"


@pytest.fixture(scope="module")
def plain(smollm2: str, prompts: list[list[int]]) -> dict:
    """vLLM as it is without kvlab (VLLM_PLUGINS=""): CPU_ATTN, LBHNC."""
    return run_engine(EngineSpec(smollm2, dtype="float32", max_tokens=8, kvlab_backend=False, phases=("cold",)), prompts)


def test_without_a_cross_layer_request_nothing_changes(smollm2, prompts, plain) -> None:
    """kvlab installed, no connector: the same layout and bitwise the same outputs; any layout
    the backend declares can be chosen with VLLM_KV_CACHE_LAYOUT, and reads bitwise the same."""
    assert plain["kv_cache"] == {"layout": "LBHNC",
                                 "cpu_attention": "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"}
    ours = run_engine(EngineSpec(smollm2, dtype="float32", max_tokens=8, phases=("cold",)), prompts)
    assert ours["kv_cache"] == {"layout": "LBHNC", "cpu_attention": BACKEND}
    assert bitwise(plain, ours, "cold", "cold")
    chosen = run_engine(EngineSpec(smollm2, dtype="float32", max_tokens=8, kv_cache_layout="BHLNC", phases=("cold",)),
                        prompts)
    assert chosen["kv_cache"]["layout"] == "BHLNC" and bitwise(plain, chosen, "cold", "cold")


def test_a_layout_the_backend_cannot_read_is_a_start_up_error(smollm2, prompts) -> None:
    with pytest.raises(RuntimeError, match=r"VLLM_KV_CACHE_LAYOUT=LBNHC does not satisfy.*LBHNC.*BLHNC"):
        run_engine(EngineSpec(smollm2, dtype="float32", kv_cache_layout="LBNHC", phases=("cold",)), prompts)


@pytest.mark.parametrize("layout, mode, tier, processes, then", [
    ("BLHNC", "whole-step", "shm", True, (SHARED,)),  # the seed's request, vLLM's default process layout
    ("BLHNC", "layerwise", "memory", False, DAMAGED),
    ("BLHNC", "hooks", "redis", True, (SHARED,)),
    ("LBHNC", "hooks", "disk", False, (SHARED, "floor")),  # a disk hit saved into memory; a cross-layer reader
])
def test_each_layout_and_mode_serves_hits_bitwise(smollm2, prompts, plain, tmp_path: Path, redis_server, layout: str,
                                                  mode: str, tier: str, processes: bool, then: tuple[str, ...]) -> None:
    extra = {"chunk_size": 64, "layerwise": mode != "whole-step", "hooks": mode == "hooks",
             "enable_cross_layers_blocks": layout == "BLHNC"}
    if tier == "redis":
        extra.update(redis_server.extra(tiers=["memory", "redis"]))
    elif tier != "memory":
        extra.update({"tiers": ["memory", tier], f"{tier}_path": str(tmp_path / tier)})
    spec = EngineSpec(smollm2, "kvlab", extra, dtype="float32", max_tokens=8, prefix_caching=True,
                      multiprocessing=processes, phases=CONTROLLED + then, record_calls=True)
    result = run_engine(spec, prompts)
    stats = result["connector"]["default"]
    assert result["kv_cache"] == {"layout": layout, "cpu_attention": BACKEND}
    assert stats["layout"] == f"CPU_{layout}" and stats["load_errors"] == stats["save_errors"] == 0
    assert bitwise(plain, result, "cold", "cold"), "the same kernels as plain CPU_ATTN"
    for phase in ("warm", *then):
        assert hits(result, phase) == hits(result, "control") == loadable(prompts), phase
        assert bitwise(result, result, "control", phase) == (phase not in DAMAGED), f"{phase}: a damaged KV must show"
    blocks = sum(hit // 32 for hit in loadable(prompts))
    per_load = blocks * (1 if layout == "BLHNC" and mode == "whole-step" else 30)  # SmolLM2: 30 layers
    loads = 1 + sum(phase != "floor" for phase in then)
    assert stats["load_segments"] == loads * per_load, "one run per block if cross-layer and whole-step"
    if "floor" in then:  # a timed request never shares the engine with the last one's saves
        saved = {phase: sum(row["kvlab"].get("saved_blocks", 0) for row in result["phases"][phase])
                 for phase in (SHARED, "floor")}
        assert saved[SHARED] >= blocks and saved["floor"] == 0, "a shared tier's hit is saved into memory in its own phase"
    if mode != "whole-step":
        assert stats["save_segments"] == stats["saved_blocks"] * 30, "saved layer by layer"
    # the machinery diagrams' data (kvlab.connector.step_order) is what this engine did: the prefill
    # that stored the prompt, and the one that loaded it, call by call with every copy
    for phase, loads in (("cold", False), ("warm", True)):
        recorded = recorded_calls(forward_steps(result["phases"][phase][0]["connector_calls"])[0])
        sides = {call.side for call in recorded}  # in vLLM's default processes the scheduler side runs apart
        assert sides == ({"worker"} if processes else {"scheduler", "worker"}), phase
        assert recorded == [c for c in step_calls(mode, loads=loads, saves=not loads) if c.side in sides], phase
    if tier == "disk":  # a cross-layer engine reads what this per-layer one left in the folder, converted
        reader = run_engine(EngineSpec(smollm2, "kvlab", {"chunk_size": 64, "enable_cross_layers_blocks": True,
                                                          "tiers": ["memory", "disk"],
                                                          "disk": {"path": str(tmp_path / "disk")}},
                                       dtype="float32", max_tokens=8, prefix_caching=True, phases=("cold",)), prompts)
        assert reader["connector"]["default"]["layout"] == "CPU_BLHNC"
        assert hits(reader, "cold") == loadable(prompts) and reader["connector"]["default"]["load_errors"] == 0
        assert bitwise(result, reader, "control", "cold"), "the writer's own prefix hit: the same prefill split"
