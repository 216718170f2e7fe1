"""The transfer engine moves exactly the right bytes, with every method, and says why it won't.

Caches are filled with random bits (NaN and infinity patterns included), and every check
reads them back bitwise through ``address_labels`` (tests/logical_kv.py), not through the
transfer module's own views, so a wrong stride in the engine cannot hide itself.
"""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from logical_kv import assert_other_blocks, assert_same_blocks, kv_bytes, random_bits

from kvlab.cache import (
    LAYOUTS,
    ModelGeometry,
    allocate,
    allocations,
    block_segments,
    compatible_layouts,
    from_storage,
    preset,
    scattered_block_ids,
)
from kvlab.transfer import (
    HeadSlice,
    LayerwiseLoad,
    Transfer,
    chunk_buffer,
    host_buffer,
    method_status,
)
from kvlab.transfer.views import layer_slices

KV = ModelGeometry("kv", 2, 2, 8, dtype="bfloat16", block_size=4)
MLA = ModelGeometry.mla("mla", 2, 12, 4, dtype="bfloat16", block_size=4)
INT8 = ModelGeometry("int8", 2, 2, 32, dtype="int8", quant="int8_per_token_head", block_size=4)
KV_LAYOUTS = compatible_layouts(KV, chunk_formats=False)
MLA_LAYOUTS = compatible_layouts(MLA, chunk_formats=False)
PAGED = [(False, name) for name in KV_LAYOUTS] + [(True, name) for name in MLA_LAYOUTS]
CHUNK_FORMATS = [name for name, layout in LAYOUTS.items() if layout.is_chunk_format]
FP8 = ["float8_e4m3fn"] if hasattr(torch, "float8_e4m3fn") else []
DTYPES = ["float32", "bfloat16", "float16"] + FP8


def round_trip(src, ids, buffer, buffer_blocks, method, **kw):
    """Offload blocks ``ids`` of ``src`` into ``buffer``, load them into a fresh zeroed cache
    at the same ids, and check both hops; returns the fresh cache."""
    Transfer(src, ids, buffer, buffer_blocks, method, **kw).run()
    used = list(range(len(ids))) if buffer_blocks is None else buffer_blocks
    assert_same_blocks(src, ids, buffer, used)
    assert_other_blocks(buffer, used)
    fresh = allocate(src.layout, src.geometry, src.num_blocks)
    Transfer(buffer, used, fresh, ids, method, **kw).run()
    assert_same_blocks(fresh, ids, src, ids)
    assert_other_blocks(fresh, ids)
    return fresh


def assert_bitwise_equal(a, b):
    """Two caches' backing tensors are identical byte for byte."""
    assert len(a.storage) == len(b.storage)
    for x, y in zip(a.storage, b.storage):
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))


@st.composite
def geometries(draw, mla, dtypes=DTYPES):
    """Small geometries: K/V, or MLA (a toy latent, or DeepSeek-V2-Lite's 512+64 cut to 2 layers)."""
    dtype = draw(st.sampled_from(dtypes))
    block = draw(st.sampled_from([2, 4, 16]))
    layers = draw(st.integers(1, 3))
    if mla:
        if draw(st.integers(0, 4)) == 0:
            return preset("deepseek-v2-lite").with_(num_layers=2, dtype=dtype, block_size=block)
        rank, rope = draw(st.sampled_from([8, 12, 16])), draw(st.sampled_from([4, 8]))
        return ModelGeometry.mla("mla", layers, rank, rope, dtype=dtype, block_size=block)
    heads, head = draw(st.integers(1, 3)), draw(st.sampled_from([4, 8, 16]))
    return ModelGeometry("kv", layers, heads, head, dtype=dtype, block_size=block)


