"""KVLabConnector never stores or serves wrong KV when a load fails (driven as vLLM drives
it, kvlab.harness.driver): a failed load cancels the saves that depend on it, the
scheduler re-checks a shared chunk that changed or vanished since it checked it, a load
falls back to the next tier that holds the chunk, hits are counted once, and new weights
loaded into a running engine are misses. Through a real engine: test_never_wrong_engine.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from kvlab.cache import ModelGeometry  # noqa: E402
from kvlab.connector import reset_stores  # noqa: E402
from kvlab.connector import scheduler as scheduler_module  # noqa: E402
from kvlab.harness.driver import (  # noqa: E402
    connector_pair,
    prefill,
    register,
    schedule,
    settle,
    step,
    vllm_request,
)
from kvlab.connector.weights import new_weights_epoch  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_stores")

NUM_BLOCKS = 24
GQA = ModelGeometry("tiny-gqa", 4, 2, 64, torch.float32, 16)
BS = GQA.block_size
PROMPT = list(range(4 * BS + 1))  # four full blocks, the last token computed


@pytest.fixture
def tiers(tmp_path):
    """Shared memory and disk, no memory tier: every hit is read from a file."""
    extra = {"tiers": ["shm", "disk"], "shm": {"path": str(tmp_path / "shm")}, "disk": {"path": str(tmp_path / "disk")},
             "chunk_size": 4 * BS}
    scheduler, worker = connector_pair(GQA, NUM_BLOCKS, extra)
    register(worker, "vllm>=0.29 LBHNC", GQA, NUM_BLOCKS)
    return scheduler, worker, tmp_path


def fill(worker, block_ids: list[int], seed: int) -> None:
    """Give ``block_ids`` KV of their own (what a forward would have computed)."""
    generator = torch.Generator().manual_seed(seed)
    for view in worker.cache.layers.values():
        for part in view if isinstance(view, tuple) else (view,):
            for block in block_ids:
                part[block].copy_(torch.randn(part[block].shape, generator=generator))


def blocks(worker, block_ids: list[int]) -> list[torch.Tensor]:
    return [part[block].clone() for view in worker.cache.layers.values()
            for part in (view if isinstance(view, tuple) else (view,)) for block in block_ids]


def chunk_files(root) -> list:
    return sorted(root.glob("*/*.kvchunk"))


def test_a_failed_load_stores_nothing_and_the_next_request_gets_the_right_kv(tiers) -> None:
    """The deterministic poisoning of issue 25 in miniature: a chunk is promised from a tier
    that loses it between the lookup and the load, and the step also writes the chunk
    through to the tier that lacks it. The load fails, so its blocks still hold another
    request's KV: that save must be cancelled, nothing stored, and the next request that
    hits the prefix must load the KV the first request computed."""
    scheduler, worker, root = tiers
    fill(worker, [0, 1, 2, 3], seed=1)
    prefill(scheduler, worker, "a", PROMPT, [0, 1, 2, 3, 4])
    computed = blocks(worker, [0, 1, 2, 3])
    shm_file, disk_file = [next((root / name).glob("*.kvchunk")) for name in ("shm", "disk")]
    shm_file.unlink()  # another process evicted the shm copy: b's step writes it through again

    request = vllm_request("b", PROMPT)
    hit, _ = scheduler.get_num_new_matched_tokens(request, 0)
    assert hit == 4 * BS, "served from disk: the scheduler saw the shm file gone"
    scheduler.update_state_after_alloc(request, None, hit)
    disk_file.unlink()  # and the disk copy goes before the worker loads it
    fill(worker, [5, 6, 7, 8], seed=2)  # another request's KV in b's blocks
    result = step(scheduler, worker, schedule("b", PROMPT, [5, 6, 7, 8, 9], hit))
    assert result["report"].invalid_block_ids == {5, 6, 7, 8}, "handed back to vLLM to recompute"
    settle(scheduler, worker, finished={"b"})
    assert chunk_files(root) == [], "nothing of the failed step was stored"
    assert worker.stats.cancelled_saves == 1

    fill(worker, [0, 1, 2, 3], seed=1)
    prefill(scheduler, worker, "c", PROMPT, [0, 1, 2, 3, 4])  # computed again, stored again
    assert prefill(scheduler, worker, "d", PROMPT, [10, 11, 12, 13, 14])["hit_tokens"] == 4 * BS
    assert all(torch.equal(a, b) for a, b in zip(blocks(worker, [10, 11, 12, 13]), computed))


def test_a_failed_request_is_planned_again_and_its_saves_resume(tiers) -> None:
    """vLLM recomputes a failed request from its first failed block. Its saves stay
    cancelled until the scheduler, told of the failure in the step's report, has planned
    every chunk again; the next step's metadata says so and the worker saves again."""
    scheduler, worker, root = tiers
    prefill(scheduler, worker, "a", PROMPT, [0, 1, 2, 3, 4])
    request = vllm_request("b", PROMPT)
    hit, _ = scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, None, hit)
    for path in chunk_files(root):
        path.unlink()
    step(scheduler, worker, schedule("b", PROMPT, [5, 6, 7, 8, 9], hit))
    assert worker.worker.failures.saves_cancelled("b")
    assert scheduler.scheduler._requests["b"].next_chunk == 0, "every chunk planned again"
    settle(scheduler, worker)
    assert not worker.worker.failures.saves_cancelled("b"), "the scheduler's replan reached the worker"


