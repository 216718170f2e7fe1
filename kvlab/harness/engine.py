"""Run vLLM's CPU engine with and without KV connectors, one engine per process.

Each engine runs in a fresh Python process (``python -m kvlab.harness.engine``), so
connector stores, compile caches and thread bindings never leak between the things
compared, and "a new process" is literally one. Every engine is pinned to the same thread
count (kvlab.runtime.processes). Imports vLLM only in the child process."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvlab.cache.layouts import VLLM_V29_LAYOUTS
from kvlab.harness import worker_calls
from kvlab.runtime.configs import kv_transfer_config
from kvlab.runtime.processes import run_child
from kvlab.runtime.vllm_cpu import check_architecture
from kvlab.store.damage import DAMAGES


@dataclass
class EngineSpec:
    """One engine and what to run on it: each phase sends every prompt once, in order.

    Phases: "cold" (first sight), "floor" (again, served by vLLM's own prefix cache:
    nothing moves), "warm" (vLLM's prefix cache emptied before each prompt when it is on,
    so the prefix can only come from the connector), "warm-disk" (also the connector's
    in-memory tier emptied, so KV comes from disk), "control" (every prompt again right
    after "cold", before any "warm" empties vLLM's cache: vLLM's own prefix hit on the KV
    that "cold" computed, which splits each prefill as a connector's hit does, so the
    connector's "warm" must equal it bitwise). "cold" then "control" run every prompt
    first; the other phases then run in order for one prompt after another. A phase named
    more than once is repeated and its rows pooled; alternating "floor" and "warm" pairs each
    connector sample with a floor sample of the same prompt in the same engine.
    "warm-<damage>" ("warm-zeroed", "warm-noise-1pct", ... from kvlab.store.damage.DAMAGES)
    runs after everything else: KVLabConnector's in-memory chunks are damaged that way first
    (and put back after), so its outputs show how a check moves when the reloaded KV is bad.
    "warm-redis-down" runs last: the Redis server of the connector's redis tier is shut down
    first, as a crash would, so the connector must miss (or fail its loads) and recompute (of
    a Redis Cluster, the node the URL names: what it served misses, the rest hits);
    "warm-mooncake-down" the same for the Mooncake master of its mooncake tier.
    "reload-<i>" runs last too: ``reloads[i]`` is loaded into the running engine first, as an
    RL trainer loads new weights (``{"weights": folder, "how": "path" or "iterator",
    "reset": "none", "prefix" or "connector"}``: ``Worker.reload_weights`` with
    ``weights_path`` or a ``weights_iterator`` over the folder's tensors, then no reset,
    ``reset_prefix_cache()`` or ``reset_prefix_cache(reset_connector=True)``).

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
    multiprocessing: bool = False  # vLLM's default process layout (engine core and workers apart)
    tensor_parallel_size: int = 1  # > 1 implies multiprocessing: one worker process per rank
    attention_backend: str | None = None  # e.g. "CPU_MLA": on AMX CPUs vLLM picks AMX_MLA, bf16 only
    batch_invariant: bool = False  # VLLM_BATCH_INVARIANT=1: results independent of the batch (where supported)
    reloads: tuple[dict[str, str], ...] = ()  # weights loaded by the "reload-<i>" phases
    num_gpu_blocks: int | None = None  # a small KV cache (vLLM's num_gpu_blocks_override): preemptions
    max_num_seqs: int | None = None
    kv_cache_layout: str | None = None  # VLLM_KV_CACHE_LAYOUT: one of vLLM's KVCacheLayout names
    kvlab_backend: bool = True  # False: VLLM_PLUGINS="" keeps kvlab's CPU attention backend out (plain CPU_ATTN)
    record_calls: bool = False  # each row gets the connector calls of its phase ("connector_calls", call_recorder)

    def environment(self) -> dict[str, str]:
        """What the engine process needs on top of the pinned threads: vLLM's default
        process layout, and one core per tensor-parallel rank (vLLM's CPU build binds
        ranks to NUMA nodes, and a small machine has one)."""
        env = {}
        if self.multiprocessing or self.tensor_parallel_size > 1:
            # kvlab reads the workers' counters and clocks with LLM.collective_rpc(function), which
            # vLLM sends to another process only by pickle: this engine's own processes, on one host
            env.update(VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
        if self.tensor_parallel_size > 1:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(rank) for rank in range(self.tensor_parallel_size))
        if self.batch_invariant:
            env["VLLM_BATCH_INVARIANT"] = "1"
        if self.kv_cache_layout:
            env["VLLM_KV_CACHE_LAYOUT"] = self.kv_cache_layout
        if not self.kvlab_backend:
            env["VLLM_PLUGINS"] = ""
        return env


def check_inputs(model: str | Path, prompts: list[list[int]]) -> None:
    """A clear error, before any engine starts, for a missing model folder or no prompts."""
    if not prompts or not all(prompts):
        raise ValueError("need at least one non-empty prompt")
    if not (Path(model) / "config.json").exists():
        raise FileNotFoundError(f"no model folder at {model} (a folder with config.json; "
                                "kvlab.runtime.models.model_path gives the prepared ones)")


# vLLM's CPU MLA backend (vllm/v1/attention/backends/mla/cpu_mla.py) takes only this block size.
CPU_MLA_BLOCK_SIZE = 16


def _check_mla_block_size(spec: EngineSpec) -> None:
    config = json.loads((Path(spec.model) / "config.json").read_text())
    if config.get("kv_lora_rank") and spec.block_size != CPU_MLA_BLOCK_SIZE:
        raise ValueError(f"{Path(spec.model).name} is an MLA model: vLLM's CPU MLA backend needs "
                         f"block_size={CPU_MLA_BLOCK_SIZE}, not {spec.block_size}")


RELOAD_HOWS, RELOAD_RESETS = ("path", "iterator"), ("none", "prefix", "connector")


def _check_reloads(spec: EngineSpec) -> None:
    for index, reload in enumerate(spec.reloads):
        if reload.get("how") not in RELOAD_HOWS or reload.get("reset", "none") not in RELOAD_RESETS:
            raise ValueError(f"reloads[{index}] needs how in {RELOAD_HOWS} and reset in {RELOAD_RESETS}, got {reload}")
        if not (Path(reload.get("weights", "")) / "config.json").exists():
            raise FileNotFoundError(f"reloads[{index}]: no model folder at {reload.get('weights')!r}")
    named = sorted(p for p in spec.phases if p.startswith("reload-"))
    if named != sorted(f"reload-{i}" for i in range(len(spec.reloads))):
        raise ValueError(f"the reload-<i> phases {named} must name each of the {len(spec.reloads)} reloads once")


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
    _check_mla_block_size(spec)
    _check_reloads(spec)
    for name in ("num_gpu_blocks", "max_num_seqs"):
        value = getattr(spec, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
    if spec.kv_cache_layout is not None and spec.kv_cache_layout not in (*VLLM_V29_LAYOUTS, "NHD", "HND"):
        raise ValueError(f"kv_cache_layout must be one of vLLM's {list(VLLM_V29_LAYOUTS)} (or NHD, HND), "
                         f"got {spec.kv_cache_layout!r}")
    for phase in ("floor", "control"):  # vLLM's own prefix hit
        if phase in spec.phases and not spec.prefix_caching:
            raise ValueError(f"the {phase} phase needs prefix caching on (EngineSpec(prefix_caching=True))")
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
    check_architecture(spec.model)  # last: the only check that imports vLLM
    return run_child("kvlab.harness.engine", {"spec": asdict(spec), "prompts": prompts, "forced": forced,
                                              "salts": salts, "loras": loras},
                     f"engine {spec.connector} on {spec.model}", timeout, spec.environment())


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


# Phases run before (cold) and after (damaged KV, Redis down) the prompt-by-prompt ones.
DAMAGE_PHASES = {f"warm-{name}": name for name in DAMAGES}
FIRST_PHASES, LAST_PHASES = ("cold", "control"), (*DAMAGE_PHASES, "warm-redis-down", "warm-mooncake-down")


def _schedule(phases: tuple[str, ...], prompts: int, batch: bool) -> list[tuple[str, list[int]]]:
    """(phase, prompt indices) per generate call, in order. "cold" and "control" see every
    prompt first and the damaged ones come last; the others run prompt by prompt, so a "floor"
    right after a warm run of the same prompt really is vLLM's own prefix hit (emptying
    vLLM's prefix cache for one prompt's warm run empties it for all)."""
    every = list(range(prompts))
    firsts = [p for p in phases if p in FIRST_PHASES]
    middle = [p for p in phases if p not in FIRST_PHASES + LAST_PHASES and not p.startswith("reload-")]
    lasts = [p for p in phases if p in LAST_PHASES or p.startswith("reload-")]
    if batch:
        return [(phase, every) for phase in firsts + middle + lasts]
    return ([(phase, [i]) for phase in firsts for i in every]
            + [(phase, [i]) for i in every for phase in middle]
            + [(phase, [i]) for phase in lasts for i in every])


def _child(job_path: str, out_path: str) -> None:
    """The engine process: build the LLM, run the phases, write JSON."""
    job = json.loads(Path(job_path).read_text())
    spec = EngineSpec(**{**job["spec"], "stop": tuple(job["spec"]["stop"])})
    prompts = job["prompts"]
    forced = job.get("forced") or [None] * len(prompts)
    salts = job.get("salts") or [None] * len(prompts)
    loras = [_lora_request(spec, name) for name in job.get("loras") or [None] * len(prompts)]
    # KVLabConnector strict unless the spec says otherwise: a bug raises instead of recomputing
    transfer = kv_transfer_config(spec.connector, {"strict": True, **spec.extra} if spec.connector == "kvlab"
                                  else spec.extra, spec.workdir)
    llm = _llm(spec, transfer, forcing=any(forced))
    llm.collective_rpc(worker_calls.start_clock, args=(transfer,))  # in each worker, where the connector runs
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], _params(spec, None), use_tqdm=False)  # warm-up, no shared prefix
    llm.collective_rpc(worker_calls.read_clock)
    if spec.record_calls:
        llm.collective_rpc(worker_calls.start_recording)
    result: dict[str, Any] = {"phases": {}}
    counted: dict[str, float] = {}  # KVLabConnector's counters so far (each row gets its own share)
    for phase, indices in _schedule(spec.phases, len(prompts), spec.batch):
        _before_phase(llm, spec, phase, first=phase not in result["phases"])
        start = time.perf_counter()
        requests = [{"prompt_token_ids": prompts[i], **({"cache_salt": salts[i]} if salts[i] else {})} for i in indices]
        outputs = llm.generate(requests, [_params(spec, forced[i]) for i in indices], use_tqdm=False,
                               lora_request=[loras[i] for i in indices] if spec.lora_adapters else None)
        seconds = time.perf_counter() - start
        spent, counted = _after_phase(llm, spec, phase, counted)
        for index, output in zip(indices, outputs):
            completion = output.outputs[0]
            result["phases"].setdefault(phase, []).append({
                "prompt": index, "seconds": seconds, "prompt_tokens": len(prompts[index]),
                "cached_tokens": output.num_cached_tokens or 0, **spent,
                "token_ids": list(completion.token_ids),
                "logprobs": [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)],
            })
    result["kv_cache"] = llm.collective_rpc(worker_calls.kv_cache_layout)[0]
    if spec.connector == "kvlab":
        result["ranks"] = llm.collective_rpc(worker_calls.connector_stats)
        result["connector"] = result["ranks"][0]
    Path(out_path).write_text(json.dumps(result))


