"""KVLabConnector inside vLLM's CPU engine with a real trained model (SmolLM2-135M, fp32):
the second run of a prompt is served from the connector and changes nothing, in the same
process and from disk in a new process (damaged entries, full and read-only disks:
test_faults_engine.py).
Each engine runs in its own process (kvlab.runtime.engine)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvlab.runtime.engine import EngineSpec, run_engine, same_outputs  # noqa: E402

pytestmark = pytest.mark.slow  # starts engines, servers or notebook kernels


def hits(result: dict, phase: str) -> list[int]:
    return [row["cached_tokens"] for row in result["phases"][phase]]


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole-step", "layerwise"])
def test_second_run_is_served_from_the_connector_and_identical(smollm2, prompts, layerwise) -> None:
    spec = EngineSpec(smollm2, "kvlab", {"layerwise": layerwise, "chunk_size": 64}, dtype="float32", max_tokens=8)
    result = run_engine(spec, prompts)
    assert hits(result, "cold") == [0, 0]
    # every full block but the one holding the last prompt token comes from the connector
    assert hits(result, "warm") == [(len(p) - 1) // 32 * 32 for p in prompts]
    agreement = same_outputs(result, result)
    assert agreement["identical"] == 2 and agreement["max_logprob_diff"] == 0.0  # fp32: bitwise
    stats = result["connector"]["default"]
    assert stats["loaded_blocks"] == sum((len(p) - 1) // 32 for p in prompts)
    assert stats["layout"] == "CPU_LBHNC" and stats["load_errors"] == 0


def test_disk_store_serves_a_new_process(smollm2, prompts, tmp_path: Path) -> None:
    extra = {"store": "disk", "disk_path": str(tmp_path / "store")}
    first = run_engine(EngineSpec(smollm2, "kvlab", extra, dtype="float32", max_tokens=8, phases=("cold",)), prompts)
    second = run_engine(EngineSpec(smollm2, "kvlab", extra, dtype="float32", max_tokens=8, phases=("warm",)), prompts)
    assert min(hits(second, "warm")) > 0 and second["connector"]["default"]["store"]["disk_reads"] > 0
    agreement = same_outputs(first, second, "cold", "warm")
    assert agreement["identical"] == 2 and agreement["max_logprob_diff"] == 0.0