@st.composite
def block_id_sets(draw, num_blocks):
    """Distinct block ids: scattered (no two adjacent), contiguous, empty, or any order."""
    kind = draw(st.sampled_from(["scattered", "contiguous", "empty", "any"]))
    if kind == "empty":
        return []
    if kind == "scattered":
        count = draw(st.integers(1, (num_blocks + 1) // 2))
        return scattered_block_ids(count, num_blocks, seed=draw(st.integers(0, 99)))
    if kind == "contiguous":
        count = draw(st.integers(1, num_blocks))
        start = draw(st.integers(0, num_blocks - count))
        return list(range(start, start + count))
    return draw(st.lists(st.integers(0, num_blocks - 1), unique=True, max_size=num_blocks))


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty_like hands out 0xA5 bytes, not whatever memory held before: reading
    uninitialised memory then shows deterministically."""
    empty_like = torch.empty_like

    def poisoned(*args, **kwargs):
        out = empty_like(*args, **kwargs)
        out.view(-1).view(torch.uint8).fill_(0xA5)
        return out

    monkeypatch.setattr(torch, "empty_like", poisoned)


@pytest.mark.parametrize("mla, layout", PAGED, ids=[f"{n}-{'mla' if m else 'kv'}" for m, n in PAGED])
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_round_trip_is_bit_exact(mla, layout, data):
    """Offload then load gives back every bit (NaN patterns too) and touches no other block,
    for every paged layout, with segments, gather and memcpy, packed or explicit buffer blocks."""
    geometry = data.draw(geometries(mla))
    num_blocks = data.draw(st.integers(1, 8))
    ids = data.draw(block_id_sets(num_blocks))
    size = max(1, len(ids) + data.draw(st.integers(0, 2)))
    explicit = data.draw(st.booleans())
    buffer_blocks = data.draw(st.permutations(range(size)))[:len(ids)] if explicit else None
    src = random_bits(allocate(layout, geometry, num_blocks), data.draw(st.integers(0, 2**16)))
    buffers = []
    for method in ("segments", "gather", "memcpy"):
        buffers.append(host_buffer(src, size))
        round_trip(src, ids, buffers[-1], buffer_blocks, method)
    for other in buffers[1:]:
        assert_bitwise_equal(buffers[0], other)


@pytest.mark.parametrize("mla", [False, True], ids=["kv", "mla"])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_a_copy_between_two_paged_layouts_converts_bit_exact(mla, data):
    """Blocks of one paged layout copied into another (a chunk stored by an engine of one
    layout, loaded by an engine of another) hold every layer's parts of every token and head
    bitwise, with every kvlab method, and leave the other blocks alone."""
    layouts = MLA_LAYOUTS if mla else KV_LAYOUTS
    source, target = data.draw(st.sampled_from(layouts)), data.draw(st.sampled_from(layouts))
    geometry = data.draw(geometries(mla))
    src = random_bits(allocate(source, geometry, 5), data.draw(st.integers(0, 2**16)))
    ids = data.draw(block_id_sets(5))
    into = data.draw(st.permutations(range(6)))[:len(ids)]
    for method in ("segments", "gather", "memcpy"):
        dst = allocate(target, geometry, 6)
        Transfer(src, ids, dst, into, method).run()
        assert_same_blocks(src, ids, dst, into)
        assert_other_blocks(dst, into)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_head_slice_moves_one_shards_heads_into_another_bit_exact(data):
    """The kv heads of one tensor-parallel shard copied into another's (a chunk a TP=1 engine
    stored, loaded by a rank of a TP=2 engine, or the reverse), between any two paged
    layouts: each head lands at its place bitwise in every layer, token and part, and no
    other head or block of the destination changes."""
    source, target = data.draw(st.sampled_from(KV_LAYOUTS)), data.draw(st.sampled_from(KV_LAYOUTS))
    whole = data.draw(geometries(False)).with_(num_kv_heads=data.draw(st.sampled_from([2, 4, 6])))
    src_heads, dst_heads = (data.draw(st.sampled_from([h for h in (1, 2, 3, 4, 6) if whole.num_kv_heads % h == 0]))
                            for _ in range(2))
    count = data.draw(st.integers(1, min(src_heads, dst_heads)))
    heads = HeadSlice(data.draw(st.integers(0, src_heads - count)), data.draw(st.integers(0, dst_heads - count)), count)
    src = random_bits(allocate(source, whole.with_(num_kv_heads=src_heads), 5), data.draw(st.integers(0, 2**16)))
    ids = data.draw(block_id_sets(5))
    into = data.draw(st.permutations(range(6)))[:len(ids)]
    for method in ("segments", "memcpy"):
        dst = random_bits(allocate(target, whole.with_(num_kv_heads=dst_heads), 6), seed=3)
        before = kv_bytes(dst)
        moved = Transfer(src, ids, dst, into, method, heads=heads).run()
        after, expected = kv_bytes(dst), before.clone()
        expected[:, into, :, heads.dst_start:heads.dst_start + count] = \
            kv_bytes(src)[:, ids, :, heads.src_start:heads.src_start + count]
        assert torch.equal(after, expected), (source, target, heads, method)
        assert moved.nbytes == moved.plan.nbytes == expected[:, into, :, :count].numel()


def test_a_head_slice_is_refused_where_it_cannot_be_right():
    """Heads past either shard's end, caches of two models, an MLA latent (the same on every
    rank) and a method that copies whole heads each get a clear error, before any byte moves."""
    two, one = allocate("LBHNC", KV, 2), allocate("LBHNC", KV.with_(num_kv_heads=1), 2)
    with pytest.raises(ValueError, match="heads 1..2 of 2 into heads 0..1 of 1: out of range"):
        Transfer(two, [0], one, [0], "memcpy", heads=HeadSlice(1, 0, 2))
    with pytest.raises(ValueError, match="not shards of one model's KV"):
        Transfer(two, [0], allocate("LBHNC", KV.with_(num_kv_heads=1, head_size=16), 2), [0], "memcpy",
                 heads=HeadSlice(0, 0, 1))
    mla = allocate("LBHNC", MLA, 2)
    with pytest.raises(ValueError, match="MLA latent is the same on every rank"):
        Transfer(mla, [0], allocate("LBHNC", MLA, 2), [0], "memcpy", heads=HeadSlice(0, 0, 1))
    with pytest.raises(ValueError, match="'gather' copies whole heads"):
        Transfer(two, [0], one, [0], "gather", heads=HeadSlice(1, 0, 1))
    with pytest.raises(ValueError, match="hold different KV"):
        Transfer(two, [0], one, [0], "memcpy")


@pytest.mark.skipif(not FP8, reason="this torch has no float8_e4m3fn")
@pytest.mark.parametrize("layout", ["LBHNC", "flash_attn_v0.12"])
def test_gather_moves_fp8(layout):
    """fp8 caches move with gather like any other dtype (load, scattered buffer blocks): a
    fixed case of a past failure (CPU index_copy_ has no float8 kernel)."""
    src = random_bits(allocate(layout, KV.with_(dtype="float8_e4m3fn"), 6))
    round_trip(src, [4, 1], host_buffer(src, 3), [2, 0], "gather")


# packed destination, packed source, neither: each of gather's paths
MOVES = [([0, 1], [2, 3]), ([5, 2], [0, 1]), ([1, 2], [5, 3]), ([4, 0], [1, 5])]


@pytest.mark.parametrize("method", ["segments", "gather", "compiled", "memcpy"])
@pytest.mark.parametrize("mla, layout", PAGED, ids=[f"{n}-{'mla' if m else 'kv'}" for m, n in PAGED])
def test_move_inside_one_cache(mla, layout, method):
    """Blocks moved to other blocks of the same cache (none of them a source) arrive
    bit-exactly and nothing else changes."""
    cache = random_bits(allocate(layout, MLA if mla else KV, 6), seed=9)
    if method_status(method, cache, cache):
        pytest.skip(method_status(method, cache, cache))
    for src_blocks, dst_blocks in MOVES:
        before = dataclasses.replace(cache, storage=[t.clone() for t in cache.storage])
        Transfer(cache, src_blocks, cache, dst_blocks, method).run()
        assert_same_blocks(cache, dst_blocks, before, src_blocks)
        assert_other_blocks(cache, dst_blocks, kv_bytes(before))


@pytest.mark.parametrize("method", ["segments", "gather", "compiled", "memcpy"])
@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC", "ascend_kv_tuple"])
def test_overlapping_move_is_refused(layout, method):
    """A move that reads blocks it also writes (a swap, a shift, a block onto itself) would
    leave whatever its copy order leaves: every method refuses it, as does a layerwise load."""
    cache = allocate(layout, KV, 4)
    same_memory = dataclasses.replace(cache)
    for src, src_blocks, dst, dst_blocks in ((cache, [0, 1], cache, [1, 0]), (cache, [0, 1], cache, [1, 2]),
                                             (cache, [3], same_memory, [3])):
        with pytest.raises(ValueError, match="source and destination blocks overlap in the same memory"):
            Transfer(src, src_blocks, dst, dst_blocks, method)
    with pytest.raises(ValueError, match="source and destination blocks overlap in the same memory"):
        LayerwiseLoad(cache, cache, [0, 1], [1, 0], method=method)


def test_caches_cut_from_one_buffer():
    """Caches sharing memory are compared by the bytes they move, not by block ids: block 1
    of a cache is block 0 of a cache cut from its blocks 1..2 (refused), block 0 -> the
    cut's block 1 (the cache's block 2) goes ahead."""
    cache = random_bits(allocate("BLHNC", KV, 5), seed=10)
    cut = from_storage("BLHNC", KV, 2, [cache.storage[0][1:3]])
    with pytest.raises(ValueError, match="source and destination blocks overlap in the same memory"):
        Transfer(cache, [1], cut, [0])
    before = kv_bytes(cache)
    Transfer(cache, [0], cut, [1]).run()
    assert_same_blocks(cache, [2], cache, [0])
    assert_other_blocks(cache, [2], before)
    assert "different tensors cut from one allocation" in method_status("compiled", cache, cut)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_chunk_round_trip_gather_equals_segments(data):
    """A chunk built by gather is bitwise the one built by segments, its block i is cache
    block ids[i], and loading it back restores those blocks exactly."""
    mla = data.draw(st.booleans())
    geometry = data.draw(geometries(mla))
    layout = data.draw(st.sampled_from(MLA_LAYOUTS if mla else KV_LAYOUTS))
    fmt = data.draw(st.sampled_from([f for f in CHUNK_FORMATS if f in compatible_layouts(geometry)]))
    chunk_blocks = data.draw(st.integers(1, 4))
    num_blocks = data.draw(st.integers(chunk_blocks, 8))
    count = data.draw(st.integers(1, chunk_blocks))
    ids = data.draw(st.permutations(range(num_blocks)))[:count]
    src = random_bits(allocate(layout, geometry, num_blocks), data.draw(st.integers(0, 2**16)))
    chunks = [chunk_buffer(src, fmt, chunk_blocks * geometry.block_size) for _ in range(2)]
    for chunk, method in zip(chunks, ["segments", "gather"]):
        round_trip(src, ids, chunk, None, method)
    assert_bitwise_equal(*chunks)


LMCACHE_CASES = [("flash_attn_v0.12", KV), ("flashinfer_v0.12", KV.with_(num_layers=3, num_kv_heads=3, head_size=4, block_size=2)),
                 ("mla_v0.12", MLA)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout, geometry", LMCACHE_CASES, ids=[c[0] for c in LMCACHE_CASES])
def test_lmcache_agrees_with_kvlab(layout, geometry, dtype):
    """LMCache's own multi_layer_kv_transfer, an independent oracle, builds the same chunk
    as kvlab (a full and a partly filled one) and loads it back the same."""
    geometry = geometry.with_(dtype=dtype)
    src = random_bits(allocate(layout, geometry, 6), seed=1)
    fmt = "KV_MLA_FMT" if geometry.is_mla else "KV_2LTD"
    if method_status("lmcache", src, chunk_buffer(src, fmt, geometry.block_size)):
        pytest.skip(method_status("lmcache", src, chunk_buffer(src, fmt, geometry.block_size)))
    for ids, chunk_blocks in (([5, 0, 2], 3), ([4, 1], 3)):
        ours, theirs = (chunk_buffer(src, fmt, chunk_blocks * geometry.block_size) for _ in range(2))
        Transfer(src, ids, ours, method="segments").run()
        Transfer(src, ids, theirs, method="lmcache").run()
        assert_bitwise_equal(ours, theirs)
        loaded = [allocate(layout, geometry, 6) for _ in range(2)]
        Transfer(ours, range(len(ids)), loaded[0], ids, method="gather").run()
        Transfer(ours, range(len(ids)), loaded[1], ids, method="lmcache").run()
        assert_bitwise_equal(*loaded)
        assert_same_blocks(loaded[1], ids, src, ids)


@pytest.mark.parametrize("layout, fmt", [("LBHNC", None), ("BLHNC", None), ("ascend_kv_tuple", None),
                                         ("flash_attn_v0.12", "KV_2LTD")])
def test_compiled_round_trip(layout, fmt):
    """torch.compile's fused gather-scatter moves the same bits as the reference methods."""
    src = random_bits(allocate(layout, KV, 7), seed=2)
    if fmt:
        buffer, blocks = chunk_buffer(src, fmt, 3 * KV.block_size), None
    else:
        buffer, blocks = host_buffer(src, 4), [3, 0, 1]
    if method_status("compiled", src, buffer):
        pytest.skip(method_status("compiled", src, buffer))
    round_trip(src, [5, 1, 2], buffer, blocks, "compiled")