def _llm(spec: EngineSpec, transfer: dict | None, forcing: bool) -> Any:
    """vLLM's engine as ``spec`` says, with the connector's ``transfer`` config; ``forcing``:
    some prompt is teacher-forced (:func:`_forced_tokens_processor`)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    if spec.connector == "lmcache":
        from kvlab.runtime.vllm_cpu import fix_vllm_cpu_kernel_scan

        fix_vllm_cpu_kernel_scan()
    return LLM(model=spec.model, dtype=spec.dtype, block_size=spec.block_size, enforce_eager=True,
               enable_prefix_caching=spec.prefix_caching, max_model_len=spec.max_model_len, seed=0,
               max_num_batched_tokens=spec.max_num_batched_tokens, **_lora_options(spec),
               num_gpu_blocks_override=spec.num_gpu_blocks,
               **({"max_num_seqs": spec.max_num_seqs} if spec.max_num_seqs else {}),
               tensor_parallel_size=spec.tensor_parallel_size,
               **({"attention_backend": spec.attention_backend} if spec.attention_backend else {}),
               kv_transfer_config=KVTransferConfig(**transfer) if transfer else None,
               logits_processors=[_forced_tokens_processor()] if forcing else None)


def _params(spec: EngineSpec, tokens: list[int] | None) -> Any:
    """Greedy sampling; with ``tokens``, exactly those (teacher forcing), each one's logprob reported."""
    from vllm import SamplingParams

    if tokens:
        return SamplingParams(max_tokens=len(tokens), temperature=0.0, logprobs=0, ignore_eos=True,
                              extra_args={"forced_tokens": tokens})
    return SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, logprobs=1, stop=list(spec.stop) or None)


