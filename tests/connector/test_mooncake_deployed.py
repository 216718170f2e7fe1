"""KVLabConnector's mooncake tier as vLLM deploys it, driven without an engine, against a real
Mooncake Store (kvlab.runtime.mooncake): another engine (another process, another host)
hits and loads the same bytes; a damaged chunk is recomputed and dropped; a master or
segment that dies is a quick miss, never an error. Engine runs:
tests/integration/test_connector_vllm.py."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("vllm")

from test_deployed import BS, PROMPT, blocks_of, engine  # noqa: E402

from kvlab.connector import reset_stores  # noqa: E402
from kvlab.harness.driver import prefill  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_stores")


def test_another_engine_loads_what_one_stored_and_a_damaged_chunk_is_recomputed(mooncake_store, request):
    extra = mooncake_store.extra(mooncake={"url": f"{mooncake_store.url}&namespace={request.node.name}"})
    scheduler, (worker,) = engine(extra)
    prefill(scheduler, worker, "a", PROMPT, [0, 1, 2, 3, 4])
    expected = blocks_of(worker, [0, 1, 2, 3])
    names = [f"{request.node.name}/c/{key}" for key in worker.store.tier("memory")._book]
    reset_stores()
    scheduler_b, (worker_b,) = engine({**extra, "tiers": ["mooncake"]})
    assert prefill(scheduler_b, worker_b, "b", PROMPT, [5, 6, 7, 8, 9])["hit_tokens"] == 4 * BS
    assert torch.equal(blocks_of(worker_b, [5, 6, 7, 8]), expected)
    assert worker_b.store.stats.mooncake_reads >= 1

    tier = worker_b.store.tier("mooncake")
    assert names
    for name in names:
        value = bytearray(tier.client.get(name))
        value[-3] ^= 0x10
        assert tier.client.upsert(name, bytes(value)) == 0
    reset_stores()
    scheduler_c, (worker_c,) = engine({**extra, "tiers": ["mooncake"]})
    result = prefill(scheduler_c, worker_c, "c", PROMPT, [10, 11, 12, 13, 14])
    assert result["report"].invalid_block_ids == {10, 11, 12, 13}, "its header is intact: it fails at the load"
    assert worker_c.store.stats.corrupt >= 1 and not any(tier.client.is_exist(name) == 1 for name in names)


@pytest.mark.parametrize("fault", ["master", "segment"])
def test_a_dead_master_or_segment_is_a_quick_miss(own_mooncake_store, fault: str):
    extra = own_mooncake_store.extra()
    scheduler, (worker,) = engine(extra)
    prefill(scheduler, worker, "a", PROMPT, [0, 1, 2, 3, 4])
    reset_stores()
    scheduler_b, (worker_b,) = engine({**extra, "tiers": ["mooncake"]})
    (own_mooncake_store.kill_master if fault == "master" else own_mooncake_store.kill_segment)()
    began = time.monotonic()
    result = prefill(scheduler_b, worker_b, "b", PROMPT, [5, 6, 7, 8, 9])
    assert time.monotonic() - began < 10
    if result["hit_tokens"]:  # promised before the loss was seen: the load fails and vLLM recomputes
        assert result["report"].invalid_block_ids == {5, 6, 7, 8}
    stats = worker_b.store.stats
    assert result["hit_tokens"] == 0 or stats.read_errors >= 1


def test_the_master_down_at_start_up_is_a_clear_error():
    from kvlab.runtime.servers import free_port
    from kvlab.harness.driver import connector_group
    from test_deployed import NUM_BLOCKS, RANK

    url = f"mooncake://127.0.0.1:{free_port()}?metadata_port={free_port()}"
    with pytest.raises(ValueError, match="cannot reach the Mooncake master"):
        connector_group(RANK, NUM_BLOCKS, {"tiers": ["memory", "mooncake"], "mooncake": {"url": url}})
