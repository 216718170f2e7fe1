"""KVLabConnector driven the way vLLM drives it, without starting an engine
(kvlab.harness.driver): vLLM's own SchedulerOutput classes on the scheduler side, caches
exactly as each vLLM generation hands them over on the worker side (vLLM's own allocator
for >= 0.29, the 0.12-0.28 runner's cross-layer recipe, Ascend tuples, MLA). Saved blocks
must come back bit for bit into other blocks. Engine runs are in test_connector_vllm.py."""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch
from conftest import SHARED_SERVERS
from logical_kv import assert_same_blocks, random_bits

pytest.importorskip("vllm")

from kvlab.cache import ModelGeometry, allocate, layer_name  # noqa: E402
from kvlab.connector import ConnectorConfig, KVLabConnector, reset_stores  # noqa: E402
from kvlab.harness.driver import (  # noqa: E402
    connector_pair,
    prefill,
    register,
    settle,
    stand_in_config,
    vllm_request,
)
from kvlab.transfer import file_reads  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_stores")

NUM_BLOCKS = 24
GQA = ModelGeometry("tiny-gqa", 4, 2, 64, torch.float32, 16)
MLA = ModelGeometry.mla("tiny-mla", 3, 64, 32, dtype=torch.bfloat16, block_size=16)
BS = GQA.block_size


def connectors(geometry: ModelGeometry, extra: dict | None = None) -> tuple[KVLabConnector, KVLabConnector]:
    return connector_pair(geometry, NUM_BLOCKS, extra)


def run_step(scheduler, worker, req_id, prompt, block_ids, layerwise) -> int:
    return prefill(scheduler, worker, req_id, prompt, block_ids, layerwise)["hit_tokens"]


def block_bytes(worker: KVLabConnector, block_ids: list[int]) -> list[torch.Tensor]:
    """Each block's bytes per layer and part, read through the engine-side views."""
    out = []
    for view in worker.cache.layers.values():
        for part in view if isinstance(view, tuple) else (view,):
            axis = worker.cache.layout.view_order.index("B")
            out.append(part.index_select(axis, torch.tensor(block_ids)).contiguous().view(torch.uint8))
    return out


VARIANTS = [
    "vllm>=0.29 CPU_LBHNC", "vllm>=0.29 LBHNC", "vllm>=0.29 BLHNC", "vllm>=0.29 BHLNC",
    "vllm0.12 flash NHD cross", "vllm0.12 flash HND cross", "vllm0.26 NHD cross",
    "flash_attn_v0.12", "ascend_kv_tuple",
]


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole-step", "layerwise"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_round_trip_bit_exact(variant: str, layerwise: bool) -> None:
    geometry = GQA
    scheduler, worker = connectors(geometry, {"layerwise": layerwise, "chunk_size": 3 * BS})
    register(worker, variant, geometry, NUM_BLOCKS)
    for tensor in worker.cache.storage:
        tensor.view(torch.int32).random_()
    prompt = [(7 * i) % 501 for i in range(7 * BS + 5)]  # 7 full blocks, 3 chunks (3 + 3 + 1)
    first_blocks = [3, 11, 5, 20, 8, 14, 1, 17]
    assert run_step(scheduler, worker, "a", prompt, first_blocks, layerwise) == 0
    assert worker.stats.saved_blocks == 7 and len(worker.store) == 3
    expected = block_bytes(worker, first_blocks[:7])
    for tensor in worker.cache.storage:
        tensor.zero_()

    second_blocks = [9, 2, 23, 6, 15, 0, 12, 19]
    assert run_step(scheduler, worker, "b", prompt, second_blocks, layerwise) == 7 * BS
    loaded = block_bytes(worker, second_blocks[:7])
    assert all(torch.equal(a, b) for a, b in zip(expected, loaded))
    assert worker.stats.loaded_blocks == 7 and worker.stats.load_errors == 0
    if worker.cache.layout.is_cross_layer and not layerwise:  # one contiguous run per block, each way
        assert worker.stats.load_segments == 7 and worker.stats.save_segments == 7
    else:
        assert worker.stats.load_segments >= 7 * geometry.num_layers