def _before_phase(llm: Any, spec: EngineSpec, phase: str, first: bool) -> None:
    """What ``phase`` needs before each generate call (``first``: its first): new weights,
    caches emptied, memory chunks damaged, a server shut down."""
    in_process = not (spec.multiprocessing or spec.tensor_parallel_size > 1)  # as EngineSpec.environment sets it
    if phase.startswith("reload-") and first:
        reload = spec.reloads[int(phase.split("-")[1])]
        llm.collective_rpc(worker_calls.reload_weights, args=(reload["weights"], reload["how"]))
        if reload.get("reset", "none") != "none":
            _reset(llm, in_process, reset_connector=reload["reset"] == "connector")
    if phase == "warm-disk":  # the connector forgets its memory tiers; what it wrote through stays
        _reset(llm, in_process, reset_connector=True)
    if phase in DAMAGE_PHASES:
        llm.collective_rpc(worker_calls.damage_memory, args=(DAMAGE_PHASES[phase],))
    if phase == "warm-redis-down" and first:  # once, before its first prompt
        from kvlab.runtime.redis import shut_down

        shut_down(_tier_url(spec, "redis"))
    if phase == "warm-mooncake-down" and first:
        from kvlab.runtime.mooncake import shut_down

        shut_down(_tier_url(spec, "mooncake"))
    if phase.startswith("warm") and spec.prefix_caching:
        _reset(llm, in_process)  # vLLM's own copy goes; the connector's store stays