def _triton_round_trips():
    """Run in a subprocess with TRITON_INTERPRET=1 (see test_triton_round_trip_interpreted)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for dtype in ["bfloat16"] + FP8:
        geometry = KV.with_(dtype=dtype)
        for layout, fmt in (("LBHNC", None), ("BLNHC", None), ("ascend_kv_tuple", None), ("flash_attn_v0.12", "KV_2LTD")):
            src = random_bits(allocate(layout, geometry, 7), seed=3)
            assert method_status("triton", src, src) is None
            if fmt:
                round_trip(src, [5, 1, 2], chunk_buffer(src, fmt, 3 * geometry.block_size), None, "triton")
            else:
                round_trip(src, [5, 1, 2], host_buffer(src, 4), [3, 0, 1], "triton")
    src = random_bits(allocate("mla_v0.12_cross", MLA, 5), seed=4)
    round_trip(src, [4, 0], chunk_buffer(src, "KV_MLA_FMT", 2 * MLA.block_size), None, "triton")
    print("triton round trips ok")


def test_triton_round_trip_interpreted():
    """kvlab's Triton kernel, run by Triton's interpreter on the CPU, round-trips bit-exactly
    (the variable must be set before triton is imported, hence a fresh interpreter)."""
    pytest.importorskip("triton")
    code = (f"import sys; sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}]; "
            "import test_transfer; test_transfer._triton_round_trips()")
    result = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "triton round trips ok" in result.stdout


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_plan_is_the_layouts_segments(data):
    """Into a packed buffer, sorted ids give exactly block_segments' runs (the engine merges
    every run the layout allows); any other order or a roomier buffer can only add runs.
    The plan always moves every token's bytes once."""
    mla = data.draw(st.booleans())
    geometry = data.draw(geometries(mla))
    layout = data.draw(st.sampled_from(MLA_LAYOUTS if mla else KV_LAYOUTS))
    num_blocks = data.draw(st.integers(1, 8))
    ids = sorted(data.draw(block_id_sets(num_blocks)))
    src = allocate(layout, geometry, num_blocks)
    runs = block_segments(layout, geometry, num_blocks, ids).count
    nbytes = len(ids) * geometry.block_size * geometry.token_bytes
    plan = Transfer(src, ids, host_buffer(src, max(1, len(ids)))).plan
    assert (plan.segments, plan.nbytes) == (runs, nbytes)
    shuffled = data.draw(st.permutations(ids))
    roomy = host_buffer(src, len(ids) + data.draw(st.integers(0, 2)) or 1)
    for transfer in (Transfer(src, shuffled, host_buffer(src, max(1, len(ids)))), Transfer(src, ids, roomy)):
        assert transfer.plan.segments >= runs and transfer.plan.nbytes == transfer.nbytes == nbytes


