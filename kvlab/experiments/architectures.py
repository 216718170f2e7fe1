"""Every seed architecture through vLLM's CPU engine and a KV connector: Llama (SmolLM2),
and the seeded random miniatures of Qwen2, Qwen3-MoE and DeepSeek-V2 (MLA, on vLLM's CPU_MLA
backend), each through KVLabConnector whole-step and layerwise, LMCache and a control:
vLLM's own prefix hit, or for MLA (no prefix caching on CPU) vLLM's ExampleConnector, whose
warm prefill is split the same way. Each warm run is compared with its engine's cold run
and with the control: hits, identical tokens, fp32 logprob differences (0.0: bitwise)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from kvlab.experiments.paths import Reuse
from kvlab.experiments.ttft import run_any_engine
from kvlab.harness.compare import same_outputs
from kvlab.harness.engine import CPU_MLA_BLOCK_SIZE, EngineSpec
from kvlab.runtime.models import model_path
from kvlab.runtime.progress import progress

ARCHITECTURE_MODELS = ("smollm2-135m-instruct-fp32", "mini-qwen2", "mini-qwen3-moe", "mini-deepseek-v2")
# Token ids every vocabulary has: two prompts of 200 and 170 tokens.
ARCHITECTURE_PROMPTS = [list(range(5, 205)), list(range(300, 470))]
PATHS = ("whole-step", "layerwise", "lmcache")


def _paths(mla: bool) -> list[tuple[str, str, str, dict, dict]]:
    """(name in ``paths``, label, connector, extra config, EngineSpec options) of the control,
    then of each compared path."""
    kvlab = {"chunk_size": 64}
    control = (("control", Reuse.EXAMPLE_CONNECTOR.label, "example", {}, {"max_num_batched_tokens": 4096}) if mla else
               ("control", Reuse.VLLM_PREFIX_HIT.label, "none", {}, {"prefix_caching": True, "phases": ("cold", "floor")}))
    return [control, ("whole-step", Reuse.KVLAB_WHOLE_STEP.label, "kvlab", kvlab, {}),
            ("layerwise", Reuse.KVLAB_LAYERWISE.label, "kvlab", {**kvlab, "layerwise": True}, {}),
            ("lmcache", Reuse.LMCACHE.label, "lmcache", {}, {})]


def architecture_rows(models: Sequence[str] = ARCHITECTURE_MODELS, paths: Sequence[str] = PATHS,
                      lmcache: Any = None, workdir: str | Path = ".", max_tokens: int = 8) -> list[dict]:
    """One row per model and path (the control first): ``paths`` picks among "whole-step",
    "layerwise" and "lmcache" (which needs ``lmcache``, a running LMCacheServer). An engine
    that fails fails the run: a failure is never a row."""
    unknown = set(paths) - set(PATHS)
    if unknown:
        raise ValueError(f"unknown paths {sorted(unknown)}; choose from {PATHS}")
    if "lmcache" in paths and lmcache is None:
        raise ValueError("the lmcache path needs a running kvlab.runtime.lmcache.LMCacheServer")
    rows = []
    for name in progress(models, desc="architectures", unit="model"):
        folder = model_path(name)
        config = json.loads((folder / "config.json").read_text())
        mla = bool(config.get("kv_lora_rank"))
        block_size = CPU_MLA_BLOCK_SIZE if mla else 32
        control = None
        for short, label, connector, extra, options in _paths(mla):
            if short != "control" and short not in paths:
                continue
            spec = EngineSpec(str(folder), connector, extra, dtype="float32", block_size=block_size,
                              max_tokens=max_tokens, attention_backend="CPU_MLA" if mla else None,
                              workdir=str(Path(workdir) / name / connector), **{"phases": ("cold", "warm"), **options})
            row = {"model": name, "architecture": config["architectures"][0], "attention": "MLA" if mla else "GQA",
                   "path": label}
            result = run_any_engine(spec, ARCHITECTURE_PROMPTS, lmcache)  # an engine that fails fails the run
            phase = spec.phases[-1]
            if control is None:
                control = (result, phase)
            rows.append({**row, **_compare(result, phase, control, block_size), "note": ""})
    return rows


def _compare(result: dict, phase: str, control: tuple[dict, str], block_size: int) -> dict:
    own = same_outputs(result, result, "cold", phase)
    against = same_outputs(control[0], result, control[1], phase)
    loadable = sum((len(p) - 1) // block_size * block_size for p in ARCHITECTURE_PROMPTS)
    return {"hit_tokens": sum(r["cached_tokens"] for r in result["phases"][phase]), "loadable_tokens": loadable,
            "identical": own["identical"], "prompts": own["prompts"],
            "max_logprob_diff_vs_cold": own["max_logprob_diff"],
            "identical_to_control": against["identical"], "max_logprob_diff_vs_control": against["max_logprob_diff"]}