@pytest.mark.parametrize("tier", ["shm", "disk"])
@pytest.mark.parametrize("variant", ["vllm>=0.29 CPU_LBHNC", "vllm>=0.29 BLHNC", "vllm0.26 NHD cross", "ascend_kv_tuple"])
def test_a_shared_tier_hit_is_read_straight_into_the_cache_bit_exact(tmp_path, variant: str, tier: str) -> None:
    """With the worker's memory emptied, a whole-step hit comes from a file, each chunk read
    into vLLM's blocks with no buffer between (a layerwise one through a buffer, layer by
    layer): the same bytes either way."""
    for layerwise in (False, True):
        extra = {"tiers": ["memory", tier], tier: {"path": str(tmp_path / f"{tier}-{layerwise}")},
                 "chunk_size": 3 * BS, "layerwise": layerwise, "store_name": f"{tier}-{layerwise}"}
        scheduler, worker = connectors(GQA, extra)
        register(worker, variant, GQA, NUM_BLOCKS)
        for tensor in worker.cache.storage:
            tensor.view(torch.int32).random_()
        prompt = [(7 * i) % 501 for i in range(7 * BS + 5)]
        assert run_step(scheduler, worker, "a", prompt, [3, 11, 5, 20, 8, 14, 1, 17], layerwise) == 0
        expected = block_bytes(worker, [3, 11, 5, 20, 8, 14, 1])
        scheduler.reset_cache()  # the workers' memory goes: the hit comes from the files
        settle(scheduler, worker)
        for tensor in worker.cache.storage:
            tensor.zero_()
        assert run_step(scheduler, worker, "b", prompt, [9, 2, 23, 6, 15, 0, 12, 19], layerwise) == 7 * BS
        assert all(torch.equal(a, b) for a, b in zip(expected, block_bytes(worker, [9, 2, 23, 6, 15, 0, 12, 19][:7])))
        reads = worker.worker.store.stats
        assert getattr(reads, f"{tier}_reads") == 3 and worker.stats.load_errors == 0
        assert reads.read_into_cache == (0 if layerwise or file_reads.unavailable() else 3)



@pytest.mark.parametrize("layout, geometry", [("ascend_kv_tuple", GQA), ("ascend_mla_tuple", MLA)])
def test_layerwise_through_ascend_style_hooks(layout: str, geometry: ModelGeometry) -> None:
    """The connector driven by kvlab.hooks the way vllm-ascend's attention drives it: one
    metadata object for all layers, each layer's KV a (k, v) or (nope, rope) tuple."""
    scheduler, worker = connectors(geometry, {"layerwise": True})
    worker.register_kv_caches(allocate(layout, geometry, NUM_BLOCKS).layers)
    for tensor in worker.cache.storage:
        tensor.view(torch.int16).random_()
    prompt = list(range(4 * geometry.block_size + 1))
    prefill(scheduler, worker, "a", prompt, [4, 9, 2, 7, 1], ascend_hooks=True)
    assert worker.stats.saved_blocks == 4  # saved after the step, beside the next one
    expected = block_bytes(worker, [4, 9, 2, 7])
    for tensor in worker.cache.storage:
        tensor.zero_()
    assert prefill(scheduler, worker, "b", prompt, [10, 3, 8, 5, 6], ascend_hooks=True)["hit_tokens"] == 4 * geometry.block_size
    assert all(torch.equal(a, b) for a, b in zip(expected, block_bytes(worker, [10, 3, 8, 5])))
    assert worker.stats.save_segments == 4 * len(worker.cache.storage)  # a run per block per (layer, part) tensor


def registration_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvlab.connector" and r.levelno >= logging.INFO]


def test_cross_layer_views_are_recognised_as_block_major(tmp_path, caplog: pytest.LogCaptureFixture,
                                                         vllm_cpu_build) -> None:
    _, worker = connectors(GQA, {"enable_cross_layers_blocks": True, "store": "disk", "disk": {"path": str(tmp_path)}})
    with caplog.at_level(logging.INFO, logger="kvlab.connector"):
        register(worker, "vllm>=0.29 BLHNC", GQA, NUM_BLOCKS)
    # on vLLM's CPU build the same views are named for CPU_ATTN's packed pages (byte for byte the same runs)
    assert worker.cache.layout.name == "CPU_BLHNC" and worker.cache.layout.is_cross_layer
    assert registration_lines(caplog) == [
        f"KVLabConnector: rank 0 of 1 registered a CPU_BLHNC cache of {NUM_BLOCKS} blocks of {BS} tokens (one segment "
        "per block, copied with memcpy); tiers ['memory', 'disk']; cross-layer blocks asked for and granted"]
    _, worker = connectors(GQA)
    register(worker, "vllm0.12 flash NHD cross", GQA, NUM_BLOCKS)
    assert worker.cache.layout.is_cross_layer


