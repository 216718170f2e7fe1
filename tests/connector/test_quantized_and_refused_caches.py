"""KVLabConnector with the caches of issue 48, driven without an engine (kvlab.harness.driver):
quantized caches move bit for bit, scales and all; a hybrid model's shared group buffer and
a quantized format kvlab has no layout for are refused, by both sides, with a log line that
names the layout, and nothing of them is ever stored."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from kvlab.cache import ModelGeometry  # noqa: E402
from kvlab.cache.hybrid import HybridGeometry, KVGroup  # noqa: E402
from kvlab.connector import KVLabConnector  # noqa: E402
from kvlab.harness.driver import connector_pair, hybrid_connector_pair, prefill, register, stand_in_config  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_stores")

NUM_BLOCKS = 16
BS = 16
PROMPT = [(5 * i) % 311 for i in range(4 * BS + 3)]  # 4 full blocks
QUANTIZED = [("int8_per_token_head", "vllm>=0.29 LBHNC"), ("fp8_per_token_head", "vllm>=0.29 BLNHC"),
             ("nvfp4", "vllm>=0.29 nvfp4_LBNHC"), ("nvfp4", "vllm>=0.29 nvfp4_BLHNC")]


def pages(worker: KVLabConnector, blocks: list[int]) -> list[torch.Tensor]:
    return [view[blocks].contiguous().view(torch.uint8) for view in worker.cache.layers.values()]


@pytest.mark.parametrize("quant, how", QUANTIZED, ids=[f"{q}-{h.split()[1]}" for q, h in QUANTIZED])
def test_a_quantized_cache_comes_back_bit_for_bit(quant: str, how: str) -> None:
    geometry = ModelGeometry("tiny", 3, 2, 32, block_size=BS).quantized(quant)
    scheduler, worker = connector_pair(geometry, NUM_BLOCKS, {"chunk_size": 2 * BS})
    register(worker, how, geometry, NUM_BLOCKS)
    assert worker.cache.layout.name == how.split()[1] and worker.cache.geometry.quant.name == quant
    worker.cache.storage[0].view(torch.uint8).random_(generator=torch.Generator().manual_seed(1))
    assert prefill(scheduler, worker, "a", PROMPT, [3, 9, 5, 12, 1])["hit_tokens"] == 0
    expected = pages(worker, [3, 9, 5, 12])
    worker.cache.storage[0].zero_()
    assert prefill(scheduler, worker, "b", PROMPT, [8, 2, 14, 6, 0])["hit_tokens"] == 4 * BS
    assert all(torch.equal(a, b) for a, b in zip(expected, pages(worker, [8, 2, 14, 6])))


GQA = ModelGeometry("hybrid-gqa", 1, 2, 32, torch.float32, block_size=BS)
HYBRIDS = {
    "mamba": HybridGeometry("qwen-next-like", (KVGroup.attention(GQA, [0, 2]), KVGroup.mamba([1, 3], 2432, GQA.page_bytes))),
    "sliding window": HybridGeometry("gemma-like", (KVGroup.attention(GQA, [0, 2]),
                                                    KVGroup.attention(GQA, [1, 3], window=32))),
}


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
@pytest.mark.parametrize("kind", list(HYBRIDS))
def test_a_hybrid_cache_is_refused_and_nothing_of_it_is_stored(kind: str, layout: str, caplog) -> None:
    scheduler, worker, views = hybrid_connector_pair(HYBRIDS[kind], layout, NUM_BLOCKS)
    with caplog.at_level(logging.WARNING, logger="kvlab.connector"):
        worker.register_kv_caches(views)
    lines = [r.getMessage() for r in caplog.records if "refusing" in r.getMessage()]
    assert len(lines) == 2  # the scheduler side at start-up, the worker side at registration
    assert f"refusing a hybrid KV cache ({layout}): 2 KV cache group(s) share one buffer" in lines[1]
    assert kind.replace(" ", "_") in lines[1] and "nothing is stored or loaded" in lines[1]
    assert worker.cache is None
    for req in ("a", "b"):
        assert prefill(scheduler, worker, req, PROMPT, [3, 9, 5, 12, 1])["hit_tokens"] == 0
    assert len(worker.store) == 0 and worker.stats.saved_blocks == 0


def test_a_quantized_format_without_a_kvlab_layout_is_refused(caplog) -> None:
    config = stand_in_config(ModelGeometry("tiny", 2, 2, 32, block_size=BS))
    config.cache_config.cache_dtype = "int4_per_token_head"  # packed 4-bit rows: no kvlab layout
    kv_config = SimpleNamespace(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_layout="LBHNC")
    with caplog.at_level(logging.WARNING, logger="kvlab.connector"):
        scheduler = KVLabConnector(config, KVConnectorRole.SCHEDULER, kv_config)
        worker = KVLabConnector(config, KVConnectorRole.WORKER, kv_config)
        worker.register_kv_caches({"model.layers.0.self_attn.attn": torch.zeros(NUM_BLOCKS, 2, BS, 40, dtype=torch.uint8)})
    assert caplog.text.count("refusing a KV cache of int4_per_token_head rows (LBHNC): kvlab has no layout") == 2
    assert worker.cache is None and scheduler.get_num_new_matched_tokens(None, 0) == (0, False)