LAYERWISE = [("LBHNC", KV, None), ("BLHNC", KV, None), ("flash_attn_v0.12_cross", KV, None),
             ("ascend_kv_tuple", KV, None), ("mla_v0.12_cross", MLA, None), ("ascend_mla_tuple", MLA, None),
             ("flash_attn_v0.12", KV.with_(num_layers=3), "KV_T2D")]


@pytest.mark.parametrize("method", ["segments", "gather", "memcpy"])
@pytest.mark.parametrize("layout, geometry, fmt", LAYERWISE, ids=[f"{c[0]}-{c[2]}" for c in LAYERWISE])
def test_layerwise_load_equals_whole_load(layout, geometry, fmt, method):
    """Loading layer by layer (start, wait(i), finish) leaves what one whole load leaves,
    and a transfer restricted to layer i moves that layer and nothing else."""
    ids = [5, 1, 2]
    src = random_bits(allocate(layout, geometry, 7), seed=5)
    buffer = chunk_buffer(src, fmt, 3 * geometry.block_size) if fmt else host_buffer(src, 3)
    Transfer(src, ids, buffer, method=method).run()
    whole = allocate(layout, geometry, 7)
    Transfer(buffer, range(3), whole, ids, method).run()
    stepwise = allocate(layout, geometry, 7)
    load = LayerwiseLoad(buffer, stepwise, ids, method=method).start()
    for layer in range(geometry.num_layers):
        load.wait(layer)
    load.finish()
    assert_bitwise_equal(stepwise, whole)
    for layer in range(geometry.num_layers):
        one = allocate(layout, geometry, 7)
        Transfer(buffer, range(3), one, ids, method, layers=[layer]).run()
        assert_same_blocks(one, ids, src, ids, layers=[layer])
        assert_other_blocks(one, ids, layers=[layer])


