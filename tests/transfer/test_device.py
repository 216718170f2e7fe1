"""kvlab's accelerator paths on a real device (marked ``cuda``): every paged layout x every
copy method x offload and load through pinned host memory, layerwise loads with per-layer
events, the staged path, LMCache chunks, and the tiny attention stack driven through the
hooks, all checked bitwise against address labels on the host.

The device is ``KVLAB_DEVICE`` (default ``cuda``; skipped where there is none).
scripts/device-check runs this file on the GPU, and its CPU dry run (``DEVICE=cpu``) runs
it here, so the tests themselves cannot rot on machines without a GPU.
"""

import os

import pytest
import torch
from logical_kv import assert_other_blocks, assert_same_blocks, kv_bytes, random_bits
from test_transfer import KV, MLA, PAGED

from kvlab import hooks
from kvlab.cache import ModelGeometry, allocate, device_here, layer_name, scattered_block_ids
from kvlab.transfer import METHODS, LayerwiseLoad, Transfer, chunk_buffer, host_buffer, method_status

DEVICE = os.environ.get("KVLAB_DEVICE", "cuda")


pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not device_here(DEVICE), reason=f"no {DEVICE} device here")]


def moved(cache, device):
    """A cache allocated on ``device`` (its storage and its layer views there) holding
    ``cache``'s bytes."""
    out = allocate(cache.layout, cache.geometry, cache.num_blocks, device)
    for a, b in zip(out.storage, cache.storage):
        a.copy_(b)
    views = [t for v in out.layers.values() for t in (v if isinstance(v, tuple) else (v,))]
    assert all(t.device == out.storage[0].device for t in views), "layer views must live with the storage"
    return out


def on_device(cache):
    """The cache's bytes on DEVICE (random bits made on the host: the same on every device)."""
    return moved(cache, DEVICE)


def on_host(cache):
    """A host copy of a cache, for the bitwise checks."""
    return moved(cache, "cpu")


def skip_unless_runs(method, src, dst):
    problem = method_status(method, src, dst)
    if problem:
        pytest.skip(f"{method}: {problem}")


def _pinned_host(cache, blocks):
    buffer = host_buffer(cache, blocks)
    assert buffer.storage[0].is_pinned() == (DEVICE != "cpu")
    return buffer


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("mla, layout", PAGED, ids=[f"{n}-{'mla' if m else 'kv'}" for m, n in PAGED])
def test_round_trip_through_pinned_host(mla, layout, method):
    """Scattered blocks offloaded to pinned host memory and loaded into a fresh device cache,
    asynchronously (events), land bitwise where the address labels say."""
    geometry = MLA if mla else KV
    source = random_bits(allocate(layout, geometry, 9), seed=3)
    cache = on_device(source)
    buffer = _pinned_host(cache, 4)
    skip_unless_runs(method, cache, buffer)
    ids = scattered_block_ids(4, 9, seed=1)
    Transfer(cache, ids, buffer, method=method, blocking=False).run().wait()
    assert_same_blocks(buffer, range(4), source, ids)
    fresh = on_device(allocate(layout, geometry, 9))
    Transfer(buffer, list(range(4)), fresh, ids, method=method, blocking=False).run().wait()
    back = on_host(fresh)
    assert_same_blocks(back, ids, source, ids)
    assert_other_blocks(back, ids)


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC", "ascend_kv_tuple"])
def test_layerwise_load_waits_per_layer(layout, method):
    """A layerwise load: after wait(i) on the compute stream, layer i is in place; the
    whole load equals the source in every layer."""
    geometry = KV.with_(num_layers=3)
    source = random_bits(allocate(layout, geometry, 8), seed=4)
    buffer = _pinned_host(on_device(source), 3)
    ids = [6, 1, 3]
    Transfer(on_device(source), ids, buffer).run()
    cache = on_device(allocate(layout, geometry, 8))
    skip_unless_runs(method, buffer, cache)
    load = LayerwiseLoad(buffer, cache, ids, method=method).start()
    for layer in range(geometry.num_layers):
        load.wait(layer)
        assert_same_blocks(on_host(cache), ids, source, ids, layers=[layer])
    load.finish()
    assert_other_blocks(on_host(cache), ids)


