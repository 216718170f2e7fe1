"""Shared fixtures: the trained model the engine tests run, prompts cut from the book
reasoning-gym ships, a LoRA adapter for it; ``prepared`` and ``running`` (imported by the
server tests): a model folder or a skip, and the processes left behind; ``hits``,
``loadable``, ``bitwise`` and ``within_split_drift`` (imported by the engine tests): what an
engine run hit, and how two of its phases must agree."""

import json
import os
import threading
from pathlib import Path

import pytest

# pytest-xdist workers share the cores: each worker, and what it starts (notebook kernels, the
# README's Pythons, engines), computes on its share instead of every process spinning up a
# thread per core (oversubscribed, torch's CPU ops ran several times slower)
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

# kvlab imports torch: only after the thread count above is set
from kvlab.harness.compare import SPLIT_DRIFT, same_outputs  # noqa: E402
from kvlab.results import COMMITTED_RESULTS_ENV, committed_results_dir, copy_from_git  # noqa: E402


def _data_as_committed() -> None:
    """Point kvlab.results.committed_results_dir (and :func:`committed_data`) at git's data/
    when `make run` has rewritten the working copy's (appended this machine's runs to
    data/results, redrawn data/figures, executed data/notebooks): the tests check what is
    committed, also after `make run`."""
    import subprocess
    import tempfile

    root = Path(__file__).resolve().parent.parent
    git = ["git", "-C", str(root)]
    parts = ["data/results", "data/figures", "data/notebooks"]
    try:
        changed = subprocess.run(git + ["status", "--porcelain", "--", *parts], capture_output=True,
                                 text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return  # not a git checkout: the working copy is what there is
    if not changed:
        return
    folder = Path(tempfile.mkdtemp(prefix="kvlab-committed-"))
    copy_from_git(root / "data", folder, [part.removeprefix("data/") for part in parts])
    os.environ[COMMITTED_RESULTS_ENV] = str(folder / "results")


if COMMITTED_RESULTS_ENV not in os.environ:
    _data_as_committed()


def committed_data() -> Path:
    """The committed data/ folder (results, figures, executed notebooks) as git holds it."""
    return committed_results_dir().parent


# 1 GiB of KV cache per engine (kvlab.runtime.processes.pinned_env): enough for every test's
# batch, and about 6 s less start-up per engine than the experiments' 2 GiB
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def smollm2() -> str:
    """SmolLM2-135M-Instruct in fp32 (bitwise comparisons need it); skips without vLLM or
    the prepared folder."""
    pytest.importorskip("vllm")
    from kvlab.runtime.models import model_path

    try:
        return str(model_path("smollm2-135m-instruct-fp32"))
    except FileNotFoundError as error:
        pytest.skip(str(error))


@pytest.fixture
def vllm_cpu_build():
    """vLLM's CPU build (vllm-cpu, .venv's): its CPU attention kernels and the CPU_* layouts it
    hands over. `make conformance` runs the newest vLLM's code, which is the CUDA build's."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip(f"needs vLLM's CPU build; this vLLM's platform is {type(current_platform).__name__}")


@pytest.fixture
def held_saves(monkeypatch):
    """``held_saves(worker_side)``: that worker side's saves wait until the returned event is
    set, so a test acts while they are surely still in flight (no timing involved)."""
    def hold(worker_side) -> threading.Event:
        save, release = worker_side._save, threading.Event()

        def held(spec):
            release.wait()
            save(spec)

        monkeypatch.setattr(worker_side, "_save", held)
        return release

    return hold


@pytest.fixture
def fresh_stores():
    """No connector state in this process before and after the test (stores and counters are
    per process, by store name: kvlab.connector.stores)."""
    from kvlab.connector import reset_stores

    reset_stores()
    yield
    reset_stores()


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    """The small random Llama (fast engines); skips without vLLM or the prepared folder."""
    pytest.importorskip("vllm")
    from kvlab.runtime.models import TINY_LLAMA, model_path

    try:
        return model_path(TINY_LLAMA)
    except FileNotFoundError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="session")
def prompts(smollm2: str) -> list[list[int]]:
    """Two passages of the book (300 and 250 tokens)."""
    from transformers import AutoTokenizer

    from kvlab.experiments.tasks import book_text

    ids = AutoTokenizer.from_pretrained(smollm2)(book_text())["input_ids"]
    return [ids[1000:1300], ids[5000:5250]]


@pytest.fixture(scope="session")
def lora_adapter(smollm2: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A seeded random rank-8 LoRA adapter on SmolLM2's k_proj and v_proj (PEFT's file
    layout, which vLLM loads): it changes every layer's KV, so KV computed without it is
    wrong for its requests."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(smollm2) / "config.json").read_text())
    hidden, rank = config["hidden_size"], 8
    kv_width = config["num_key_value_heads"] * (config.get("head_dim") or hidden // config["num_attention_heads"])
    generator = torch.Generator().manual_seed(0)
    weights = {}
    for layer in range(config["num_hidden_layers"]):
        for proj in ("k_proj", "v_proj"):
            name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            weights[f"{name}.lora_A.weight"] = 0.05 * torch.randn(rank, hidden, generator=generator)
            weights[f"{name}.lora_B.weight"] = 0.05 * torch.randn(kv_width, rank, generator=generator)
    folder = tmp_path_factory.mktemp("lora")
    save_file(weights, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 16, "lora_dropout": 0.0,
        "target_modules": ["k_proj", "v_proj"], "bias": "none", "base_model_name_or_path": smollm2}))
    return str(folder)


def prepared(name: str) -> str:
    """A prepared model name of kvlab.runtime.models; skips the test when it is not built."""
    from kvlab.runtime.models import model_path

    try:
        model_path(name)
    except FileNotFoundError as error:
        pytest.skip(str(error))
    return name


def running(pids: list[int]) -> list[int]:
    """Which of ``pids`` still run (zombies waiting for their parent do not)."""
    alive = []
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            continue
        if stat[stat.rindex(")") + 2] != "Z":
            alive.append(pid)
    return alive



# ---- comparing engine runs (kvlab.harness.engine results, kvlab.harness.compare) ------------------------------------
def hits(result: dict, phase: str) -> list[int]:
    """Prompt tokens each prompt of a phase found cached (vLLM's prefix cache or a connector)."""
    return [row["cached_tokens"] for row in result["phases"][phase]]


def loadable(prompts: list[list[int]], block_size: int = 32) -> list[int]:
    """Every full block but the one holding the last prompt token (vLLM computes that one)."""
    return [(len(p) - 1) // block_size * block_size for p in prompts]


def bitwise(a: dict, b: dict, phase_a: str, phase_b: str) -> bool:
    """The same tokens and fp32 logprobs bitwise: for two phases that split every prefill
    the same way (a connector hit against vLLM's own prefix hit, the "floor" phase, or two
    full recomputes), whatever the CPU."""
    agreement = same_outputs(a, b, phase_a, phase_b)
    return agreement["identical"] == agreement["prompts"] and agreement["max_logprob_diff"] == 0.0


def within_split_drift(a: dict, b: dict, phase_a: str, phase_b: str) -> bool:
    """For two phases that split the prefill differently (a hit computes only the suffix, a
    cold run the whole prompt): chosen-token logprobs within SPLIT_DRIFT up to and including
    any near-tie the drift flipped (kvlab.harness.compare.gap_through_divergence)."""
    return same_outputs(a, b, phase_a, phase_b)["max_gap_through_divergence"] <= SPLIT_DRIFT


# The shared tiers served by a real server, and the fixture that starts each (its .extra() is the
# connector's settings for it).
SHARED_SERVERS = {"redis": "redis_server", "redis-cluster": "redis_cluster", "mooncake": "mooncake_store"}


@pytest.fixture
def redis_server(tmp_path: Path):
    """A real ``redis-server`` on 127.0.0.1 (kvlab.runtime.redis), stopped after the test.
    Not a skip when it is missing: scripts/setup-env installs it, and the tiers need it."""
    from kvlab.runtime.redis import RedisServer

    with RedisServer(log_path=tmp_path / "redis.log", maxmemory_mb=256) as server:
        yield server


@pytest.fixture(scope="session")
def mooncake_store(tmp_path_factory: pytest.TempPathFactory):
    """A real Mooncake Store (its master and one 256 MiB segment, kvlab.runtime.mooncake),
    shared by every test of a pytest worker that does not kill it: each test keeps to keys
    of its own. Not a skip when the wheel is missing: scripts/setup-env installs it."""
    from kvlab.runtime.mooncake import MooncakeStore

    with MooncakeStore(segment_mb=256, log_dir=tmp_path_factory.mktemp("mooncake")) as store:
        yield store


@pytest.fixture
def own_mooncake_store(tmp_path: Path):
    """A Mooncake Store of the test's own (one it kills, or fills): 32 MiB."""
    from kvlab.runtime.mooncake import MooncakeStore

    with MooncakeStore(segment_mb=32, log_dir=tmp_path) as store:
        yield store


@pytest.fixture(scope="session")
def _redis_cluster_session(tmp_path_factory: pytest.TempPathFactory):
    from kvlab.runtime.redis_cluster import RedisCluster

    with RedisCluster(nodes=3, maxmemory_mb=128, log_dir=tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield cluster


@pytest.fixture
def redis_cluster(_redis_cluster_session):
    """A real 3-node Redis Cluster on loopback (kvlab.runtime.redis_cluster), shared by the
    tests of a pytest worker: each test starts with every node running and empty."""
    cluster = _redis_cluster_session
    for index in set(range(cluster.nodes)) - set(cluster.running()):
        cluster.revive_node(index)
    cluster.flush()
    yield cluster
