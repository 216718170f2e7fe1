"""KVLabConnector as vLLM deploys it, driven without an engine: the scheduler side and the
workers share nothing but picklable metadata and reports; tensor-parallel ranks each keep
their own shard; shared memory and a real Redis server let another engine (another
process, another host) hit; saves run beside the forward and a request's blocks are held
until they are done; faults of a remote tier are misses, never errors. Engine runs:
tests/integration/test_deployed_engines.py."""

from __future__ import annotations

import logging
import pickle
import time

import pytest
import torch
from conftest import SHARED_SERVERS
from logical_kv import kv_bytes, random_bits

pytest.importorskip("vllm")

from kvlab.cache import ModelGeometry  # noqa: E402
from kvlab.connector import KVLabMetadata, reset_stores  # noqa: E402
from kvlab.harness.driver import (  # noqa: E402
    connector_group, prefill, register, schedule, settle, step, vllm_request,
)

pytestmark = pytest.mark.usefixtures("fresh_stores")

RANK = ModelGeometry("tp-rank", 4, 1, 64, torch.float32, 16)  # one rank's share of 2 kv heads
BS, NUM_BLOCKS = RANK.block_size, 24
PROMPT = list(range(4 * BS + 1))


def engine(extra: dict, workers: int = 1):
    """A scheduler and its workers, each registered with a cache of its own random bytes."""
    scheduler, group = connector_group(RANK, NUM_BLOCKS, extra, workers=workers)
    for rank, worker in enumerate(group):
        register(worker, "vllm>=0.29 CPU_LBHNC", RANK, NUM_BLOCKS)
        for tensor in worker.cache.storage:
            tensor.view(torch.int32).random_(generator=torch.Generator().manual_seed(rank))
    settle(scheduler, group)  # the first step: the workers say what cache they hold
    return scheduler, group


def blocks_of(worker, block_ids: list[int]) -> torch.Tensor:
    """The blocks' bytes (as integers: random bits hold NaNs, which never compare equal)."""
    return torch.cat([view[block_ids].reshape(-1).view(torch.int32) for view in worker.cache.layers.values()])


def test_metadata_and_reports_are_small_and_hold_no_tensor():
    scheduler, (worker,) = engine({})
    request = vllm_request("a", PROMPT)
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, None, 0)
    meta = scheduler.build_connector_meta(schedule("a", PROMPT, [0, 1, 2, 3, 4], 0))
    assert isinstance(meta, KVLabMetadata) and meta.saves
    blob = pickle.dumps(meta)
    assert len(blob) < 2000 and b"torch" not in blob
    worker.bind_connector_metadata(meta)
    worker.wait_for_save()
    worker.worker.flush()
    report = worker.build_connector_worker_meta()
    assert b"torch" not in pickle.dumps(report) and report.stored


def test_tensor_parallel_ranks_keep_their_own_shards(tmp_path):
    """Two ranks, each its own bytes: each gets its own back, from memory and, in a new
    engine, from shared memory; a rank missing its shard makes the block a miss."""
    extra = {"tiers": ["memory", "shm"], "shm": {"path": str(tmp_path / "shm")}}
    scheduler, group = engine(extra, workers=2)
    prefill(scheduler, group, "a", PROMPT, [0, 1, 2, 3, 4])
    expected = [blocks_of(w, [0, 1, 2, 3]) for w in group]
    assert not torch.equal(*expected), "the ranks hold different heads"
    assert prefill(scheduler, group, "b", PROMPT, [5, 6, 7, 8, 9])["hit_tokens"] == 4 * BS
    assert all(torch.equal(blocks_of(w, [5, 6, 7, 8]), e) for w, e in zip(group, expected))

    reset_stores()
    scheduler, fresh = engine(extra, workers=2)
    for worker in fresh:
        for tensor in worker.cache.storage:
            tensor.zero_()
    assert prefill(scheduler, fresh, "c", PROMPT, [10, 11, 12, 13, 14])["hit_tokens"] == 4 * BS
    assert all(torch.equal(blocks_of(w, [10, 11, 12, 13]), e) for w, e in zip(fresh, expected))

    shards = sorted((tmp_path / "shm").iterdir())
    assert len(shards) == 2, "one chunk per rank"
    reset_stores()
    scheduler, fresh = engine({**extra, "tiers": ["shm"]}, workers=2)
    shards[0].unlink()  # one rank lost its shard: the block is a miss for every rank
    assert prefill(scheduler, fresh, "d", PROMPT, [15, 16, 17, 18, 19])["hit_tokens"] == 0


WHOLE = ModelGeometry("tp-model", 3, 4, 16, torch.float32, 16)  # 4 kv heads: TP 1, 2 and 4 split them


