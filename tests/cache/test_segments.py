import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.cache import (
    ModelGeometry,
    address_labels,
    allocations,
    block_segments,
    check_block_ids,
    compatible_layouts,
    preset,
    scattered_block_ids,
    span_segments,
    sweep,
    token_segments,
    token_spans,
    transfer_cost,
)

LLAMA = preset("llama-3.1-8b")
KiB, MiB = 1024, 1024 * 1024


@pytest.mark.parametrize(
    "layout, segments, size",
    [("LBHNC", 512, 64 * KiB), ("BLHNC", 16, 2 * MiB), ("flash_attn_v0.12", 1024, 32 * KiB)],
)
def test_llama_256_tokens_scattered(layout, segments, size):
    cost = transfer_cost(layout, LLAMA, 256, block_ids="scattered", seed=0)
    assert (cost["segments"], cost["segment_sizes"]) == (segments, {size: segments})
    assert cost["bytes_moved"] == cost["bytes"] == 256 * 131072


def test_llama_256_tokens_contiguous():
    assert transfer_cost("BLHNC", LLAMA, 256, block_ids="contiguous")["segments"] == 1
    assert transfer_cost("LBHNC", LLAMA, 256, block_ids="contiguous")["segment_sizes"] == {MiB: 32}


def test_chunk_format_cost_is_the_chunk_itself():
    cost = transfer_cost("KV_2LTD", LLAMA, 256)
    assert cost["block_ids"] == "chunk" and cost["segment_sizes"] == {32 * MiB: 1}
    assert transfer_cost("KV_T2D", LLAMA, 256)["segment_sizes"] == {MiB: 32}


def brute_force(layout, geometry, num_blocks, spans):
    """Mark every touched byte, then count the runs of marked bytes per backing tensor."""
    labels = address_labels(layout, geometry, num_blocks)
    wanted = torch.zeros(len(labels["block"]), dtype=torch.bool)
    for block, first, last in spans:
        wanted |= (labels["block"] == block) & (labels["token"] >= first) & (labels["token"] < last)
    runs = set()
    start = 0
    for index, alloc in enumerate(allocations(layout, geometry, num_blocks)):
        vector_bytes = alloc.sizes[-1] * geometry.itemsize
        count = alloc.numel // alloc.sizes[-1]
        mask = wanted[start: start + count].repeat_interleave(vector_bytes)
        start += count
        edges = torch.diff(mask.int(), prepend=torch.tensor([0]), append=torch.tensor([0]))
        for s, e in zip((edges == 1).nonzero().flatten().tolist(), (edges == -1).nonzero().flatten().tolist()):
            runs.add((index, s, e - s))
    return runs


@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_segments_equal_brute_force(data):
    mla = data.draw(st.booleans())
    layers, block, num_blocks = data.draw(st.integers(1, 3)), data.draw(st.sampled_from([1, 2, 4])), data.draw(st.integers(1, 6))
    if mla:
        geometry = ModelGeometry.mla("m", layers, 4, 2, dtype="float16", block_size=block)
    else:
        geometry = ModelGeometry("g", layers, data.draw(st.integers(1, 3)), data.draw(st.sampled_from([1, 2, 4])),
                                 dtype=data.draw(st.sampled_from(["float32", "bfloat16", "float8_e5m2"])), block_size=block)
    layout = data.draw(st.sampled_from(compatible_layouts(geometry)))
    ids = data.draw(st.lists(st.integers(0, num_blocks - 1), unique=True, max_size=num_blocks))
    spans = []
    for b in ids:
        first = data.draw(st.integers(0, block - 1))
        spans.append((b, first, data.draw(st.integers(first + 1, block))))
    seg = span_segments(layout, geometry, num_blocks, spans)
    got = set(zip(seg.tensor.tolist(), seg.start.tolist(), seg.length.tolist()))
    assert got == brute_force(layout, geometry, num_blocks, spans)
    assert seg.total_bytes == sum(e - s for _, s, e in spans) * geometry.token_bytes


def test_empty_selection():
    seg = block_segments("LBHNC", LLAMA, 4, [])
    assert (seg.count, seg.total_bytes) == (0, 0)


def test_token_range_partial_blocks():
    geometry = LLAMA.with_(num_layers=2)
    seg = token_segments("BLHNC", geometry, 8, [5, 2], 3, 20)
    # tokens 3..15 of block 5 and 0..3 of block 2, per layer and head
    assert seg.total_bytes == 17 * geometry.token_bytes
    assert token_spans([5, 2], 3, 20, 16) == [(5, 3, 16), (2, 0, 4)]


@pytest.mark.parametrize(
    "args, message",
    [(([1], 0, 0, 16), "empty"), (([1], 0, 40, 16), "needs 3 blocks, the block table has 1")],
)
def test_bad_token_range(args, message):
    with pytest.raises(ValueError, match=message):
        token_spans(*args)


def test_bad_spans_and_ids():
    with pytest.raises(ValueError, match="are not \\(block, first, end\\)"):
        span_segments("LBHNC", LLAMA, 8, [(1, 0, 17)])
    with pytest.raises(ValueError, match="are not \\(block, first, end\\)"):
        span_segments("LBHNC", LLAMA, 8, [(1, 5, 5)])
    with pytest.raises(ValueError, match="block ids must be integers"):
        block_segments("LBHNC", LLAMA, 8, [1.5])
    with pytest.raises(ValueError, match="count must be >= 0"):
        scattered_block_ids(-1, 8)


def test_bad_block_ids():
    with pytest.raises(ValueError, match=r"block ids \[9\] out of range: the cache has blocks 0..7"):
        check_block_ids([1, 9], 8)
    with pytest.raises(ValueError, match=r"block ids \[3\] appear more than once"):
        block_segments("LBHNC", LLAMA, 8, [3, 1, 3])
    with pytest.raises(ValueError, match="out of range"):
        block_segments("LBHNC", LLAMA, 8, [-1])


def test_scattered_ids_are_seeded_and_never_adjacent():
    ids = scattered_block_ids(16, 40, seed=3)
    assert ids == scattered_block_ids(16, 40, seed=3) != scattered_block_ids(16, 40, seed=4)
    ordered = sorted(ids)
    assert len(set(ids)) == 16 and all(b - a >= 2 for a, b in zip(ordered, ordered[1:]))
    with pytest.raises(ValueError, match="need at least 31 blocks"):
        scattered_block_ids(16, 30)


def test_transfer_cost_bad_input():
    with pytest.raises(ValueError, match="tokens must be a positive integer"):
        transfer_cost("LBHNC", LLAMA, 0)
    with pytest.raises(ValueError, match="'scattered', 'contiguous' or a list"):
        transfer_cost("LBHNC", LLAMA, 16, block_ids="random")
    assert transfer_cost("LBHNC", LLAMA, 32, block_ids=[7, 3], num_blocks=8)["segments"] == 64


def test_sweep_rows():
    rows = sweep(["LBHNC", "BLHNC"], LLAMA, [16, 256], [16, 64])
    assert len(rows) == 8 and {r["block_size"] for r in rows} == {16, 64}