@pytest.mark.parametrize("method, staging", [("segments", None), ("gather", False), ("gather", True), ("compiled", True)])
def test_transfer_runs_again(method, staging, poisoned_empty):
    """A Transfer can be run again (the benchmark times it so): every run copies the
    source as it is at that moment."""
    src = allocate("LBHNC", KV, 7)
    buffer = host_buffer(src, 4)
    if method_status(method, src, buffer):
        pytest.skip(method_status(method, src, buffer))
    transfer = Transfer(src, [5, 1], buffer, [3, 0], method, staging=staging)
    for run in range(100):  # a stale cached view would show on some run (staged storages come and go)
        random_bits(src, seed=100 + run)
        transfer.run()
        assert_same_blocks(src, [5, 1], buffer, [3, 0])


def _staged_and_direct(method, direction, dst_seed=None):
    """The destination after a staged and after a direct transfer of blocks [5, 1] <-> [2, 0],
    and what it held before; with ``dst_seed`` it starts as random bits, else zeros."""
    cache = random_bits(allocate("LBHNC", KV, 7), seed=6)
    buffer = random_bits(host_buffer(cache, 4), seed=7)
    src, src_blocks, dst, dst_blocks = ((cache, [5, 1], buffer, [2, 0]) if direction == "offload"
                                        else (buffer, [2, 0], cache, [5, 1]))
    if method_status(method, src, dst):
        pytest.skip(method_status(method, src, dst))
    out = []
    for staging in (True, False):
        target = dataclasses.replace(dst, storage=[torch.zeros_like(t) for t in dst.storage])
        if dst_seed is not None:
            random_bits(target, dst_seed)
        before = kv_bytes(target)
        transfer = Transfer(src, src_blocks, target, dst_blocks, method, staging=staging)
        assert transfer.staged is staging
        transfer.run()
        out.append(target)
    return out[0], out[1], before, dst_blocks


@pytest.mark.parametrize("direction", ["offload", "load"])
@pytest.mark.parametrize("method", ["gather", "compiled"])
def test_staging_moves_the_same_blocks(method, direction, poisoned_empty):
    """The staged path (what crosses devices) writes the same bytes into the chosen blocks."""
    staged, direct, _, blocks = _staged_and_direct(method, direction)
    assert_same_blocks(staged, blocks, direct, blocks)


@pytest.mark.parametrize("direction", ["offload", "load"])
@pytest.mark.parametrize("method", ["gather", "compiled"])
def test_staging_leaves_other_blocks_alone(method, direction, poisoned_empty):
    """A staged transfer, like a direct one, leaves the destination's other blocks as they were."""
    staged, direct, before, blocks = _staged_and_direct(method, direction, dst_seed=8)
    assert_other_blocks(direct, blocks, before)
    assert_other_blocks(staged, blocks, before)


