"""Run vLLM's CPU engine with and without KV connectors, one engine per process, and time
the first token.

Each engine runs in a fresh Python process (``python -m kvlab.engine``), so connector
stores, compile caches and thread bindings never leak between the things compared, and
"a new process" is literally one. Every engine is pinned to the same thread count (on a
2-core machine vLLM otherwise reserves a second core when a connector is configured and
runs the model on a different number of threads). Imports vLLM only in the child process.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

# Same threads for every engine compared (see the class docstring).
PINNED_ENV = {
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

CONNECTORS = ("none", "kvlab", "example", "lmcache")
# Seconds LMCacheMPConnector waits for each reply of its server (its default, 300, turns a
# dead server into a hang of minutes; after this it recomputes, see kvlab.lmcache).
LMCACHE_MQ_TIMEOUT = 10.0


def kv_transfer_config(connector: str, extra: dict[str, Any] | None = None, workdir: str | Path | None = None) -> dict | None:
    """The ``kv_transfer_config`` of an engine: KVLabConnector, vLLM's ExampleConnector
    (files under ``workdir``), LMCacheMPConnector or none.

    For "lmcache", ``extra`` is ``{"port": P}``, the port of the ``lmcache server`` on
    127.0.0.1 (kvlab.lmcache.LMCacheServer runs one and gives this dict); its other keys
    are LMCacheMPConnector options without their "lmcache.mp." prefix ("mq_timeout"
    defaults to LMCACHE_MQ_TIMEOUT).
    """
    if connector not in CONNECTORS:
        raise ValueError(f"connector must be one of {list(CONNECTORS)}, got {connector!r}")
    if connector == "none":
        return None
    if connector == "lmcache":
        options = {"mq_timeout": LMCACHE_MQ_TIMEOUT, **(extra or {})}
        if "port" not in options:
            raise ValueError("the lmcache connector needs the LMCache server's port: extra={'port': P} "
                             "(kvlab.lmcache.LMCacheServer.engine_extra gives it)")
        port = int(options.pop("port"))
        return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",  # vLLM's default fails the request
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port,
                                              **{f"lmcache.mp.{key}": value for key, value in options.items()}}}
    if connector == "kvlab":
        return {"kv_connector": "KVLabConnector", "kv_connector_module_path": "kvlab.connector",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",  # a failed load is recomputed
                "kv_connector_extra_config": dict(extra or {})}
    if workdir is None:
        raise ValueError("ExampleConnector needs a workdir for its files")
    return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(workdir), **(extra or {})}}


@dataclass
class EngineSpec:
    """One engine and what to run on it: each phase sends every prompt once, in order.

    Phases: "cold" (first sight), "floor" (again, served by vLLM's own prefix cache:
    nothing moves), "warm" (vLLM's prefix cache emptied before each prompt when it is on,
    so the prefix can only come from the connector), "warm-disk" (also the connector's
    in-memory tier emptied, so KV comes from disk). "cold" runs every prompt first; the
    other phases then run in order for one prompt after another. A phase named more than
    once is repeated and its rows pooled; alternating "floor" and "warm" pairs each
    connector sample with a floor sample of the same prompt in the same engine.
    "warm-zeroed" runs after everything else: KVLabConnector's in-memory chunks are
    zeroed first, so its outputs show whether a check is sensitive to the reloaded KV.

    ``batch`` sends all prompts of a phase in one call (task runs: faster, and no
    per-prompt timing); ``max_num_batched_tokens`` at least the batch's prompt tokens
    prefills it in one step (vLLM's ExampleConnector stores a request's first prefill
    chunk under the whole prompt's key, so chunked prefills break its loads). ``stop``
    ends generations at these strings. ``lora_adapters`` (name -> adapter folder) turns
    LoRA on; :func:`run_engine`'s ``loras`` picks one per prompt.
    """

    model: str
    connector: str = "none"
    extra: dict[str, Any] = field(default_factory=dict)
    prefix_caching: bool = False
    phases: tuple[str, ...] = ("cold", "warm")
    dtype: str = "bfloat16"
    block_size: int = 32
    max_tokens: int = 1
    max_model_len: int = 4096
    workdir: str | None = None
    batch: bool = False
    stop: tuple[str, ...] = ()
    max_num_batched_tokens: int | None = None
    lora_adapters: dict[str, str] = field(default_factory=dict)


def check_inputs(model: str | Path, prompts: list[list[int]]) -> None:
    """A clear error, before any engine starts, for a missing model folder or no prompts."""
    if not prompts or not all(prompts):
        raise ValueError("need at least one non-empty prompt")
    if not (Path(model) / "config.json").exists():
        raise FileNotFoundError(f"no model folder at {model} (a folder with config.json; "
                                "kvlab.models.model_path gives the prepared ones)")


def run_engine(spec: EngineSpec, prompts: list[list[int]], timeout: float = 900,
               forced: list[list[int] | None] | None = None, salts: list[str | None] | None = None,
               loras: list[str | None] | None = None) -> dict:
    """Start ``spec`` in a new process, run its phases over ``prompts`` (token ids) and
    return per-phase, per-prompt first-token times, outputs, cache hits, the time the
    model runner spent inside the connector, and connector stats.

    ``forced[i]``, when given, makes prompt i a scoring request: the engine is made to
    emit exactly those tokens (teacher forcing) and reports each one's logprob under the
    raw model, computed on top of whatever KV the prompt's prefix got: vLLM's
    ``prompt_logprobs`` cannot do this, it skips cached prefixes.

    ``salts[i]`` is prompt i's ``cache_salt`` (vLLM's per-tenant prefix-cache isolation),
    ``loras[i]`` the name of one of ``spec.lora_adapters`` to run prompt i with."""
    check_inputs(spec.model, prompts)
    for name, values in (("salts", salts), ("loras", loras)):
        if values is not None and len(values) != len(prompts):
            raise ValueError(f"{name} needs one entry per prompt (None for none)")
    unknown = {name for name in loras or () if name is not None} - set(spec.lora_adapters)
    if unknown:
        raise ValueError(f"loras names adapters {sorted(unknown)} that spec.lora_adapters does not have")
    if forced is not None and (len(forced) != len(prompts) or any(f is not None and not f for f in forced)):
        raise ValueError("forced needs one entry per prompt: a non-empty token list or None")
    if max(map(len, prompts)) + max(len(f or ()) for f in (forced or [None])) + spec.max_tokens > spec.max_model_len:
        raise ValueError(f"a prompt of {max(map(len, prompts))} tokens plus its output does not fit in "
                         f"max_model_len={spec.max_model_len}")
    return run_child("kvlab.engine", {"spec": asdict(spec), "prompts": prompts, "forced": forced,
                                      "salts": salts, "loras": loras},
                     f"engine {spec.connector} on {spec.model}", timeout)


def run_child(module: str, job: dict, what: str, timeout: float, env: dict[str, str] | None = None) -> dict:
    """Run ``python -m module job.json out.json`` with the pinned environment (plus
    ``env``) and return the JSON it wrote; a failure quotes the end of its output."""
    with tempfile.TemporaryDirectory() as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_path.write_text(json.dumps(job))
        proc = subprocess.run([sys.executable, "-m", module, str(job_path), str(out_path)],
                              env={**os.environ, **PINNED_ENV, **(env or {})}, capture_output=True, text=True,
                              timeout=timeout)
        if proc.returncode != 0 or not out_path.exists():
            tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-25:])
            raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{tail}")
        return json.loads(out_path.read_text())


def _forced_tokens_processor() -> type:
    """A vLLM logits processor that makes a request emit ``extra_args["forced_tokens"]``.
    Everything else is masked after vLLM has taken the raw logprobs (its default
    ``logprobs_mode``), so each reported logprob is the model's own for that token."""
    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

    class ForcedTokens(AdapterLogitsProcessor):
        def is_argmax_invariant(self) -> bool:
            return False

        def new_req_logits_processor(self, params):
            tokens = (params.extra_args or {}).get("forced_tokens")
            if not tokens:
                return None

            def force(output_ids: list[int], logits):
                step = len(output_ids)
                if step < len(tokens):
                    logits[:] = float("-inf")
                    logits[tokens[step]] = 0.0
                return logits
            return force

    return ForcedTokens