@pytest.mark.parametrize("variant", ["mla_v0.12", "mla_v0.12_cross", "ascend_mla_tuple"])
def test_mla_round_trip(variant: str) -> None:
    scheduler, worker = connectors(MLA)
    worker.register_kv_caches(allocate(variant, MLA, NUM_BLOCKS).layers)
    for tensor in worker.cache.storage:
        tensor.view(torch.int16).random_()
    prompt = list(range(4 * MLA.block_size + 1))
    run_step(scheduler, worker, "a", prompt, [4, 9, 2, 7, 1], False)
    expected = block_bytes(worker, [4, 9, 2, 7])
    for tensor in worker.cache.storage:
        tensor.zero_()
    assert run_step(scheduler, worker, "b", prompt, [10, 3, 8, 5, 6], False) == 4 * MLA.block_size
    assert all(torch.equal(a, b) for a, b in zip(expected, block_bytes(worker, [10, 3, 8, 5])))


def test_vllm_prefix_hits_are_not_loaded_again() -> None:
    scheduler, worker = connectors(GQA)
    register(worker, "vllm>=0.29 LBHNC", GQA, NUM_BLOCKS)
    prompt = list(range(6 * BS + 1))
    run_step(scheduler, worker, "a", prompt, list(range(7)), False)
    request = SimpleNamespace(request_id="b", prompt_token_ids=prompt)
    assert scheduler.get_num_new_matched_tokens(request, 2 * BS) == (4 * BS, False)
    assert scheduler.get_num_new_matched_tokens(request, 6 * BS) == (0, False)


def test_prompt_shorter_than_a_block_and_new_prompt_miss() -> None:
    scheduler, worker = connectors(GQA)
    register(worker, "vllm>=0.29 LBHNC", GQA, NUM_BLOCKS)
    assert run_step(scheduler, worker, "a", list(range(BS)), [0], False) == 0
    assert run_step(scheduler, worker, "b", list(range(BS)), [1], False) == 0  # the last token is always computed
    assert run_step(scheduler, worker, "c", list(range(100, 100 + 3 * BS)), [2, 3, 4], False) == 0


def test_longer_prompt_reuses_the_shared_prefix() -> None:
    scheduler, worker = connectors(GQA, {"chunk_size": 2 * BS})
    register(worker, "vllm>=0.29 LBHNC", GQA, NUM_BLOCKS)
    prefix = list(range(5 * BS))
    run_step(scheduler, worker, "a", prefix + [1], list(range(6)), False)
    assert run_step(scheduler, worker, "b", prefix + list(range(900, 900 + 2 * BS)), list(range(6, 14)), False) == 5 * BS


@pytest.mark.parametrize("tier, layerwise", [("disk", False), ("disk", True), ("shm", False), ("redis", False),
                                             ("redis-cluster", False), ("mooncake", False)])