@pytest.mark.parametrize("direction", ["offload", "load"])
@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC", "ascend_kv_tuple", "flash_attn_v0.12"])
def test_staged_layer_moves_that_layer_only(layout, direction, poisoned_empty):
    """A one-layer staged copy (a layerwise load or save across devices) writes that
    layer's blocks, leaves every other byte alone, and stages 1/L of the buffer, not all of it."""
    g = KV.with_(num_layers=3)
    cache = random_bits(allocate(layout, g, 7), seed=9)
    buffer = random_bits(host_buffer(cache, 4), seed=10)
    src, src_blocks, dst, dst_blocks = ((cache, [5, 1], buffer, [2, 0]) if direction == "offload"
                                        else (buffer, [2, 0], cache, [5, 1]))
    before = kv_bytes(dst)
    Transfer(src, src_blocks, dst, dst_blocks, "gather", layers=[1], staging=True).run()
    assert_same_blocks(dst, dst_blocks, src, src_blocks, layers=[1])
    assert_other_blocks(dst, dst_blocks, before, layers=[1])
    staged_bytes = sum(t.view(a.sizes)[i].nbytes for t, a, parts in
                       zip(buffer.storage, allocations(buffer.layout, g, 4), layer_slices(buffer, [1])) for i in parts)
    assert staged_bytes * g.num_layers == buffer.nbytes


def _kv_cache(layout="LBHNC", geometry=KV, num_blocks=4):
    return allocate(layout, geometry, num_blocks)