def sized_engine(extra: dict, workers: int, layout: str, seed: int):
    """An engine of ``workers`` tensor-parallel ranks of WHOLE, each rank's cache of its own
    random bytes, in ``layout``."""
    rank = WHOLE.with_(num_kv_heads=WHOLE.num_kv_heads // workers)
    scheduler, group = connector_group(rank, NUM_BLOCKS, extra, workers=workers)
    for index, worker in enumerate(group):
        register(worker, f"vllm>=0.29 {layout}", rank, NUM_BLOCKS)
        random_bits(worker.cache, seed=seed + index)
    settle(scheduler, group)
    return scheduler, group


def model_kv(group, block_ids: list[int]) -> torch.Tensor:
    """The blocks' KV of the whole model, every rank's heads side by side, as bytes
    [layer, block, token, head, content] (tests/logical_kv.py: read whatever the layout)."""
    return torch.cat([kv_bytes(worker.cache)[:, block_ids] for worker in group], dim=3)


@pytest.mark.parametrize("tier, layerwise", [("disk", False), ("disk", True), ("shm", False), ("redis", False),
                                             ("redis-cluster", False), ("mooncake", False)])
def test_engines_of_other_tensor_parallel_sizes_share_one_store(request, tmp_path, tier, layerwise):
    """What a TP=1 engine stored, TP=2 and TP=4 engines (another layout too) load, each rank
    its own heads sliced out of the one shard; what a TP=2 engine stored, a TP=1 engine
    loads by gathering both shards and a TP=4 one by slicing them: every head of every
    layer and token bitwise where the writer had it, and nothing stored twice. A shard
    gone is a miss for every rank of another size."""
    shared = request.getfixturevalue(SHARED_SERVERS[tier]).extra() if tier in SHARED_SERVERS else \
        {"tiers": ["memory", tier], tier: {"path": str(tmp_path / tier)}}
    extra = {**shared, "chunk_size": 2 * BS, "layerwise": layerwise}
    written, read = [3, 11, 5, 20, 8], [9, 2, 23, 6, 15]
    for size, readers, prompt in ((1, (2, 4), PROMPT), (2, (1, 4), [t + 500 for t in PROMPT])):
        reset_stores()
        scheduler, writer = sized_engine({**extra, "store_name": f"writer-{size}"}, size, "CPU_LBHNC", seed=10)
        assert prefill(scheduler, writer, f"w{size}", prompt, written, layerwise)["hit_tokens"] == 0
        stored = sorted((tmp_path / tier).iterdir()) if tier not in SHARED_SERVERS else None
        for workers in readers:
            reset_stores()
            scheduler, group = sized_engine({**extra, "store_name": f"reader-{workers}"}, workers,
                                            "BLHNC" if workers == 2 else "CPU_LBHNC", seed=99)
            hit = prefill(scheduler, group, f"r{size}-{workers}", prompt, read, layerwise)["hit_tokens"]
            assert hit == 4 * BS, (size, workers)
            assert all(worker.stats.load_errors == 0 for worker in group)
            assert torch.equal(model_kv(group, read[:4]), model_kv(writer, written[:4])), (size, workers)
            if stored is not None:
                assert sorted((tmp_path / tier).iterdir()) == stored, "a hit of another size is not stored again"
    if tier == "disk":  # one of the TP=2 writer's shards gone: a TP=1 reader misses, never loads half
        reset_stores()
        last = [t + 500 for t in PROMPT]
        chunk = max((tmp_path / tier).iterdir(), key=lambda path: path.stat().st_mtime_ns)
        chunk.unlink()
        scheduler, group = sized_engine({**extra, "store_name": "reader-after"}, 1, "CPU_LBHNC", seed=7)
        assert prefill(scheduler, group, "gone", last, read, layerwise)["hit_tokens"] < 4 * BS


def test_a_block_still_being_stored_is_waited_for_not_recomputed(monkeypatch):
    """Another request for a prefix whose saves are in flight waits (the lookup asks vLLM
    to try again) instead of recomputing it; then it hits."""
    scheduler, (worker,) = engine({})
    release = []
    slow = worker.worker._save

    def held_save(spec):
        while not release:
            time.sleep(0.01)
        slow(spec)

    monkeypatch.setattr(worker.worker, "_save", held_save)
    request = vllm_request("a", PROMPT)
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, None, 0)
    step(scheduler, worker, schedule("a", PROMPT, [0, 1, 2, 3, 4], 0))
    assert scheduler.request_finished(request, [0, 1, 2, 3, 4])[0], "blocks held while the save runs"
    assert scheduler.get_num_new_matched_tokens(vllm_request("b", PROMPT), 0) == (None, False)
    assert not step(scheduler, worker, schedule_nothing(), finished={"a"})["report"].finished_sending
    release.append(True)
    assert settle(scheduler, worker) == {"a"}, "released once saved"
    assert scheduler.get_num_new_matched_tokens(vllm_request("b", PROMPT), 0) == (4 * BS, False)


def schedule_nothing():
    from kvlab.harness.driver import empty_step

    return empty_step()