class _ConnectorClock:
    """Seconds the model runner spends inside the connector's worker-side calls (loads:
    ``start_load_kv``, ``wait_for_layer_load``; saves: ``save_kv_layer``,
    ``wait_for_save``), whatever the connector class: what a forward pass pays for it."""

    CALLS = {"start_load_kv": "load_s", "wait_for_layer_load": "load_s",
             "save_kv_layer": "save_s", "wait_for_save": "save_s"}

    def __init__(self, transfer: dict | None) -> None:
        self.seconds = {"load_s": 0.0, "save_s": 0.0}
        if transfer is None:
            return
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        cls = KVConnectorFactory.get_connector_class(KVTransferConfig(**transfer))
        for name, bucket in self.CALLS.items():
            setattr(cls, name, self._timed(getattr(cls, name), bucket))

    def _timed(self, method, bucket: str):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[bucket] += time.perf_counter() - start
        return timed

    def read(self) -> dict[str, float]:
        """The seconds since the last read."""
        spent, self.seconds = self.seconds, {"load_s": 0.0, "save_s": 0.0}
        return spent


# Phases run before (cold) and after (warm-zeroed) the prompt-by-prompt ones.
FIRST_PHASES, LAST_PHASES = ("cold",), ("warm-zeroed",)


def _schedule(phases: tuple[str, ...], prompts: int, batch: bool) -> list[tuple[str, list[int]]]:
    """(phase, prompt indices) per generate call, in order. "cold" sees every prompt
    first and "warm-zeroed" comes last; the others run prompt by prompt, so a "floor"
    right after a warm run of the same prompt really is vLLM's own prefix hit (emptying
    vLLM's prefix cache for one prompt's warm run empties it for all)."""
    every = list(range(prompts))
    firsts = [p for p in phases if p in FIRST_PHASES]
    middle = [p for p in phases if p not in FIRST_PHASES + LAST_PHASES]
    lasts = [p for p in phases if p in LAST_PHASES]
    if batch:
        return [(phase, every) for phase in firsts + middle + lasts]
    return ([(phase, [i]) for phase in firsts for i in every]
            + [(phase, [i]) for i in every for phase in middle]
            + [(phase, [i]) for phase in lasts for i in every])