BAD = {
    "geometry": (lambda: Transfer(_kv_cache(), [0], _kv_cache(geometry=KV.with_(num_layers=3))),
                 "source and destination hold different KV"),
    "quantized layouts": (lambda: Transfer(_kv_cache(geometry=INT8), [0], _kv_cache("BLHNC", INT8)),
                          "source layout LBHNC and destination layout BLHNC differ: a quantized cache's rows"),
    "too small": (lambda: Transfer(_kv_cache(num_blocks=8), [0, 1, 2], _kv_cache(num_blocks=2)),
                  r"destination too small: it holds 2 blocks .* the transfer moves 3"),
    "dtype": (lambda: Transfer(dataclasses.replace(_kv_cache(), storage=[t.float() for t in _kv_cache().storage]),
                               [0], _kv_cache()),
              r"source tensors are \['torch.float32'\], but its geometry says torch.bfloat16"),
    "out of range": (lambda: Transfer(_kv_cache(), [1, 4], _kv_cache()),
                     r"block ids \[4\] out of range: the cache has blocks 0..3"),
    "duplicate": (lambda: Transfer(_kv_cache(), [1, 2], _kv_cache(), [3, 3]), r"block ids \[3\] appear more than once"),
    "count": (lambda: Transfer(_kv_cache(), [1, 2], _kv_cache(), [0, 1, 3]), "2 source blocks but 3 destination blocks"),
    "layers": (lambda: Transfer(_kv_cache(), [1], _kv_cache(), layers=[0, 2, -1]), r"layers \[2, -1\] out of range 0..1"),
    "unknown method": (lambda: Transfer(_kv_cache(), [1], _kv_cache(), method="teleport"),
                       r"unknown method 'teleport'; choose one of"),
    "lmcache pair": (lambda: Transfer(_kv_cache(), [1], _kv_cache(), method="lmcache"),
                     "method 'lmcache' cannot run here: LMCache's multi_layer_kv_transfer moves"),
    "meta": (lambda: Transfer(allocate("LBHNC", KV, 4, "meta"), [1], _kv_cache()),
             "a transfer runs between one device and host memory"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_transfer_is_refused(case):
    """Each mistake is a ValueError that names it."""
    make, message = BAD[case]
    with pytest.raises(ValueError, match=message):
        make()


def test_names_do_not_matter():
    """Two geometries that differ only in name hold the same KV: the transfer goes ahead."""
    src = random_bits(_kv_cache())
    round_trip(src, [3], allocate("LBHNC", KV.with_(name="renamed"), 1), None, "segments")


def test_triton_without_interpreter_on_cpu(monkeypatch):
    """On the CPU the Triton method needs TRITON_INTERPRET=1; without it, it says so."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs triton on the device")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="method 'triton' cannot run here: triton kernels need a CUDA device"):
        Transfer(_kv_cache(), [1], _kv_cache(), method="triton")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the resident memory from /proc")
def test_a_mapped_host_buffer_gives_its_memory_back_when_it_goes():
    """A store's chunks come and go in any order: each in a mapping of its own, zeroed, so
    the memory of an evicted one leaves the process instead of a hole in the heap."""
    cache = _kv_cache()
    buffers = [host_buffer(cache, 2048, mapped=True) for _ in range(4)]
    for buffer in buffers:
        assert all(t.count_nonzero() == 0 for t in buffer.storage)
        for t in buffer.storage:
            t.fill_(1)  # resident now
    from kvlab.runtime.processes import resident_mib

    held = resident_mib()
    del buffers, buffer, t
    assert held - resident_mib() >= 0.9 * 4 * 2048 * cache.geometry.block_bytes / 2**20
    with pytest.raises(ValueError, match="mapped is for unpinned host"):
        allocate("LBHNC", cache.geometry, 2, "meta", mapped=True)


def test_pin_memory_needs_an_accelerator():
    """Page-locked memory needs a CUDA or NPU runtime; asking for it without one says so."""
    if torch.cuda.is_available():
        pytest.skip("this machine can pin memory")
    with pytest.raises(ValueError, match="pin_memory needs a host"):
        host_buffer(_kv_cache(), 2, pin_memory=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_async_copy_needs_pinned_buffer():
    """A non-blocking device <-> host copy from pageable memory would silently be synchronous
    (or unsafe): it is refused."""
    cache = allocate("LBHNC", KV, 4, "cuda")
    with pytest.raises(ValueError, match="needs a pinned host buffer"):
        Transfer(cache, [0, 1], host_buffer(cache, 2, pin_memory=False), blocking=False)
    Transfer(cache, [0, 1], host_buffer(cache, 2), blocking=False).run().wait()


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("threads", [1, 2, 3, 7])
def test_batch_copy_splits_bytes_over_threads(threads, streaming):
    """kvlab's C batch copy: runs of uneven lengths (a thread's share starts and ends inside
    runs) land exactly, on any number of threads, and nothing outside them is written; with
    plain or streaming stores (those of a batch beyond the last-level cache), at any
    alignment and length, down to runs shorter than a line."""
    from kvlab.transfer.methods.memcpy import copy_addresses

    generator = torch.Generator().manual_seed(threads)
    lengths = torch.cat([torch.randint(1, 130, (8,), generator=generator),
                         torch.randint(1, 300_000, (15,), generator=generator)])
    src = torch.randint(0, 256, (int(lengths.sum()),), dtype=torch.uint8, generator=generator)
    dst = torch.zeros(int(lengths.sum()) + 23 * 8, dtype=torch.uint8)
    src_at = torch.cumsum(lengths, 0) - lengths
    dst_at = src_at + 8 * torch.arange(23)  # an 8-byte gap after every run
    order = torch.randperm(23, generator=generator)  # runs in any order
    copy_addresses(src.data_ptr() + src_at[order], dst.data_ptr() + dst_at[order], lengths[order].contiguous(), threads,
                   streaming=streaming)
    for i in range(23):
        a, n, d = int(src_at[i]), int(lengths[i]), int(dst_at[i])
        assert torch.equal(dst[d:d + n], src[a:a + n]) and not dst[d + n:d + n + 8].any()


def test_batch_copy_without_a_compiler_says_why(monkeypatch, tmp_path):
    from kvlab.transfer import native
    from kvlab.transfer.methods import memcpy

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    memcpy.native_library.cache_clear()
    native.library.cache_clear()
    try:
        with pytest.raises(ValueError, match="method 'memcpy' cannot run here: building kvlab's batch copy"):
            Transfer(_kv_cache(), [1], _kv_cache(), method="memcpy")
    finally:
        memcpy.native_library.cache_clear()
        native.library.cache_clear()


def test_transfer_prints_a_line_not_tensors():
    cache = random_bits(_kv_cache(num_blocks=8))
    text = repr(Transfer(cache, [5, 1], host_buffer(cache, 2)))
    assert "tensor(" not in text and len(text) < 300
    assert text.startswith("Transfer(gather: 2 blocks") and "KVCache(LBHNC, kv, 8 blocks" in text


def test_prepared_tables_are_made_once_per_pair_of_storages():
    """What a method builds from the storages is made on the first run and reused after;
    other storages (a staged side) or another method get their own, and only the newest is kept."""
    cache = _kv_cache(num_blocks=8)
    transfer = Transfer(cache, [5, 1], host_buffer(cache, 2))
    made = []

    def make():
        made.append(len(made))
        return made[-1]

    assert transfer.prepared("m", make) == transfer.prepared("m", make) == 0
    assert transfer.prepared("m", make, cache, host_buffer(cache, 2)) == 1
    assert transfer.prepared("m", make) == 2 and transfer.prepared("other", make) == 3


@pytest.mark.parametrize("method", ["gather", "memcpy"])
def test_a_rerun_reuses_its_tables(method):
    """Running a transfer again copies the same bits through the tables its first run made."""
    src = random_bits(_kv_cache(num_blocks=8))
    transfer = Transfer(src, [5, 1], host_buffer(src, 2), method=method).run()
    (table,) = [value for value, _ in transfer._prepared.values()]
    transfer.dst.storage[0].zero_()
    transfer.run()
    (again,) = [value for value, _ in transfer._prepared.values()]
    assert again is table
    assert_same_blocks(transfer.dst, [0, 1], src, [5, 1])


def test_a_program_that_ends_mid_layerwise_load_exits_cleanly():
    """The README's layerwise line waits for layer 0 only, then the program ends: the load
    finishes first (a daemon thread killed inside a copy at exit aborts the interpreter)."""
    script = """
from kvlab.cache import allocate, preset, scattered_block_ids
from kvlab.transfer import LayerwiseLoad, host_buffer
llama = preset("llama-3.1-8b")
ids = scattered_block_ids(64, 256, seed=0)
cache = allocate("BLHNC", llama, num_blocks=256)
buffer = host_buffer(cache, 64)
LayerwiseLoad(buffer, cache, ids).start().wait(0)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC", "CPU_LBHNC"])
def test_run_all_issues_memcpy_transfers_in_one_batch_bit_for_bit(layout: str, monkeypatch) -> None:
    """Several chunks' loads in one native call (the connector's load of a prompt) land as
    each transfer alone would put them, and the batch call is made once."""
    from kvlab.transfer import run_all
    from kvlab.transfer.methods import memcpy

    if method_status("memcpy", allocate(layout, KV, 1), allocate(layout, KV, 1)) is not None:
        pytest.skip("no C compiler for kvlab's batch copy")
    cache = allocate(layout, KV, 16)
    chunks = [allocate(layout, KV, n) for n in (3, 2, 4)]
    for chunk in chunks:
        for part in chunk.storage:
            part.view(torch.int16).random_()
    targets = [[5, 1, 9], [0, 14], [2, 3, 4, 12]]
    expected = allocate(layout, KV, 16)
    for chunk, blocks in zip(chunks, targets):
        Transfer(chunk, list(range(chunk.num_blocks)), expected, blocks, "gather").run()
    calls = []
    real = memcpy.copy_addresses
    monkeypatch.setattr(memcpy, "copy_addresses", lambda *a, **k: calls.append(1) or real(*a, **k))
    run_all([Transfer(chunk, list(range(chunk.num_blocks)), cache, blocks, "memcpy")
             for chunk, blocks in zip(chunks, targets)], workers=2)
    assert calls == [1]
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(cache.storage, expected.storage))