def test_engines_of_other_layouts_share_one_store(request, tmp_path, tier: str, layerwise: bool) -> None:
    """Engines on one shared tier, each with its own memory: what a per-layer CPU_ATTN engine
    stored, a cross-layer one, an Ascend-style tuple one and a vLLM 0.26 one each load,
    converted into their own layout with every layer's K and V of every token and head
    bitwise the writer's (read through address_labels, not the copy's own views). A chunk of
    another model of the same shape stays a miss, and the writer still hits its own."""
    if tier in SHARED_SERVERS:
        shared = request.getfixturevalue(SHARED_SERVERS[tier]).extra()
    else:
        shared = {"tiers": ["memory", tier], tier: {"path": str(tmp_path / tier)}}
    shared.update({"chunk_size": 3 * BS, "layerwise": layerwise})
    prompt = [(11 * i + 3) % 499 for i in range(7 * BS + 5)]  # 7 full blocks, 3 chunks (3 + 3 + 1), keys of its own
    written, read = [3, 11, 5, 20, 8, 14, 1, 17], [9, 2, 23, 6, 15, 0, 12, 19]
    scheduler, worker = connectors(GQA, {**shared, "store_name": "writer"})
    register(worker, "vllm>=0.29 CPU_LBHNC", GQA, NUM_BLOCKS)
    random_bits(worker.cache, seed=1)
    assert run_step(scheduler, worker, "a", prompt, written, layerwise) == 0
    for index, variant in enumerate(("vllm>=0.29 BLHNC", "ascend_kv_tuple", "vllm0.26 NHD cross")):
        reader_scheduler, reader = connectors(GQA, {**shared, "store_name": f"reader-{index}"})
        register(reader, variant, GQA, NUM_BLOCKS)
        assert reader.cache.layout.name != worker.cache.layout.name
        assert run_step(reader_scheduler, reader, "b", prompt, read, layerwise) == 7 * BS, variant
        assert reader.stats.load_errors == 0, variant
        assert_same_blocks(worker.cache, written[:7], reader.cache, read[:7])
        if index == 0:  # CPU_BLHNC reading CPU_LBHNC: a run per block and layer (its heads side by side in
            # both), where a chunk of its own would move one run per block
            assert reader.stats.load_segments == 7 * GQA.num_layers
    other_model = dataclasses.replace(GQA, name="tiny-gqa-retrained")
    other_scheduler, other = connectors(other_model, {**shared, "store_name": "another-model"})
    register(other, "vllm>=0.29 CPU_LBHNC", other_model, NUM_BLOCKS)
    assert run_step(other_scheduler, other, "c", prompt, read, layerwise) == 0
    assert run_step(scheduler, worker, "d", prompt, read, layerwise) == 7 * BS  # its own still hit


def test_corrupt_chunk_is_recomputed_not_loaded() -> None:
    """A memory chunk damaged after it was sealed (verify="always"): the worker refuses it,
    hands its blocks back to vLLM to recompute, and the scheduler forgets it."""
    scheduler, worker = connectors(GQA, {"verify": "always"})
    register(worker, "vllm>=0.29 LBHNC", GQA, NUM_BLOCKS)
    prompt = list(range(4 * BS + 1))
    run_step(scheduler, worker, "a", prompt, [0, 1, 2, 3, 4], False)
    chunk = worker.store.memory_chunks()[0]
    chunk.buffer.storage[0].view(-1)[123] += 1  # one flipped value in host memory
    result = prefill(scheduler, worker, "b", prompt, [5, 6, 7, 8, 9])
    assert result["report"].invalid_block_ids == {5, 6, 7, 8}, "handed back to vLLM to recompute"
    assert worker.store.stats.corrupt == 1 and len(worker.store) == 0
    assert run_step(scheduler, worker, "c", prompt, [10, 11, 12, 13, 14], False) == 0


def test_full_store_evicts_and_never_fails() -> None:
    """The scheduler keeps the workers' memory budget: a prompt of four chunks into room
    for two keeps its head (the tail cannot evict chunks still being stored); a new prompt
    then evicts the least recently used, and the worker drops what was evicted."""
    one_chunk = 2 * GQA.block_bytes
    scheduler, worker = connectors(GQA, {"chunk_size": 2 * BS, "store_bytes": 2 * one_chunk})
    register(worker, "vllm>=0.29 LBHNC", GQA, NUM_BLOCKS)
    prompt = list(range(8 * BS + 1))
    run_step(scheduler, worker, "a", prompt, list(range(9)), False)
    assert len(worker.store) == 2 and worker.store.bytes <= 2 * one_chunk
    assert run_step(scheduler, worker, "b", prompt, list(range(9, 18)), False) == 2 * 2 * BS
    other = [t + 1000 for t in prompt]
    run_step(scheduler, worker, "c", other, list(range(18, 27)), False)
    assert len(worker.store) == 2 and worker.store.stats.evicted == 2
    assert lookup(scheduler, prompt) == 0 and lookup(scheduler, other) == 2 * 2 * BS