def _after_phase(llm: Any, spec: EngineSpec, phase: str, counted: dict[str, float]
                 ) -> tuple[dict[str, Any], dict[str, float]]:
    """What the generate call spent in the workers (clocks, memory and, for KVLabConnector,
    its counters' share since ``counted``), and the counters now; damage undone."""
    if spec.connector == "kvlab":  # its saves finish now: counted with this phase, not timed in the next
        llm.collective_rpc(worker_calls.settle_saves)
    if phase in DAMAGE_PHASES:
        llm.collective_rpc(worker_calls.undo_damage)
    spent = llm.collective_rpc(worker_calls.read_clock)[0]
    spent["worker_rss_mib"] = llm.collective_rpc(worker_calls.resident_mib)[0]
    if spec.record_calls:
        spent["connector_calls"] = llm.collective_rpc(worker_calls.read_recording)[0]
    if spec.connector == "kvlab":
        ours = llm.collective_rpc(worker_calls.connector_stats)[0].get(spec.extra.get("store_name", "default"), {})
        now = {k: v for k, v in ours.items() if isinstance(v, (int, float))}
        spent["kvlab"] = {k: v - counted.get(k, 0) for k, v in now.items()}
        counted = now
    return spent, counted


def _tier_url(spec: EngineSpec, tier: str) -> str:
    """The URL of the connector's ``tier``, as its config reads it."""
    from kvlab.connector.config import ConnectorConfig

    return ConnectorConfig.parse(spec.extra).tier_settings[tier].url


def _reset(llm: Any, in_process: bool, reset_connector: bool = False, seconds: float = 60) -> None:
    """Empty vLLM's prefix cache (and the connector's memory tiers). vLLM refuses while a
    block is held, as a connector holds a finished request's blocks until its asynchronous
    saves are done, and reports them in an engine step: in one process this one steps the
    engine with nothing scheduled (a request would be held in its turn); an engine core in
    its own process keeps stepping while it holds requests, so there it waits. A refusal
    left standing would serve the "warm" run from vLLM's own cache, not the connector."""
    deadline = time.monotonic() + seconds
    while not llm.reset_prefix_cache(reset_connector=reset_connector):
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM kept refusing to empty its prefix cache for {seconds:.0f} s: blocks stay held")
        if in_process:
            llm.llm_engine.step()  # in another process's engine core this would wait for output that never comes
        time.sleep(0.01)


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


if __name__ == "__main__":
    _child(*sys.argv[1:3])
