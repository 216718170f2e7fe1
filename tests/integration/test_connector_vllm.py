"""KVLabConnector inside vLLM's CPU engine with a real trained model (SmolLM2-135M, fp32):
the second run of a prompt is served from the connector and changes nothing, in vLLM's
default process layout (scheduler and worker in different processes; one process, layerwise
and the hooks, per-layer and cross-layer: test_backend_engine.py);
other engines in other processes hit through shared memory, a real 3-node Redis Cluster and
a real Mooncake Store, and survive a cluster node and then Mooncake's master dying; tensor-parallel ranks each keep their own shard, and a load that fails its check
is recomputed with the same tokens (damaged entries, full and read-only disks:
test_faults_engine.py). Each engine runs in its own process (kvlab.harness.engine)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import bitwise, hits, loadable, prepared, within_split_drift

pytest.importorskip("vllm")

from kvlab.harness.compare import SPLIT_DRIFT, same_outputs  # noqa: E402
from kvlab.harness.engine import EngineSpec, run_engine  # noqa: E402
from kvlab.runtime.models import TINY_LLAMA, model_path  # noqa: E402
from kvlab.runtime.mooncake import MooncakeStore  # noqa: E402

# starts engines or servers; one of the extended engine suite (`make test-extended`, CI runs it)
pytestmark = [pytest.mark.slow, pytest.mark.extended]
# Each engine also keeps vLLM's prefix cache: its "control" phase (vLLM's own prefix hit, the
# prefill split as the connector's hit splits it) is the control the connector's "warm" phase
# must equal bitwise; "warm" empties vLLM's cache first, so only the connector can hit.
CONTROLLED = ("cold", "control", "warm")


def test_vllms_default_processes_serve_repeats_and_other_engines_hit(smollm2, prompts, tmp_path: Path,
                                                                     redis_cluster) -> None:
    """Engine A, in vLLM's default process layout (scheduler and worker apart), serves its
    repeats from memory and writes through to a shared-memory folder, a real 3-node Redis
    Cluster and a real Mooncake Store (its master and a segment process); engine B, another
    process on this host, reads the shared memory only; engine C, standing in for another
    host, reads the cluster, then Mooncake. Every warm run hits every loadable block and
    generates bitwise what A computed. Then, as crashes would, the cluster's seed node dies
    under C (what it held is read from Mooncake instead: every block still hits, bitwise),
    then Mooncake's master too (only that node's chunks miss: tokens within the split drift
    of A's cold run). No request waits 10 s, nor, with the master dead, more than twice what A's
    cold requests or C's with the node dead take (Mooncake's client blocked 4-9 s in each call to
    a dead master: issue 42). Tier-level faults (a full segment, a damaged
    chunk, a store down at start-up, a dead node counted): tests/store/test_mooncake_tier.py,
    tests/store/test_redis_cluster_tier.py and tests/connector/test_cluster_deployed.py."""
    shm = str(tmp_path / "shm")
    common = {"dtype": "float32", "max_tokens": 8, "multiprocessing": True}
    with MooncakeStore(segment_mb=256, log_dir=tmp_path) as mooncake:  # its own: C kills its master
        writer = {"tiers": ["memory", "shm", "redis", "mooncake"], "shm": {"path": shm},
                  "redis": {"url": redis_cluster.url}, "mooncake": {"url": mooncake.url}, "chunk_size": 64}
        first = run_engine(EngineSpec(smollm2, "kvlab", writer, prefix_caching=True, phases=CONTROLLED, **common),
                           prompts)
        assert hits(first, "cold") == [0, 0] and hits(first, "warm") == hits(first, "control") == loadable(prompts)
        assert bitwise(first, first, "control", "warm") and within_split_drift(first, first, "cold", "warm")
        stats = first["connector"]["default"]
        assert stats["loaded_blocks"] == sum(hit // 32 for hit in loadable(prompts))
        assert stats["save_errors"] == 0 and any(Path(shm).iterdir()) and mooncake.keys() > 0
        assert all(count > 0 for count in redis_cluster.keys_per_node()), "the chunks spread over every node"
        shared = run_engine(EngineSpec(smollm2, "kvlab", {"tiers": ["shm"], "shm": {"path": shm}}, phases=("warm",),
                                       **common), prompts)
        remote = {"tiers": ["redis", "mooncake"], "redis": {"url": redis_cluster.url},
                  "mooncake": {"url": mooncake.url}}
        other = run_engine(EngineSpec(smollm2, "kvlab", remote, phases=("warm", "warm-redis-down", "warm-mooncake-down"),
                                      **common), prompts)
    for engine, tier in ((shared, "shm"), (other, "redis")):
        assert hits(engine, "warm") == loadable(prompts), tier
        assert bitwise(first, engine, "warm", "warm"), tier  # both load the same prefix: the same split
    assert shared["connector"]["default"]["store"]["shm_reads"] > 0
    # the cluster's seed node dies: what it held comes from Mooncake, every block still hits
    assert hits(other, "warm-redis-down") == loadable(prompts) and bitwise(first, other, "warm", "warm-redis-down")
    store = other["connector"]["default"]["store"]
    assert store["redis_reads"] > 0 and store["mooncake_reads"] > 0
    # then Mooncake's master: only the dead node's chunks miss, and are recomputed
    assert sum(hits(other, "warm-mooncake-down")) < sum(loadable(prompts))
    assert within_split_drift(first, other, "cold", "warm-mooncake-down")
    waited = {phase: max(row["seconds"] for row in engine["phases"][phase])
              for engine, phase in ((first, "cold"), (other, "warm-redis-down"), (other, "warm-mooncake-down"))}
    assert max(waited.values()) < 10, waited
    # with the master dead a request recomputes what it cannot load: no more than A's cold requests compute
    assert waited["warm-mooncake-down"] <= 2 * max(waited["cold"], waited["warm-redis-down"]), waited


def test_tensor_parallel_sizes_share_one_disk_folder_and_a_failed_load_is_recomputed(tmp_path: Path) -> None:
    """TP=2 on this CPU (one core per rank), the tiny Llama (2 kv heads: one per rank; SmolLM2-135M's
    3 split over no 2 ranks). A TP=2 engine's ranks each store and load their own shard, bitwise
    vLLM's own prefix hit; then every rank's chunks in memory are zeroed and checked on every
    read: the loads fail their checks, vLLM recomputes those blocks (kv_load_failure_policy
    "recompute") and the tokens are the cold run's. A TP=1 and a TP=2 engine then read each
    other's disk folders: each rank of a TP=2 engine loads its head out of what TP=1 stored, and
    a TP=1 engine gathers both ranks' shards of what TP=2 stored; every loadable block, no load
    error. TP changes the order of reductions, so not bitwise: the tokens are each size's own,
    and every chosen-token logprob is within the gap vLLM itself shows between TP=1 and TP=2 on
    these prompts (neither hit), plus the split drift of a hit's suffix-only prefill
    (kvlab.harness.compare.SPLIT_DRIFT)."""
    model = str(model_path(prepared(TINY_LLAMA)))
    prompts = [list(range(5, 205)), list(range(300, 470))]

    def engine(workers: int, folder: str, **options) -> dict:
        extra = {"tiers": ["memory", "disk"], "disk": {"path": str(tmp_path / folder)}, **options.pop("extra", {})}
        return run_engine(EngineSpec(model, "kvlab", extra, dtype="float32", max_tokens=8,
                                     tensor_parallel_size=workers, **{"phases": ("cold",), **options}), prompts)

    own = engine(2, "by-tp2", extra={"verify": "always"}, prefix_caching=True, phases=(*CONTROLLED, "warm-zeroed"))
    assert hits(own, "warm") == hits(own, "control") == loadable(prompts)
    assert bitwise(own, own, "control", "warm") and within_split_drift(own, own, "cold", "warm")
    ranks = [r["default"] for r in own["ranks"]]
    assert len(ranks) == 2 and all(r["loaded_blocks"] >= sum(loadable(prompts)) // 32 for r in ranks)
    assert all(r["load_errors"] > 0 and r["store"]["corrupt"] > 0 for r in ranks), "zeroed chunks failed the check"
    # every block failed, so vLLM recomputed each prompt whole: the cold run's split, bitwise
    assert bitwise(own, own, "cold", "warm-zeroed"), "recomputed, not loaded"

    alone = {1: engine(1, "by-tp1"), 2: own}  # first sight: nothing to hit
    shared = {2: engine(2, "by-tp1"), 1: engine(1, "by-tp2")}  # each reads the other size's folder
    assert hits(alone[1], "cold") == hits(alone[2], "cold") == [0, 0]
    gap = same_outputs(alone[1], alone[2], "cold", "cold")["max_logprob_diff"]
    for workers, result in shared.items():
        assert hits(result, "cold") == loadable(prompts), workers
        assert all(rank["default"]["load_errors"] == 0 for rank in result["ranks"]), workers
        for size, reference in alone.items():
            agreement = same_outputs(reference, result, "cold", "cold")
            assert agreement["identical"] == len(prompts), (workers, size)
            assert agreement["max_logprob_diff"] <= gap + SPLIT_DRIFT, (workers, size, agreement, gap)


ARCHITECTURE_PROMPTS = [list(range(5, 205)), list(range(300, 470))]
MLA = pytest.mark.xdist_group("mla-control")  # both MLA cases on one worker: one control engine


@pytest.fixture(scope="module")
def mla_control(tmp_path_factory) -> dict:
    """The control for MLA on CPU, where vLLM has no prefix caching: its ExampleConnector,
    whose warm prefill is split as KVLabConnector's is."""
    spec = EngineSpec(str(model_path(prepared("mini-deepseek-v2"))), "example", {}, dtype="float32", block_size=16,
                      max_tokens=8, attention_backend="CPU_MLA", workdir=str(tmp_path_factory.mktemp("example")),
                      max_num_batched_tokens=4096)
    control = run_engine(spec, ARCHITECTURE_PROMPTS)
    assert hits(control, "warm") == loadable(ARCHITECTURE_PROMPTS, 16)
    return control