def test_a_vanished_shared_file_falls_back_to_the_next_tier(tiers) -> None:
    """The shm copy vanishes after the lookup: the worker loads the disk copy instead, no
    block is recomputed, and what the response reports as cached was really loaded."""
    scheduler, worker, root = tiers
    fill(worker, [0, 1, 2, 3], seed=3)
    prefill(scheduler, worker, "a", PROMPT, [0, 1, 2, 3, 4])
    computed = blocks(worker, [0, 1, 2, 3])
    request = vllm_request("b", PROMPT)
    hit, _ = scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, None, hit)
    next((root / "shm").glob("*.kvchunk")).unlink()
    result = step(scheduler, worker, schedule("b", PROMPT, [5, 6, 7, 8, 9], hit))
    assert hit == 4 * BS and result["report"].invalid_block_ids == set()
    assert worker.stats.fallback_loads == 1 and worker.stats.load_errors == 0
    assert all(torch.equal(a, b) for a, b in zip(blocks(worker, [5, 6, 7, 8]), computed))
    settle(scheduler, worker, finished={"b"})
    request = vllm_request("c", PROMPT)
    assert scheduler.get_num_new_matched_tokens(request, 0)[0] == 4 * BS
    assert scheduler.scheduler._requests["c"].matched[0].tier == "disk", "routed to the tier that holds it"


def test_hits_are_counted_once_per_request_however_often_it_is_looked_up(tiers) -> None:
    scheduler, worker, _ = tiers
    prefill(scheduler, worker, "a", PROMPT, [0, 1, 2, 3, 4])
    before = (worker.stats.hit_tokens, worker.stats.lookups)
    request = vllm_request("b", PROMPT)
    for _ in range(5):  # waiting for room, vLLM asks again every step
        hit, _ = scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, None, hit)
    assert (worker.stats.hit_tokens - before[0], worker.stats.lookups - before[1]) == (4 * BS, 1)


def test_the_checked_memo_is_bounded(tiers, monkeypatch) -> None:
    scheduler, worker, _ = tiers
    monkeypatch.setattr(scheduler_module, "CHECKED_CHUNKS", 3)
    for i in range(6):
        prompt = [1000 * (i + 1) + t for t in range(2 * BS + 1)]
        prefill(scheduler, worker, f"p{i}", prompt, [0, 1, 2])
        prefill(scheduler, worker, f"q{i}", prompt, [3, 4, 5])
    assert len(scheduler.scheduler._checked) <= 3


def test_new_weights_loaded_into_the_engine_are_misses(tiers) -> None:
    """A weight load starts a new epoch (kvlab.connector.weights): the next lookup misses,
    the new weights' KV hits after that, and a load planned for the old epoch is refused."""
    scheduler, worker, _ = tiers
    engine_id = scheduler._kv_transfer_config.engine_id
    prefill(scheduler, worker, "a", PROMPT, [0, 1, 2, 3, 4])
    request = vllm_request("b", PROMPT)
    hit, _ = scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, None, hit)
    new_weights_epoch(engine_id)  # the weights change between the lookup and the load
    result = step(scheduler, worker, schedule("b", PROMPT, [5, 6, 7, 8, 9], hit))
    assert hit == 4 * BS and result["report"].invalid_block_ids == {5, 6, 7, 8}
    settle(scheduler, worker, finished={"b"})
    assert prefill(scheduler, worker, "c", PROMPT, [0, 1, 2, 3, 4])["hit_tokens"] == 0
    assert prefill(scheduler, worker, "d", PROMPT, [5, 6, 7, 8, 9])["hit_tokens"] == 4 * BS