@pytest.mark.parametrize("method", ["gather", "compiled"])
@pytest.mark.parametrize("direction", ["offload", "load"])
def test_staged_one_layer_copies(direction, method):
    """The staged path (gather and compiled across devices) for one layer of a cross-layer
    cache: that layer's blocks move, nothing else changes on either side."""
    geometry = KV.with_(num_layers=3)
    source = random_bits(allocate("BLHNC", geometry, 7), seed=5)
    cache = on_device(source)
    buffer = random_bits(_pinned_host(cache, 4), seed=6)
    if direction == "offload":
        before = on_host(buffer)
        transfer = Transfer(cache, [5, 1], buffer, [2, 0], method, layers=[1])
        skip_unless_runs(method, cache, buffer)
        assert transfer.staged == (DEVICE != "cpu")
        transfer.run()
        assert_same_blocks(buffer, [2, 0], source, [5, 1], layers=[1])
        assert_other_blocks(buffer, [2, 0], kv_bytes(before), layers=[1])
    else:
        before = kv_bytes(source)
        Transfer(buffer, [2, 0], cache, [5, 1], method, layers=[1]).run()
        after = on_host(cache)
        assert_same_blocks(after, [5, 1], buffer, [2, 0], layers=[1])
        assert_other_blocks(after, [5, 1], before, layers=[1])


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("layout, fmt", [("flash_attn_v0.12", "KV_2LTD"), ("BLHNC", "KV_2LTD"),
                                          ("mla_v0.12", "KV_MLA_FMT")])
def test_chunks_in_pinned_host_memory(layout, fmt, method):
    """A device cache to an LMCache chunk in pinned host memory and back."""
    geometry = MLA if fmt == "KV_MLA_FMT" else KV
    source = random_bits(allocate(layout, geometry, 9), seed=7)
    cache = on_device(source)
    chunk = chunk_buffer(cache, fmt, 3 * geometry.block_size)
    skip_unless_runs(method, cache, chunk)
    ids = [7, 2, 4]
    Transfer(cache, ids, chunk, method=method).run()
    fresh = on_device(allocate(layout, geometry, 9))
    Transfer(chunk, [0, 1, 2], fresh, ids, method=method).run()
    assert_same_blocks(on_host(fresh), ids, source, ids)
    assert_other_blocks(on_host(fresh), ids)


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC", "ascend_kv_tuple", "ascend_mla_tuple"])
def test_hooks_reload_on_the_device(layout):
    """The tiny attention stack on the device, driven through kvlab.hooks by a layerwise
    offloader: the continuation after an offload, a wipe and a layerwise reload is bitwise
    the one computed with the cache kept, and each layer waits for its load before its
    attention."""
    geometry = (ModelGeometry.mla("tiny-mla", 3, 16, 8, dtype="bfloat16", block_size=4) if "mla" in layout
                else ModelGeometry("tiny", 3, 2, 8, dtype="bfloat16", block_size=4))
    stack = hooks.TinyAttentionStack(geometry)
    generator = torch.Generator().manual_seed(1)
    prompt, continuation = (torch.randn(n, stack.hidden, generator=generator) for n in (10, 3))
    blocks = [5, 2, 7, 0]
    reference = on_device(allocate(layout, geometry, 8))
    stack(prompt, reference, blocks)
    expected = stack(continuation, reference, blocks, start=10)

    cache = on_device(allocate(layout, geometry, 8))
    offloader = hooks.LayerwiseOffloader(cache, num_buffer_blocks=3)
    with offloader.step(hooks.OffloadPlan(save_blocks=blocks[:3])):
        stack(prompt, cache, blocks, connector=offloader)
    for tensor in cache.storage:
        tensor.zero_()
    with hooks.LayerTrace(sync=DEVICE) as trace, offloader.step(hooks.OffloadPlan(load_blocks=blocks[:3])):
        out = stack(continuation, cache, blocks, start=10, connector=offloader)
    assert torch.equal(out.cpu(), expected.cpu())
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(cache.storage, reference.storage))
    rows = [(r["layer"], r["event"]) for r in trace.rows() if r["event"] not in ("save", "load")]
    assert rows == [(layer_name(i), e) for i in range(geometry.num_layers) for e in ("load_wait", "attention")]
    # each layer's copy, recorded from the copy thread as it finished (its place among the others varies)
    assert sorted(r["layer"] for r in trace.rows() if r["event"] == "load") == sorted(
        layer_name(i) for i in range(geometry.num_layers))