def run_any_engine(spec: EngineSpec, prompts: list[list[int]], lmcache: Any = None, **options: Any) -> dict:
    """:func:`run_engine`, or for the "lmcache" connector kvlab.lmcache.run_engine on the
    ``lmcache`` server (checked before the engine starts; a dead server is named)."""
    if spec.connector != "lmcache":
        return run_engine(spec, prompts, **options)
    if lmcache is None:
        raise ValueError("the lmcache connector needs a running kvlab.lmcache.LMCacheServer")
    from kvlab.lmcache import run_engine as run_on_server

    return run_on_server(lmcache, spec, prompts, **options)


def _child(job_path: str, out_path: str) -> None:
    """The engine process: build the LLM, run the phases, write JSON."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from kvlab.connector import drop_memory_tiers, zero_memory_tiers

    job = json.loads(Path(job_path).read_text())
    spec = EngineSpec(**{**job["spec"], "stop": tuple(job["spec"]["stop"])})
    forced = job.get("forced") or [None] * len(job["prompts"])
    salts = job.get("salts") or [None] * len(job["prompts"])
    loras = [_lora_request(spec, name) for name in job.get("loras") or [None] * len(job["prompts"])]
    if "floor" in spec.phases and not spec.prefix_caching:
        raise ValueError("the floor phase needs prefix caching on")
    transfer = kv_transfer_config(spec.connector, spec.extra, spec.workdir)
    if spec.connector == "lmcache":
        from kvlab.lmcache import fix_vllm_cpu_kernel_scan

        fix_vllm_cpu_kernel_scan()
    clock = _ConnectorClock(transfer)
    llm = LLM(model=spec.model, dtype=spec.dtype, block_size=spec.block_size, enforce_eager=True,
              enable_prefix_caching=spec.prefix_caching, max_model_len=spec.max_model_len, seed=0,
              max_num_batched_tokens=spec.max_num_batched_tokens, **_lora_options(spec),
              kv_transfer_config=KVTransferConfig(**transfer) if transfer else None,
              logits_processors=[_forced_tokens_processor()] if any(forced) else None)

    def params(tokens: list[int] | None) -> SamplingParams:
        if tokens:
            return SamplingParams(max_tokens=len(tokens), temperature=0.0, logprobs=0, ignore_eos=True,
                                  extra_args={"forced_tokens": tokens})
        return SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, logprobs=1, stop=list(spec.stop) or None)

    llm.generate([{"prompt_token_ids": [1, 2, 3]}], params(None), use_tqdm=False)  # warm-up, no shared prefix
    clock.read()
    result: dict[str, Any] = {"phases": {}}
    for phase, indices in _schedule(spec.phases, len(job["prompts"]), spec.batch):
        if phase == "warm-disk":
            drop_memory_tiers()
        if phase == "warm-zeroed":
            zero_memory_tiers()
        if phase.startswith("warm") and spec.prefix_caching:
            llm.reset_prefix_cache()  # vLLM's own copy goes; the connector's store stays
        start = time.perf_counter()
        requests = [{"prompt_token_ids": job["prompts"][i], **({"cache_salt": salts[i]} if salts[i] else {})}
                    for i in indices]
        outputs = llm.generate(requests, [params(forced[i]) for i in indices], use_tqdm=False,
                               lora_request=[loras[i] for i in indices] if spec.lora_adapters else None)
        seconds = time.perf_counter() - start
        spent = clock.read()
        for index, output in zip(indices, outputs):
            completion = output.outputs[0]
            result["phases"].setdefault(phase, []).append({
                "prompt": index, "seconds": seconds, "prompt_tokens": len(job["prompts"][index]),
                "cached_tokens": output.num_cached_tokens or 0, **spent,
                "token_ids": list(completion.token_ids),
                "logprobs": [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)],
            })
    if spec.connector == "kvlab":
        from kvlab.connector import all_stats

        result["connector"] = all_stats()
    Path(out_path).write_text(json.dumps(result))


def _lora_options(spec: EngineSpec) -> dict[str, Any]:
    """LLM(...) options for the spec's adapters: LoRA on, rank large enough for each."""
    if not spec.lora_adapters:
        return {}
    ranks = [json.loads((Path(path) / "adapter_config.json").read_text())["r"] for path in spec.lora_adapters.values()]
    return {"enable_lora": True, "max_lora_rank": max(8, *ranks), "max_loras": len(ranks)}