def test_an_auth_key_signs_every_shared_chunk_and_a_writer_without_it_cannot_be_loaded(tmp_path, monkeypatch) -> None:
    """With ``auth_key`` every shared chunk carries a MAC: the engine with the key hits what
    it stored; one whose key differs (a writer without the key, same user included) is
    refused every chunk when it loads it, counted as forged, and recomputes."""
    monkeypatch.setenv("KVLAB_TEST_KEY", "k" * 32)
    key_file = tmp_path / "other.key"
    key_file.write_bytes(b"o" * 32)
    extra = {"tiers": ["disk"], "disk": {"path": str(tmp_path / "disk")}, "auth_key": "env:KVLAB_TEST_KEY"}
    scheduler, worker = connector_pair(GQA, NUM_BLOCKS, extra)
    register(worker, "vllm>=0.29 LBHNC", GQA, NUM_BLOCKS)
    prefill(scheduler, worker, "a", PROMPT, [0, 1, 2, 3, 4])
    assert prefill(scheduler, worker, "b", PROMPT, [5, 6, 7, 8, 9])["hit_tokens"] == 4 * BS
    reset_stores()
    other, other_worker = connector_pair(GQA, NUM_BLOCKS, {**extra, "auth_key": f"file:{key_file}"})
    register(other_worker, "vllm>=0.29 LBHNC", GQA, NUM_BLOCKS)
    result = prefill(other, other_worker, "c", PROMPT, [10, 11, 12, 13, 14])
    assert result["report"].invalid_block_ids == {10, 11, 12, 13}, "refused at the load (the MAC covers the payload)"
    assert other.scheduler.shared.stats.forged == 1
    assert prefill(other, other_worker, "d", PROMPT, [10, 11, 12, 13, 14])["hit_tokens"] == 0, "never promised again"


@pytest.mark.parametrize("auth_key, why", [("k" * 32, "must name the key"), ("env:KVLAB_UNSET_KEY", "0 bytes"),
                                            ("file:/nonexistent/key", "cannot be read")])
def test_a_bad_auth_key_is_a_clear_start_up_error(tmp_path, auth_key: str, why: str) -> None:
    from kvlab.connector import ConnectorConfig

    with pytest.raises(ValueError, match=why):
        ConnectorConfig.parse({"tiers": ["disk"], "disk": {"path": str(tmp_path)}, "auth_key": auth_key})
    with pytest.raises(ValueError, match="none of them shared"):
        ConnectorConfig.parse({"auth_key": "env:X"})


FAULTS = ("vanished", "damaged", "failed-copy", "dead-redis")


@pytest.mark.parametrize("fault", FAULTS)
def test_after_any_failed_load_what_is_stored_is_right(tmp_path, monkeypatch, fault: str, request) -> None:
    """Each fault kind of docs/reliability.md strikes between the lookup and the load, with
    the workers' memory emptied first, so the failing step also keeps the promised blocks in
    memory (the path that poisoned the store). Whatever the fault, what the store holds
    afterwards is right: the next request that hits the prefix loads exactly the KV the first
    request computed (or misses)."""
    if fault == "dead-redis":
        server = request.getfixturevalue("redis_server")
        extra = {"tiers": ["memory", "redis"], "redis": {"url": server.url}}
    else:
        extra = {"tiers": ["memory", "shm", "disk"], "shm": {"path": str(tmp_path / "shm")},
                 "disk": {"path": str(tmp_path / "disk")}}
    scheduler, worker = connector_pair(GQA, NUM_BLOCKS, {**extra, "chunk_size": 4 * BS})
    register(worker, "vllm>=0.29 LBHNC", GQA, NUM_BLOCKS)
    fill(worker, [0, 1, 2, 3], seed=1)
    prefill(scheduler, worker, "a", PROMPT, [0, 1, 2, 3, 4])
    computed = blocks(worker, [0, 1, 2, 3])
    scheduler.reset_cache()  # the workers' memory goes: the next hit comes from a shared tier
    settle(scheduler, worker)

    request_b = vllm_request("b", PROMPT)
    hit, _ = scheduler.get_num_new_matched_tokens(request_b, 0)
    assert hit == 4 * BS
    scheduler.update_state_after_alloc(request_b, None, hit)
    if fault == "dead-redis":
        from kvlab.runtime.redis import shut_down

        shut_down(server.url)
    for path in chunk_files(tmp_path):
        if fault == "vanished":
            path.unlink()
        elif fault == "damaged":
            data = bytearray(path.read_bytes())
            data[-9] ^= 0x40
            path.write_bytes(bytes(data))
    if fault == "failed-copy":  # the buffered copy, and a file tier's read straight into the cache
        def broken(*args, **kwargs):
            raise OSError("a copy failed")
        monkeypatch.setattr("kvlab.connector.worker.run_all", broken)
        monkeypatch.setattr("kvlab.transfer.file_reads.read_runs", broken)
    fill(worker, [5, 6, 7, 8], seed=2)  # another request's KV in b's blocks
    result = step(scheduler, worker, schedule("b", PROMPT, [5, 6, 7, 8, 9], hit))
    assert result["report"].invalid_block_ids == {5, 6, 7, 8}, "handed back to vLLM to recompute"
    monkeypatch.undo()
    settle(scheduler, worker, finished={"b"})

    fill(worker, [10, 11, 12, 13], seed=3)
    after = prefill(scheduler, worker, "c", PROMPT, [10, 11, 12, 13, 14])["hit_tokens"]
    if after:
        assert all(torch.equal(x, y) for x, y in zip(blocks(worker, [10, 11, 12, 13]), computed)), \
            "the prefix's stored KV is the KV the first request computed"
    assert worker.stats.cancelled_saves >= 1