@pytest.mark.parametrize("name, layerwise", [("mini-qwen2", False), ("mini-qwen3-moe", True),
                                             pytest.param("mini-deepseek-v2", False, marks=MLA),
                                             pytest.param("mini-deepseek-v2", True, marks=MLA)])
def test_every_seed_architecture_through_the_connector(name, layerwise, tmp_path: Path, request) -> None:
    """The seeds' other architectures (Llama: above), as seeded random miniatures with each
    one's real KV geometry: Qwen2, Qwen3-MoE, and DeepSeek-V2 with MLA on vLLM's CPU_MLA
    backend (block size 16), all asking for cross-layer blocks as the seed does: the K/V ones
    get vLLM's block-major buffer (kvlab's backend; layerwise through the Ascend-style hooks),
    MLA stays layer-major. Every warm run, from memory and (MLA) from disk in the same
    process, hits every loadable block and is bitwise its same-split control: vLLM's own
    prefix hit, or for MLA (no prefix caching for MLA on CPU) vLLM's ExampleConnector; and
    within the split's drift of the cold run."""
    mla = name == "mini-deepseek-v2"
    block_size = 16 if mla else 32
    extra = {"layerwise": layerwise, "hooks": layerwise and not mla, "enable_cross_layers_blocks": True,
             "chunk_size": 64, "store": "disk", "disk": {"path": str(tmp_path / "kv")}}
    spec = EngineSpec(str(model_path(prepared(name))), "kvlab", extra, dtype="float32", block_size=block_size,
                      max_tokens=8, phases=("cold", "warm", "warm-disk") if mla else CONTROLLED,
                      prefix_caching=not mla, attention_backend="CPU_MLA" if mla else None)
    result = run_engine(spec, ARCHITECTURE_PROMPTS)
    control, control_phase = (request.getfixturevalue("mla_control"), "warm") if mla else (result, "control")
    for phase in ("warm", "warm-disk") if mla else ("warm",):
        assert hits(result, phase) == loadable(ARCHITECTURE_PROMPTS, block_size), phase
        assert bitwise(control, result, control_phase, phase), phase
        assert within_split_drift(result, result, "cold", phase), phase
    stats = result["connector"]["default"]
    assert stats["load_errors"] == 0 and stats["save_errors"] == 0
    assert stats["layout"] == ("mla_v0.29" if mla else "CPU_BLHNC"), "named for what vLLM handed over"
    if mla:
        assert stats["store"]["disk_reads"] > 0