def _lora_request(spec: EngineSpec, name: str | None) -> Any:
    if name is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, list(spec.lora_adapters).index(name) + 1, spec.lora_adapters[name])


def summarize(name: str, result: dict, phase: str, **labels: Any) -> dict:
    """One table row: median, min and max first-token time of a phase over its prompts
    (and repeats)."""
    rows = result["phases"][phase]
    times = [r["seconds"] for r in rows]
    return {
        "scenario": name, "phase": phase, **labels, "samples": len(rows),
        "prompt_tokens": statistics.median(r["prompt_tokens"] for r in rows),
        "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
        "cached_tokens": statistics.median(r["cached_tokens"] for r in rows),
    }


def same_outputs(a: dict, b: dict, phase_a: str = "cold", phase_b: str = "warm") -> dict:
    """Do two runs agree, prompt by prompt: how many prompts gave identical tokens every
    time, and the largest chosen-token logprob difference."""
    reference = {row["prompt"]: row for row in a["phases"][phase_a]}
    same: dict[int, bool] = {}
    diff = 0.0
    for row in b["phases"][phase_b]:
        ref = reference[row["prompt"]]
        same[row["prompt"]] = same.get(row["prompt"], True) and row["token_ids"] == ref["token_ids"]
        diff = max([diff] + [abs(p - q) for p, q in zip(row["logprobs"], ref["logprobs"])])
    return {"identical": sum(same.values()), "prompts": len(same), "max_logprob_diff": diff}