@pytest.mark.parametrize("extra, message", [
    ({"colour": "blue"}, "unknown kv_connector_extra_config key"),
    ({"store": "s3"}, "store must be 'cpu' or 'disk'"),
    ({"store": "disk"}, "the disk tier: path must be given"),
    ({"disk": {"path": "/tmp/x"}}, r"disk is a setting of the disk tier, which tiers \(\['memory'\]\) does not name"),
    ({"layerwise": "yes"}, "layerwise must be true or false"),
    ({"store_bytes": 0}, "store_bytes must be a positive integer"),
    ({"chunk_size": -32}, "chunk_size must be a positive integer"),
    ({"method": "teleport"}, "method must be 'auto' or one of"),
    ({"verify": "never"}, "verify must be 'always' or 'disk'"),
    ({"tiers": ["memory", "s3"]}, r"tiers must name each of \['memory', 'shm', 'disk', 'redis', 'mooncake'\]"),
    ({"tiers": ["memory", "memory"]}, "at most once"),
    ({"tiers": "memory"}, "tiers must be a list of tier names"),
    ({"tiers": []}, "tiers must be a list of tier names"),
    ({"tiers": ["redis"]}, "the redis tier: url must be given"),
    ({"store": "disk", "tiers": ["memory"]}, "either store"),
    ({"redis": {"url": "redis://127.0.0.1:1/0"}}, "redis is a setting of the redis tier, which tiers"),
    ({"shm": {"path": "/dev/shm/x"}}, "shm is a setting of the shm tier, which tiers"),
    ({"shm_path": "/dev/shm/x"}, "shm_path is a setting of the shm tier, which tiers"),
    ({"async_saves": 1}, "async_saves must be true or false"),
    ({"tiers": ["shm"], "shm": {"bytes": -1}}, "the shm tier: bytes must be a positive integer"),
    ({"store": "disk", "disk": {"path": 123}}, "the disk tier: path must be a non-empty string"),
    ({"tiers": ["shm"], "shm": {"path": 7}}, "the shm tier: path must be a non-empty string"),
    ({"tiers": ["redis"], "redis": {"url": 6379}}, "the redis tier: url must be a non-empty string"),
    ({"store_name": 5}, "store_name must be a non-empty string"),
    ({"store_name": ""}, "store_name must be a non-empty string"),
    ({"store_name": "x/../../../tmp/y"}, "store_name names a folder"),
    ({"store_name": ".."}, "store_name names a folder"),
    ({"store": "disk", "disk": {"path": "kv"}}, "the disk tier: path must be an absolute path"),
    ({"tiers": ["shm"], "shm": {"path": "/dev/shm"}}, "the shm tier: path must be a folder of kvlab's own"),
    ({"tiers": ["shm"], "shm": {"path": "/dev/shm/"}}, "the shm tier: path must be a folder of kvlab's own"),
])
def test_bad_extra_config_fails_at_start(extra: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        connectors(GQA, extra)


def test_chunk_size_must_be_whole_blocks() -> None:
    with pytest.raises(ValueError, match="not a multiple of the block size 16"):
        connectors(GQA, {"chunk_size": 40})


def test_defaults() -> None:
    config = ConnectorConfig.parse(None)
    assert config.store == "cpu" and not config.layerwise and config.chunk_blocks(32) == 8


def test_cross_layer_request_on_cpu_falls_back_and_the_registration_line_says_why(
        caplog: pytest.LogCaptureFixture, vllm_cpu_build) -> None:
    """One INFO line per worker: the layout, the tiers, what became of the cross-layer request
    (here: this process never loaded kvlab's backend plugin, so vLLM keeps CPU_ATTN's LBHNC)."""
    assert KVLabConnector.get_required_kvcache_layout(stand_in_config(GQA, {"enable_cross_layers_blocks": True})) == "BLHNC"
    assert KVLabConnector.get_required_kvcache_layout(stand_in_config(GQA, {})) is None
    scheduler, worker = connectors(GQA, {"enable_cross_layers_blocks": True})
    assert worker.prefer_cross_layer_blocks  # what vLLM 0.12-0.28 reads
    with caplog.at_level(logging.INFO, logger="kvlab.connector"):
        register(worker, "vllm>=0.29 CPU_LBHNC", GQA, NUM_BLOCKS)  # what vLLM's CPU engine hands over
    assert registration_lines(caplog) == [
        f"KVLabConnector: rank 0 of 1 registered a CPU_LBHNC cache of {NUM_BLOCKS} blocks of {BS} tokens (per-layer "
        "segments, copied with memcpy); tiers ['memory']; cross-layer blocks asked for, given per-layer CPU_LBHNC: vLLM's CPU_ATTN "
        "declares LBHNC only and kvlab's attention backend is not loaded: VLLM_PLUGINS leaves out 'kvlab', or kvlab is "
        "not installed in this environment"]
    caplog.clear()
    _, worker = connectors(GQA)
    with caplog.at_level(logging.INFO, logger="kvlab.connector"):
        register(worker, "vllm>=0.29 CPU_LBHNC", GQA, NUM_BLOCKS)
    assert registration_lines(caplog)[0].endswith("; cross-layer blocks not asked for")


def test_unrecognised_cache_is_a_clear_error() -> None:
    _, worker = connectors(GQA)
    with pytest.raises(ValueError, match="no kvlab layout"):
        worker.register_kv_caches({layer_name(i): torch.zeros(NUM_BLOCKS, 7, 3) for i in range(GQA.num_layers)})


# ---- faults, tenants, adapters, stale weights (issue 11) --------------------------------------
def lookup(scheduler: KVLabConnector, prompt: list[int], **fields) -> int:
    return scheduler.get_num_new_matched_tokens(vllm_request("lookup", prompt, **fields), 0)[0]


def test_cache_salt_keeps_tenants_apart() -> None:
    """vLLM's own prefix cache gives salts a, b, none, a: [0, 0, 0, all]; so must the connector."""
    scheduler, worker = connectors(GQA)
    register(worker, "vllm>=0.29 LBHNC", GQA, NUM_BLOCKS)
    prompt = list(range(4 * BS + 1))
    hits = []
    for i, salt in enumerate(["a", "b", None, "a"]):
        hits.append(prefill(scheduler, worker, f"r{i}", prompt, list(range(5 * i, 5 * i + 5)), cache_salt=salt)["hit_tokens"])
    assert hits == [0, 0, 0, 4 * BS]


def test_lora_requests_never_get_base_or_other_adapters_kv(tmp_path) -> None:
    from vllm.lora.request import LoRARequest

    (tmp_path / "x").mkdir(), (tmp_path / "y").mkdir()
    scheduler, worker = connectors(GQA)
    register(worker, "vllm>=0.29 LBHNC", GQA, NUM_BLOCKS)
    prompt = list(range(4 * BS + 1))
    x, y = LoRARequest("x", 1, str(tmp_path / "x")), LoRARequest("y", 2, str(tmp_path / "y"))
    run_step(scheduler, worker, "base", prompt, [0, 1, 2, 3, 4], False)
    assert lookup(scheduler, prompt, lora_request=x) == 0
    prefill(scheduler, worker, "x", prompt, [5, 6, 7, 8, 9], lora_request=x)
    assert lookup(scheduler, prompt, lora_request=x) == 4 * BS
    assert lookup(scheduler, prompt, lora_request=y) == 0
    assert lookup(scheduler, prompt, lora_request=LoRARequest("x", 3, str(tmp_path / "x"))) == 0  # another id
    (tmp_path / "x" / "adapter_model.safetensors").write_bytes(b"new weights")
    from kvlab.connector import keys as module

    module._adapter_key.cache_clear()  # a new process: the adapter's files changed at the same path
    assert lookup(scheduler, prompt, lora_request=x) == 0


def fresh(extra: dict, model: str | None = None) -> tuple[KVLabConnector, KVLabConnector]:
    """A new engine on the same shared tiers (another process): registered, and its
    scheduler told the workers' cache, as after its first step."""
    reset_stores()
    scheduler, worker = connector_pair(GQA, NUM_BLOCKS, extra, model=model)
    register(worker, "vllm>=0.29 LBHNC", GQA, NUM_BLOCKS)
    settle(scheduler, worker)
    return scheduler, worker


def test_new_weights_at_the_same_path_are_misses_not_stale_kv(tmp_path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(bytes(4096))
    extra = {"store": "disk", "disk": {"path": str(tmp_path / "kv")}}
    scheduler, worker = fresh(extra, str(folder))
    prompt = list(range(4 * BS + 1))
    run_step(scheduler, worker, "a", prompt, [0, 1, 2, 3, 4], False)
    assert lookup(fresh(extra, str(folder))[0], prompt) == 4 * BS
    (folder / "model.safetensors").write_bytes(b"\x01" + bytes(4095))  # fine-tuned in place
    assert lookup(fresh(extra, str(folder))[0], prompt) == 0


def test_every_damaged_chunk_of_a_prompt_is_saved_again(tmp_path) -> None:
    extra = {"store": "disk", "disk": {"path": str(tmp_path / "kv")}, "chunk_size": BS}
    scheduler, worker = fresh(extra)
    prompt = list(range(4 * BS + 1))
    run_step(scheduler, worker, "a", prompt, [0, 1, 2, 3, 4], False)
    files = sorted((tmp_path / "kv").glob("*.kvchunk"))
    assert len(files) == 4
    for path in files:
        data = bytearray(path.read_bytes())
        data[-5] ^= 0x10
        path.write_bytes(bytes(data))
    scheduler, worker = fresh({"tiers": ["disk"], "disk": extra["disk"], "chunk_size": BS})
    result = prefill(scheduler, worker, "b", prompt, [5, 6, 7, 8, 9])
    assert result["hit_tokens"] == 4 * BS, "promised from their headers, which are intact"
    assert result["report"].invalid_block_ids == {5, 6, 7, 8}, "every payload failed its check at the load"
    assert sorted((tmp_path / "kv").glob("*.kvchunk")) == [], "and every damaged file was dropped"
    assert run_step(scheduler, worker, "c", prompt, [5, 6, 7, 8, 9], False) == 0
    assert worker.stats.saved_blocks == 4, "all four chunks written again, not only the first"
    assert lookup(fresh(extra)[0], prompt) == 4 * BS


def test_an_unavailable_method_fails_at_start_up(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _, worker = connectors(GQA, {"method": "triton"})
    with pytest.raises(ValueError, match="method 'triton' cannot run here: triton kernels need a CUDA device"):
        register(worker, "vllm>=0.29 LBHNC", GQA, NUM_BLOCKS)


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole-step", "layerwise"])
def test_a_failing_save_or_load_never_reaches_the_request(monkeypatch, caplog, layerwise) -> None:
    """Not strict: every error is recomputed or stores nothing, and is logged each time, the
    first of its kind with its traceback."""
    scheduler, worker = connectors(GQA, {"layerwise": layerwise, "strict": False})
    register(worker, "vllm>=0.29 LBHNC", GQA, NUM_BLOCKS)
    prompt = list(range(4 * BS + 1))

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("kvlab.connector.worker.host_buffer", broken)
    with caplog.at_level(logging.WARNING, logger="kvlab.connector"):
        run_step(scheduler, worker, "a", prompt, [0, 1, 2, 3, 4], layerwise)
        run_step(scheduler, worker, "b", prompt, [5, 6, 7, 8, 9], layerwise)
    assert worker.stats.save_errors == 2 and caplog.text.count("a save failed") == 2
    assert caplog.text.count("Traceback (most recent call last)") == 1 and "in broken" in caplog.text
    monkeypatch.undo()
    run_step(scheduler, worker, "c", prompt, [0, 1, 2, 3, 4], layerwise)  # saved now

    def no_copy(*args, **kwargs):
        raise RuntimeError("copy engine fault")

    monkeypatch.setattr("kvlab.connector.worker.run_all", no_copy)
    monkeypatch.setattr("kvlab.transfer.Transfer.run", no_copy)
    result = prefill(scheduler, worker, "d", prompt, [10, 11, 12, 13, 14], layerwise)
    assert result["hit_tokens"] == 4 * BS
    assert result["report"].invalid_block_ids == {10, 11, 12, 13}, "handed back to vLLM to recompute"
    assert worker.stats.load_errors == 1


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole-step", "layerwise"])
def test_strict_raises_what_is_not_the_stores_fault(monkeypatch, layerwise) -> None:
    """The tests' connectors are strict (kvlab.harness.driver): a bug in a load or a save raises
    instead of looking like a recompute, while a fault of the store (an OSError, a failed
    check) is still recomputed or stores nothing."""
    scheduler, worker = connectors(GQA, {"layerwise": layerwise})
    register(worker, "vllm>=0.29 LBHNC", GQA, NUM_BLOCKS)
    prompt = list(range(4 * BS + 1))

    def no_room(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("kvlab.connector.worker.host_buffer", no_room)
    run_step(scheduler, worker, "a", prompt, [0, 1, 2, 3, 4], layerwise)  # the store's fault: stores nothing
    assert worker.stats.save_errors == 1
    monkeypatch.undo()
    run_step(scheduler, worker, "b", prompt, [5, 6, 7, 8, 9], layerwise)  # saved now

    def bug(*args, **kwargs):
        raise TypeError("a bug in a copy")

    with monkeypatch.context() as patch:
        patch.setattr("kvlab.connector.worker.run_all", bug)
        patch.setattr("kvlab.transfer.Transfer.run", bug)
        with pytest.raises((TypeError, RuntimeError), match="a bug in a copy|layerwise load failed") as raised:
            prefill(scheduler, worker, "c", prompt, [10, 11, 12, 13, 14], layerwise)
    assert "a bug in a copy" in repr(raised.value) + repr(raised.value.__cause__)
    reset_stores()  # an engine whose connector raised is gone: a new one
    scheduler, worker = connectors(GQA, {"layerwise": layerwise})
    register(worker, "vllm>=0.29 LBHNC", GQA, NUM_BLOCKS)
    with monkeypatch.context() as patch:  # a save's bug raises on the model runner's thread, not on the save thread
        patch.setattr("kvlab.connector.worker.Chunk", bug)
        with pytest.raises(TypeError, match="a bug in a copy"):
            run_step(scheduler, worker, "d", prompt, [15, 16, 17, 18, 19], layerwise)
    assert worker.worker.config.strict


def test_another_engine_finds_a_prompts_last_chunk_in_a_shared_folder_and_saves_nothing_again(tmp_path) -> None:
    """A block-aligned prompt's last chunk ends with the block holding its last token, which
    no lookup loads (vLLM computes that token): the chunk is still found by a new engine's
    disk tier, which finds files by the chunk names a prompt's keys give, and every chunk is
    held already, so the hit writes nothing again."""
    extra = {"tiers": ["disk"], "disk": {"path": str(tmp_path / "kv")}, "chunk_size": 2 * BS}
    scheduler, worker = fresh(extra)
    prompt = list(range(4 * BS))  # blocks k0..k3 in chunks (k0, k1) and (k2, k3)
    run_step(scheduler, worker, "a", prompt, [0, 1, 2, 3], False)
    scheduler, worker = fresh(extra)  # another process: nothing indexed
    assert run_step(scheduler, worker, "b", prompt, [4, 5, 6, 7], False) == 3 * BS
    assert worker.stats.saved_blocks == 0


def test_only_the_tiers_named_open(tmp_path) -> None:
    """A tier registered in the process (notebook 05's, a test's) is opened by a connector
    only where its ``tiers`` name it: nothing is written to it otherwise."""
    from kvlab.store.tiers import MemoryTier, register_tier, unregister_tier

    class Listed(MemoryTier):
        name, shared = "listed", True

    opened: list[Listed] = []

    def factory(*args) -> Listed:  # (settings, store)
        opened.append(Listed(1 << 30, args[-1].stats))
        return opened[-1]

    register_tier("listed", factory)
    try:
        scheduler, worker = connectors(GQA, {"tiers": ["memory"], "chunk_size": BS})
        register(worker, "vllm>=0.29 LBHNC", GQA, NUM_BLOCKS)
        run_step(scheduler, worker, "a", list(range(4 * BS + 1)), list(range(5)), False)
        assert worker.store.shared_names == () and worker.stats.saved_blocks == 4
        assert sum(len(tier) for tier in opened) == 0, "a tier tiers does not name was written to"
        reset_stores()
        scheduler, worker = connectors(GQA, {"tiers": ["memory", "listed"], "chunk_size": BS})
        register(worker, "vllm>=0.29 LBHNC", GQA, NUM_BLOCKS)
        run_step(scheduler, worker, "a", list(range(4 * BS + 1)), list(range(5)), False)
        assert worker.store.shared_names == ("listed",) and len(worker.store.tier("listed")) == 4
    finally:
        unregister_tier("listed")
