"""Engine runs and time-to-first-token tables refuse bad input before any engine starts."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvlab.harness.engine import EngineSpec, run_engine  # noqa: E402


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


def test_the_engine_layout_runs_refuse_bad_input(tmp_path: Path) -> None:
    from kvlab.experiments.tasks import book_prompts
    from kvlab.experiments.ttft import layouts_in_the_engine
    from kvlab.runtime.redis import RedisServer

    with pytest.raises(ValueError, match=r"unknown layouts or modes \['LBNHC'\]"):
        layouts_in_the_engine(str(tmp_path), [[1, 2]], None, layouts=("LBNHC",))
    with pytest.raises(ValueError, match=r"unknown layouts or modes \['sideways'\]"):
        layouts_in_the_engine(str(tmp_path), [[1, 2]], None, modes=("sideways",))
    with pytest.raises(ValueError, match="databases 0 to 15"):
        RedisServer(log_path=tmp_path / "r.log").database(16)
    with pytest.raises(ValueError, match="would overlap"):
        book_prompts(str(tmp_path), 2, 3000)


def test_engine_settings_that_cannot_work_are_refused_before_any_engine(tmp_path: Path) -> None:
    from kvlab.experiments.ttft import layouts_in_the_engine

    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(ValueError, match=r"kv_cache_layout must be one of vLLM's \['LBHNC'.*got 'BLHND'"):
        run_engine(EngineSpec(str(tmp_path), kv_cache_layout="BLHND"), [[1, 2, 3]])
    with pytest.raises(ValueError, match="redis must be a running kvlab.runtime.redis.RedisServer, got str"):
        layouts_in_the_engine(str(tmp_path), [[1, 2]], "redis://127.0.0.1:6379/0")


def test_book_passages_from_a_starting_token(smollm2: str) -> None:
    """Notebook 05's decode prompts: passages further into the book, ``stride`` apart."""
    from transformers import AutoTokenizer

    from kvlab.experiments.tasks import book_prompts, book_text

    ids = AutoTokenizer.from_pretrained(smollm2)(book_text())["input_ids"]
    assert book_prompts(smollm2, 2, 50, stride=60, start=1000) == [ids[1000:1050], ids[1060:1110]]
    with pytest.raises(ValueError, match=r"too short for 2 passages of 50 from"):
        book_prompts(smollm2, 2, 50, stride=60, start=len(ids) - 80)
    with pytest.raises(ValueError, match="start from 0"):
        book_prompts(smollm2, 2, 50, stride=60, start=-100)