def test_a_preempted_requests_saves_finish_before_its_blocks_are_reused(monkeypatch):
    scheduler, (worker,) = engine({})
    done = []
    slow = worker.worker._save

    def slow_save(spec):
        time.sleep(0.3)
        slow(spec)
        done.append(spec.req_id)

    monkeypatch.setattr(worker.worker, "_save", slow_save)
    request = vllm_request("a", PROMPT)
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, None, 0)
    step(scheduler, worker, schedule("a", PROMPT, [0, 1, 2, 3, 4], 0))
    preempting = schedule_nothing()
    preempting.preempted_req_ids = {"a"}
    step(scheduler, worker, preempting)
    assert done == ["a"], "handle_preemptions waited for the save"
    # vLLM looks the preempted request up again; its saves are done, its chunks held in memory
    # (nothing new to save), and the worker still reports it when it finishes: the scheduler
    # must hold its blocks for that report, or vLLM frees a request it no longer knows
    scheduler.get_num_new_matched_tokens(request, 0)
    held, _ = scheduler.request_finished(request, [0, 1, 2, 3, 4])
    assert held


def test_redis_tier_serves_another_engine_and_absorbs_its_faults(redis_server):
    """Engine A stores through Redis; engine B (another process, another host) hits and
    gets the same bytes, which cross once; a damaged value is recomputed and dropped; a dead server makes every lookup a
    quick miss and every save a counted error, never an exception."""
    extra = redis_server.extra()
    scheduler, (worker,) = engine(extra)
    prefill(scheduler, worker, "a", PROMPT, [0, 1, 2, 3, 4])
    expected = blocks_of(worker, [0, 1, 2, 3])
    reset_stores()
    scheduler_b, (worker_b,) = engine(extra)
    client = redis_server.client()
    client.config_resetstat()
    assert prefill(scheduler_b, worker_b, "b", PROMPT, [5, 6, 7, 8, 9])["hit_tokens"] == 4 * BS
    assert torch.equal(blocks_of(worker_b, [5, 6, 7, 8]), expected)
    calls = {name: stat["calls"] for name, stat in client.info("commandstats").items()}
    assert calls.get("cmdstat_get") == 1, "the payload crossed once: to the worker, not to the scheduler"
    assert calls.get("cmdstat_getrange") == 1, "the scheduler read the chunk's header alone"

    for key in client.keys("kvlab:c:*"):
        value = bytearray(client.get(key))
        value[-3] ^= 0x10
        client.set(key, bytes(value))
    reset_stores()
    scheduler_c, (worker_c,) = engine({**extra, "tiers": ["redis"]})
    result = prefill(scheduler_c, worker_c, "c", PROMPT, [10, 11, 12, 13, 14])
    assert result["report"].invalid_block_ids == {10, 11, 12, 13}, "its header is intact: it fails at the load"
    assert worker_c.store.stats.corrupt >= 1 and not client.keys("kvlab:c:*"), "and is dropped"

    redis_server.stop()
    began = time.monotonic()
    result = prefill(scheduler_c, worker_c, "d", PROMPT, [15, 16, 17, 18, 19])
    assert result["hit_tokens"] == 0 and time.monotonic() - began < 10
    assert worker_c.store.stats.read_errors + worker_c.store.stats.write_errors >= 1


def test_redis_down_at_start_up_is_a_clear_error():
    from kvlab.runtime.servers import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(ValueError, match=f"cannot reach {url}"):
        connector_group(RANK, NUM_BLOCKS, {"tiers": ["memory", "redis"], "redis": {"url": url}})


def test_no_redis_server_command_is_a_clear_error(monkeypatch, tmp_path):
    from kvlab.runtime.redis import RedisError, RedisServer

    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RedisError, match="no redis-server command"):
        RedisServer().start()


def test_only_tensor_parallel_ranks_shard_the_keys():
    """Pipeline or context parallel workers hold other layers or other tokens, which the
    keys (one shard per tensor-parallel rank, every layer) do not describe: refused."""
    from types import SimpleNamespace

    from kvlab.connector.scheduler import _tensor_parallel_ranks

    assert _tensor_parallel_ranks(SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=2,
                                                                                  world_size=4))) == 2
    with pytest.raises(ValueError, match="tensor parallelism only"):
        _tensor_parallel_ranks(SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=2)))


def test_a_remote_tier_without_auth_key_is_warned_about(redis_server, tmp_path, monkeypatch, caplog):
    """Every client that reaches a remote tier's server can write chunks there: without a key,
    the engine says so once at start-up (the scheduler side), and not with one."""
    with caplog.at_level(logging.WARNING, logger="kvlab.connector"):
        connector_group(RANK, NUM_BLOCKS, redis_server.extra())
    warned = [r.getMessage() for r in caplog.records if "set auth_key" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("KVLabConnector: the redis tier takes chunks from every client")
    caplog.clear()
    monkeypatch.setenv("KVLAB_TEST_KEY", "k" * 32)
    with caplog.at_level(logging.WARNING, logger="kvlab.connector"):
        connector_group(RANK, NUM_BLOCKS, {**redis_server.extra(), "auth_key": "env:KVLAB_TEST_KEY"})
        connector_group(RANK, NUM_BLOCKS, {"tiers": ["memory", "shm"], "shm": {"path": str(tmp_path / "shm")}})
    assert "auth_key" not in caplog.text