def ttft_scenarios(model: str, prompts: list[list[int]], workdir: str | Path, dtype: str = "bfloat16",
                   block_size: int = 32, chunk_size: int | None = None,
                   modes: tuple[str, ...] = ("whole-step", "layerwise"), repeats: int = 3) -> list[dict]:
    """Time to first token, one engine per process, every engine on the same threads and
    with vLLM's prefix cache on: recompute (first sight), vLLM's own prefix-cache hit (the
    floor: the KV is in place, nothing moves), and the same prompts served through
    KVLabConnector in each of ``modes`` (memory; disk in the same process and in a new
    one; whole-step also with every memory hit checksummed) and vLLM's ExampleConnector,
    vLLM's prefix cache emptied before each of those. Every engine also records its own
    prefix-hit time between its warm runs (``engine_floor_s``: how much the engine itself
    drifts). Each warm row also says whether its outputs equal recompute's; overheads
    come from :func:`with_overheads`."""
    workdir = Path(workdir)
    common = {"model": model, "dtype": dtype, "block_size": block_size, "prefix_caching": True}
    kvlab = {"chunk_size": chunk_size} if chunk_size else {}

    def paired(*phases: str) -> tuple[str, ...]:  # each floor right after a warm run of its prompt
        return tuple(p for _ in range(repeats) for phase in phases for p in (phase, "floor"))

    plans = [("vLLM prefix cache", EngineSpec(**common, phases=("cold",) + ("floor",) * repeats),
              {"cold": "recompute", "floor": "vLLM prefix hit"})]
    for mode in modes:
        extra = {**kvlab, "layerwise": mode == "layerwise", "store": "disk", "disk_path": str(workdir / f"kvlab-{mode}")}
        plans.append((f"KVLab {mode}", EngineSpec(**common, connector="kvlab", extra=extra,
                                                  phases=("cold", *paired("warm", "warm-disk"))),
                      {"warm": f"KVLab {mode}, memory", "warm-disk": f"KVLab {mode}, disk"}))
        plans.append((f"KVLab {mode} new process", EngineSpec(**common, connector="kvlab", extra=extra,
                                                              phases=paired("warm-disk")),
                      {"warm-disk": f"KVLab {mode}, disk, new process"}))
        if mode == "whole-step":
            checked = {**kvlab, "verify": "always"}
            plans.append((f"KVLab {mode} checked", EngineSpec(**common, connector="kvlab", extra=checked,
                                                              phases=("cold", *paired("warm"))),
                          {"warm": f"KVLab {mode}, memory, CRC at every hit"}))
    plans.append(("ExampleConnector", EngineSpec(**common, connector="example", workdir=str(workdir / "example"),
                                                 phases=("cold", *paired("warm"))),
                  {"warm": "ExampleConnector"}))
    rows, results = [], {}
    for name, spec, labels in tqdm(plans, desc="engines", unit="engine"):
        results[name] = run_engine(spec, prompts)
        floor = summarize("floor", results[name], "floor")["median_s"]
        for phase, label in labels.items():
            row = summarize(label, results[name], phase, connector=spec.connector, model=Path(model).name,
                            dtype=dtype, new_process=name.endswith("new process"))
            row.update(same_outputs(results["vLLM prefix cache"], results[name], "cold", phase))
            row["engine_floor_s"] = floor
            rows.append(row)
    return with_overheads(rows)


def with_overheads(rows: list[dict]) -> list[dict]:
    """Each warm row's overhead: its median minus the floor, vLLM's own prefix-cache hit
    (the KV is in place, nothing moves) measured in the same engine between its warm runs,
    which cancels drift between engines; ``overhead_vs_plain_s`` uses the engine without a
    connector instead."""
    plain = next((r["median_s"] for r in rows if r["scenario"] == "vLLM prefix hit"), None)
    if plain is None:
        raise ValueError("these rows have no 'vLLM prefix hit' row (the floor): rows of ttft_scenarios are needed")
    return [{**r, "overhead_s": None if r["phase"] == "cold" else r["median_s"] - r.get("engine_floor_s", plain),
             "overhead_vs_plain_s": None if r["phase"] == "cold" else r["median_s"] - plain} for r in rows]