def test_engines_with_other_chunk_sizes_sharing_a_folder_never_load_a_block_from_the_wrong_position(tmp_path) -> None:
    """Engine A stores 2-block chunks, engine B 4-block chunks, in one folder; a chunk is named
    by its last block, so B's chunk ending at block 3 replaces A's file of the same name (blocks
    2 and 3, where B's holds 0 to 3). A's index still says block 2 is at position 0 of that file:
    a load from there would put block 0's KV in block 2. The scheduler and the worker check the
    block's own key at its position: A loads only what is really there."""
    folder = str(tmp_path / "disk")
    a, a_worker = connector_pair(GQA, NUM_BLOCKS, {"tiers": ["disk"], "disk": {"path": folder}, "chunk_size": 2 * BS,
                                                   "store_name": "a"})
    b, b_worker = connector_pair(GQA, NUM_BLOCKS, {"tiers": ["disk"], "disk": {"path": folder}, "chunk_size": 4 * BS,
                                                   "store_name": "b"})
    register(a_worker, "vllm>=0.29 LBHNC", GQA, NUM_BLOCKS)
    register(b_worker, "vllm>=0.29 LBHNC", GQA, NUM_BLOCKS)
    request = vllm_request("b", PROMPT)
    hit, _ = b.get_num_new_matched_tokens(request, 0)
    while hit is None:  # B looks up before A has stored anything
        settle(b, b_worker)
        hit, _ = b.get_num_new_matched_tokens(request, 0)
    b.update_state_after_alloc(request, None, hit)
    fill(a_worker, [0, 1, 2, 3], seed=7)
    computed = [blocks(a_worker, [i]) for i in range(4)]
    prefill(a, a_worker, "a", PROMPT, [0, 1, 2, 3, 4])
    assert prefill(a, a_worker, "a2", PROMPT, [5, 6, 7, 8, 9])["hit_tokens"] == 4 * BS  # A indexes its chunks
    fill(b_worker, [0, 1, 2, 3], seed=7)  # the same prompt: the same KV
    step(b, b_worker, schedule("b", PROMPT, [0, 1, 2, 3, 4], hit))
    settle(b, b_worker, finished={"b"})

    fill(a_worker, [5, 6, 7, 8], seed=8)
    loaded = prefill(a, a_worker, "c", PROMPT, [5, 6, 7, 8, 9])["hit_tokens"] // BS
    assert loaded >= 2, "A's own first chunk is still there"
    for i in range(loaded):
        assert all(torch.equal(x, y) for x, y in zip(blocks(a_worker, [5 + i]), computed[i])), \
            f"block {i} loaded is the block its key names"


def test_a_load_reads_its_chunks_tail_first(tmp_path, monkeypatch) -> None:
    """Each read marks a chunk used (a file's mtime), so reading a prompt's chunks from the
    last to the first leaves its head the last to be evicted, as vLLM frees its own blocks."""
    extra = {"tiers": ["disk"], "disk": {"path": str(tmp_path)}, "chunk_size": 2 * BS}
    scheduler, worker = connector_pair(GQA, NUM_BLOCKS, extra)
    register(worker, "vllm>=0.29 LBHNC", GQA, NUM_BLOCKS)
    fill(worker, [0, 1, 2, 3], seed=5)
    prefill(scheduler, worker, "a", PROMPT, [0, 1, 2, 3, 4])
    store, read = worker.worker.store, []
    fetch = store.fetch
    monkeypatch.setattr(store, "fetch", lambda key, *a, **k: read.append(key) or fetch(key, *a, **k))
    request = vllm_request("b", PROMPT)
    hit, _ = scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, None, hit)
    step(scheduler, worker, schedule("b", PROMPT, [5, 6, 7, 8, 9], hit))
    keys = scheduler.scheduler._requests["b"].keys  # a chunk's key is its last block's
    assert hit == 4 * BS and worker.stats.load_errors == 0
    assert read == [keys[3], keys[1]], "the tail's chunk first"
