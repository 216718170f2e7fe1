"""Two engines of other layouts sharing one store, in time to first token: a per-layer
(LBHNC) and a cross-layer (BLHNC) engine each read, from one shared-memory folder, a prompt
an engine of its own layout stored (the chunk as it lies) and one the other layout stored
(converted as it loads), each hit followed by the same engine's own prefix hit (the floor).
What converting costs at the connector's calls alone: hit_costs.layouts_sharing. Notebook 04."""

from __future__ import annotations

import shutil
import statistics
import uuid
from pathlib import Path

from kvlab.harness.compare import one_prompt, same_outputs
from kvlab.harness.engine import EngineSpec, check_inputs, run_engine
from kvlab.runtime.models import geometry_of
from kvlab.runtime.progress import progress

LAYOUTS = ("LBHNC", "BLHNC")  # the first prompt's writer, then the second's


def engines_sharing_a_store(model: str, prompts: list[list[int]], dtype: str = "bfloat16", block_size: int = 32,
                            repeats: int = 9, shm_root: str | Path = "/dev/shm") -> list[dict]:
    """``prompts``: one per layout of LAYOUTS, all of one length. An engine of each layout
    computes its prompt and stores it in one shm folder (its "control" phase: vLLM's own
    prefix hit on that KV, the same prefill split as a hit's). Then a new engine of each
    layout, the shm tier its only tier, reads both prompts, alternating a connector hit
    ("warm": vLLM's prefix cache emptied first) and the floor ``repeats`` times each, after
    one such pair per prompt that is not kept (an engine's first requests warm it up). One row
    per reader and prompt: ``stored_as`` (the writer's layout), the medians, the overhead
    (median of the paired warm - floor, every pair in ``overhead_samples_s``) and the
    outputs against the writer's control (bitwise expected: layouts only order the bytes)."""
    check_inputs(model, prompts)
    if len(prompts) != len(LAYOUTS) or len({len(p) for p in prompts}) != 1:
        raise ValueError(f"need {len(LAYOUTS)} prompts of one length (one per writer: {LAYOUTS}), "
                         f"got lengths {[len(p) for p in prompts]}")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    folder = Path(shm_root) / f"kvlab-sharing-{uuid.uuid4().hex[:12]}"
    common = {"model": model, "connector": "kvlab", "dtype": dtype, "block_size": block_size, "prefix_caching": True,
              "max_model_len": len(prompts[0]) + 1}

    def spec(layout: str, phases: tuple[str, ...]) -> EngineSpec:
        extra = {"tiers": ["shm"], "shm": {"path": str(folder)}, "enable_cross_layers_blocks": layout == "BLHNC"}
        return EngineSpec(**common, extra=extra, phases=phases)

    plans = [("writer", layout, spec(layout, ("cold", "control")), [prompt])
             for layout, prompt in zip(LAYOUTS, prompts)]
    plans += [("reader", layout, spec(layout, ("warm", "floor") * (repeats + 1)), prompts) for layout in LAYOUTS]
    try:
        results = {(role, layout): run_engine(engine, given)
                   for role, layout, engine, given in progress(plans, desc="engines sharing a store", unit="engine")}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    token_bytes = geometry_of(model, dtype=dtype, block_size=block_size).token_bytes
    rows = []
    for reader in LAYOUTS:
        result = results["reader", reader]
        for index, stored_as in enumerate(LAYOUTS):
            mine = one_prompt(result, prompt=index)
            mine = {"phases": {phase: runs[1:] for phase, runs in mine["phases"].items()}}  # its first pair warmed up
            warm = [r["seconds"] for r in mine["phases"]["warm"]]
            floor = [r["seconds"] for r in mine["phases"]["floor"]]
            paired = [w - f for w, f in zip(warm, floor)]
            cached = min(r["cached_tokens"] for r in mine["phases"]["warm"])
            control = same_outputs(results["writer", stored_as], mine, "control", "warm")
            rows.append({"layout": reader, "stored_as": stored_as, "converted": reader != stored_as, "tier": "shm",
                         "model": Path(model).name, "dtype": dtype, "prompt_tokens": len(prompts[index]),
                         "cached_tokens": cached, "kv_bytes": int(cached * token_bytes), "samples": len(paired),
                         "warm_s": statistics.median(warm), "floor_s": statistics.median(floor),
                         "overhead_s": statistics.median(paired), "overhead_samples_s": paired,
                         "identical_to_control": control["identical"],
                         "logprob_diff_vs_control": control["max_logprob_diff"],
                         "loaded_blocks": result["connector"]["default"]["loaded_blocks"]})
    return rows