def connector_comparison(model: str, prompts: list[list[int]], workdir: str | Path, lmcache: Any = None,
                         dtype: str = "bfloat16", block_size: int = 32, repeats: int = 3) -> list[dict]:
    """KVLabConnector, LMCache (on ``lmcache``, a running kvlab.lmcache.LMCacheServer;
    skipped when None) and
    vLLM's ExampleConnector on the same prompts, each engine in its own process with vLLM's
    prefix cache on: time to first token cold (first sight: compute and store) and warm
    (vLLM's prefix cache emptied: the prefix comes from the connector), each warm sample
    paired with a floor sample (vLLM's own prefix hit in the same engine).

    Costs and throughputs, end to end as a request sees them, against the engine without a
    connector: retrieve = warm minus its floor (vLLM's own prefix hit: the KV already in
    place), store = cold minus its cold; GB/s = KV bytes served from the connector (cached
    tokens x the model's KV bytes per token) over those costs. ``floor_s`` is each engine's
    own prefix hit (a connector that slows every request shows there). Also
    the seconds the model runner blocked inside the connector (``runner_load_s``,
    ``runner_save_s``; near zero for LMCache, whose server moves KV asynchronously)."""
    from kvlab.models import geometry_of

    check_inputs(model, prompts)
    token_bytes = geometry_of(model, dtype=dtype, block_size=block_size).token_bytes
    workdir = Path(workdir)
    common = {"model": model, "dtype": dtype, "block_size": block_size, "prefix_caching": True}
    paired = ("cold",) + ("warm", "floor") * repeats
    plans = [("no connector", EngineSpec(**common, phases=("cold",) + ("floor",) * repeats))]
    plans.append(("KVLabConnector", EngineSpec(**common, connector="kvlab", phases=paired)))
    if lmcache is not None:
        plans.append(("LMCache", EngineSpec(**common, connector="lmcache", phases=paired)))
    plans.append(("ExampleConnector", EngineSpec(**common, connector="example", workdir=str(workdir / "example"), phases=paired)))
    results = {name: run_any_engine(spec, prompts, lmcache) for name, spec in tqdm(plans, desc="connectors", unit="engine")}
    plain = results["no connector"]
    rows = []
    for name, result in results.items():
        cold, floor = summarize("cold", result, "cold"), summarize("floor", result, "floor")
        row = {"connector": name, "model": Path(model).name, "dtype": dtype, "prompt_tokens": cold["prompt_tokens"],
               "cold_s": cold["median_s"], "floor_s": floor["median_s"],
               "runner_save_s": statistics.median(r["save_s"] for r in result["phases"]["cold"])}
        if "warm" in result["phases"]:
            warm = summarize("warm", result, "warm")
            row.update(warm_s=warm["median_s"], warm_min_s=warm["min_s"], warm_max_s=warm["max_s"],
                       cached_tokens=warm["cached_tokens"], kv_bytes=warm["cached_tokens"] * token_bytes,
                       runner_load_s=statistics.median(r["load_s"] for r in result["phases"]["warm"]),
                       **same_outputs(plain, result, "cold", "warm"))
        rows.append(row)
    return connector_costs(rows)


def connector_costs(rows: list[dict]) -> list[dict]:
    """What KV reuse costs a request with each connector, from rows of
    :func:`connector_comparison` (recorded rows too): ``retrieve_s`` = warm minus the
    prefix hit of the engine without a connector (the KV already in place), and the KV
    bytes served over it (``retrieve_gbps``); ``store_gbps`` = the KV bytes over the time
    the model runner blocked in the connector's save calls (``runner_save_s``: the cold
    forward's extra work; a difference of two cold prefills, ``cold_overhead_s``, is
    reported too but drowns in their noise)."""
    plain = next((r for r in rows if r["connector"] == "no connector"), None)
    if plain is None:
        raise ValueError("these rows have no 'no connector' row: rows of connector_comparison are needed")
    costed = []
    for row in rows:
        row = dict(row)
        if row.get("warm_s") is not None and row["warm_s"] == row["warm_s"]:
            retrieve = row["warm_s"] - plain["floor_s"]
            row.update(retrieve_s=retrieve, cold_overhead_s=row["cold_s"] - plain["cold_s"],
                       retrieve_gbps=row["kv_bytes"] / retrieve / 1e9 if retrieve > 0 else None,
                       store_gbps=row["kv_bytes"] / row["runner_save_s"] / 1e9 if row["runner_save_s"] > 0 else None)
        costed.append(row)
    return costed

if __name__ == "__main__":
    _child(*sys.argv[1:3])
