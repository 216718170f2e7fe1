"""Quantized caches and a hybrid model's groups move bit for bit through kvlab.transfer: the
scales and padding with their values, one group's blocks without touching another's."""

import pytest
import torch

from kvlab.cache import ModelGeometry, compatible_layouts
from kvlab.cache.hybrid import HYBRID_LAYOUTS, HybridGeometry, KVGroup, allocate_hybrid
from kvlab.cache.quant import QUANTS
from kvlab.experiments.roundtrip import roundtrip
from kvlab.transfer import Transfer, host_buffer

SMALL = ModelGeometry("small", 3, 2, 32, block_size=4)
CASES = [(name, layout) for name in QUANTS for layout in compatible_layouts(SMALL.quantized(name), chunk_formats=False)]


@pytest.mark.parametrize("path", ["whole", "layerwise"])
@pytest.mark.parametrize("method", ["segments", "memcpy", "gather"])
@pytest.mark.parametrize("quant, layout", CASES, ids=[f"{q}-{l}" for q, l in CASES])
def test_quantized_round_trip_is_bit_exact(quant, layout, method, path):
    row = roundtrip(layout, SMALL.quantized(quant), method, path=path)
    assert row["status"] == "ok" and row["exact"], row
    assert row["bytes"] == 3 * SMALL.quantized(quant).block_bytes  # values, scales and padding: whole pages


GQA = ModelGeometry("hybrid-gqa", 1, 2, 16, torch.float32, block_size=4)
HYBRID = HybridGeometry("hybrid", (KVGroup.attention(GQA, [0, 3]), KVGroup.attention(GQA, [1, 4], window=8),
                                   KVGroup.mamba([2, 5], 96, GQA.page_bytes)))


@pytest.mark.parametrize("layout", HYBRID_LAYOUTS)
@pytest.mark.parametrize("group", [0, 1])
def test_an_attention_group_round_trips_and_leaves_the_other_groups_blocks_alone(layout, group):
    cache = allocate_hybrid(HYBRID, layout, 8)
    cache.buffer.view(torch.uint8).copy_(torch.randint(0, 256, cache.buffer.shape, dtype=torch.uint8,
                                                       generator=torch.Generator().manual_seed(group)))
    kv = cache.group_cache(group)
    mine, theirs = [1, 6], [0, 2, 3, 4, 5, 7]  # block ids the scheduler gave this group, and the others
    before = {b: _block(cache, b) for b in theirs}
    saved = _pages(kv, mine)
    buffer = host_buffer(kv, 2)
    Transfer(kv, mine, buffer, method="gather").run()
    for view in kv.layers.values():
        view[mine] = 0
    Transfer(buffer, [0, 1], kv, mine, method="memcpy").run()
    assert all(torch.equal(a, b) for a, b in zip(saved, _pages(kv, mine)))
    assert all(torch.equal(before[b], _block(cache, b)) for b in theirs)


def _pages(kv, blocks):
    return [view.select(0, b).contiguous().view(torch.uint8) for view in kv.layers.values() for b in blocks]  # bits


def _block(cache, block):
    """Every byte of a block id, whatever group's pages it holds."""
    stride = cache.placements[0].block_stride
    if cache.layout.startswith("B"):  # block-outer: a block is one run
        return cache.buffer[block * stride:(block + 1) * stride].clone()
    return cache.buffer.view(-1, cache.num_blocks, stride)[:, block].clone()  # a page in each layer slot