def test_a_copy_thread_runs_in_the_callers_context():
    """What a caller's context variables hold (a trace, a recorder) is what its copy threads
    see, and a thread's own changes stay its own."""
    import contextvars
    import threading

    from kvlab.transfer.common import in_callers_mode

    marker = contextvars.ContextVar("marker", default="none")
    seen = []
    marker.set("the caller's")

    def job():
        seen.append(marker.get())
        marker.set("the thread's")

    run = in_callers_mode(job)
    marker.set("changed after")
    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == ["the caller's", "the caller's"] and marker.get() == "changed after"


def test_a_batch_of_copies_is_planned_as_each_alone():
    """batch_run_addresses (a connector's load of several chunks, planned together) gives
    every copy's runs in order, exactly as planning each alone: chunks of one shape and of
    another layout, other positions, one block, one layer, in any mix."""
    from kvlab.transfer.plan import batch_run_addresses

    cache, other = _kv_cache("LBHNC", num_blocks=12), _kv_cache("BLHNC", num_blocks=12)
    copies = [(_kv_cache("LBHNC", num_blocks=3), [0, 1, 2], cache, [7, 2, 9], None, None),
              (_kv_cache("BLHNC", num_blocks=2), [1, 0], other, [4, 11], None, None),
              (_kv_cache("LBHNC", num_blocks=3), [0, 1, 2], cache, [0, 5, 3], None, None),
              (_kv_cache("LBHNC", num_blocks=3), [2], cache, [6], None, None),
              (_kv_cache("LBHNC", num_blocks=3), [0, 1, 2], cache, [4, 8, 1], [1], None),
              (_kv_cache("BLHNC", num_blocks=2), [1, 0], other, [8, 1], None, None)]
    alone = [torch.cat(column) for column in zip(*(_addresses_alone(*copy) for copy in copies))]
    together = batch_run_addresses(copies)
    assert len(together) == 3 and all(torch.equal(a, b) for a, b in zip(alone, together))
    assert all(column.numel() == 0 for column in batch_run_addresses([]))
    with pytest.raises(ValueError, match="each source block to one destination block"):
        batch_run_addresses([(_kv_cache("LBHNC", num_blocks=3), [0, 1, 2], cache, [7, 2], None, None)])


def _addresses_alone(src, src_blocks, dst, dst_blocks, layers, heads):
    """One copy's runs from block_runs and the tensors' addresses, with no batching."""
    from kvlab.transfer.plan import block_runs

    src_t, src_o, dst_t, dst_o, length = block_runs(src, src_blocks, dst, dst_blocks, layers, heads)
    src_base = torch.tensor([x.data_ptr() for x in src.storage], dtype=torch.int64)
    dst_base = torch.tensor([x.data_ptr() for x in dst.storage], dtype=torch.int64)
    return src_base[src_t] + src_o, dst_base[dst_t] + dst_o, length
