"""Engine runs and time-to-first-token tables refuse bad input before any engine starts."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvlab.runtime.engine import EngineSpec, run_engine  # noqa: E402


def test_engine_and_table_bad_input(tmp_path: Path) -> None:
    from kvlab.cache import preset
    from kvlab.experiments.registration import registration_costs
    from kvlab.experiments.ttft import with_overheads

    with pytest.raises(FileNotFoundError, match="no model folder"):
        run_engine(EngineSpec(str(tmp_path / "missing")), [[1, 2, 3]])
    with pytest.raises(ValueError, match="non-empty prompt"):
        run_engine(EngineSpec(str(tmp_path)), [[]])
    with pytest.raises(ValueError, match="no vLLM prefix-cache hit row"):
        with_overheads([{"scenario": "KVLab whole-step, memory", "phase": "warm", "median_s": 0.1}])
    with pytest.raises(ValueError, match="at least one block"):
        registration_costs(preset("smollm2-135m"), 8, ["vllm>=0.29 LBHNC"])


def test_an_mla_model_with_another_block_size_is_refused_before_any_engine(tmp_path: Path) -> None:
    import json

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DeepseekV2ForCausalLM"], "kv_lora_rank": 512}))
    with pytest.raises(ValueError, match="needs block_size=16, not 32"):
        run_engine(EngineSpec(str(tmp_path), block_size=32), [[1, 2, 3]])


@pytest.mark.parametrize("config, message", [
    ({"architectures": ["MambaLMHeadForCausalLMv9"]}, r"cannot run \['MambaLMHeadForCausalLMv9'\]"),
    ({"model_type": "llama"}, "names no architectures"),
])
def test_a_model_vllm_cannot_run_is_refused_before_any_engine(tmp_path: Path, config: dict, message: str) -> None:
    import json

    from kvlab.runtime.servers import VLLMServer

    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        run_engine(EngineSpec(str(tmp_path)), [[1, 2, 3]])
    with pytest.raises(ValueError, match=message):
        VLLMServer(str(tmp_path)).model_folder


def test_unknown_extra_engines_are_refused_before_any_engine(tmp_path):
    from kvlab.experiments.ttft import ttft_scenarios

    with pytest.raises(ValueError, match=r"unknown extra engines \['forked'\]; choose from \['new process', 'checked'\]"):
        ttft_scenarios("no-such-model", [[1, 2, 3]], tmp_path, extras=("checked", "forked"))
