"""KVLabConnector's worker side on a device with torch alone (kvlab.harness.worker_steps): saves
out of device memory into checked host chunks and loads back bit for bit into other blocks,
per-layer, cross-layer, Ascend tuples and MLA, whole-step and layerwise; and a sleep/wake
cycle with a save still in flight. scripts/device-check runs the device tests on the GPU
(marked ``cuda``; the device is ``KVLAB_DEVICE``); every machine runs the worker side with
vLLM refused, in a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from kvlab.cache import ModelGeometry, allocate, device_here, resolve_device

DEVICE = os.environ.get("KVLAB_DEVICE", "cuda")
GQA = ModelGeometry("tiny-gqa", 3, 2, 64, torch.bfloat16, 16)
MLA = ModelGeometry.mla("tiny-mla", 3, 64, 32, dtype=torch.bfloat16, block_size=16)
TOKENS = list(range(5 * 16 + 7))  # 5 full blocks: chunks of 2, 2 and 1


on_device = [pytest.mark.cuda, pytest.mark.skipif(not device_here(DEVICE), reason=f"no {DEVICE} device here")]


def device_cache(layout: str, geometry: ModelGeometry, num_blocks: int = 16):
    """A cache on DEVICE holding random bits made on the host (the same on every device)."""
    host = allocate(layout, geometry, num_blocks)
    generator = torch.Generator().manual_seed(0)
    for tensor in host.storage:
        flat = tensor.view(torch.int16)
        flat.copy_(torch.randint(-2**15, 2**15, flat.shape, generator=generator, dtype=torch.int16))
    cache = allocate(layout, geometry, num_blocks, DEVICE)
    for a, b in zip(cache.storage, host.storage):
        a.copy_(b)
    return cache


def blocks(cache, block_ids: list[int]) -> list[torch.Tensor]:
    """Each layer's (and part's) bytes of these blocks, on the host."""
    axis = cache.layout.view_order.index("B")
    index = torch.tensor(block_ids, device=cache.storage[0].device)
    return [part.index_select(axis, index).contiguous().view(torch.int16).cpu()
            for view in cache.layers.values() for part in (view if isinstance(view, tuple) else (view,))]


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole-step", "layerwise"])
@pytest.mark.parametrize(("layout", "geometry"), [("LBHNC", GQA), ("BLHNC", GQA), ("ascend_kv_tuple", GQA),
                                                  ("mla_v0.29", MLA)])
@pytest.mark.usefixtures("fresh_stores")
@on_device[0]
@on_device[1]
def test_saved_blocks_load_back_bitwise_on_the_device(layout, geometry, layerwise) -> None:
    from kvlab.harness.worker_steps import WorkerSteps

    steps = WorkerSteps(device_cache(layout, geometry), {"chunk_size": 32, "layerwise": layerwise})
    assert steps.cache.storage[0].device.type == resolve_device(DEVICE).type
    keys = steps.save("a", TOKENS, [3, 9, 1, 12, 6])
    steps.worker.flush()
    assert steps.stats.saved_blocks == 5 and len(steps.worker.store) == 3 and steps.stats.save_errors == 0
    expected = blocks(steps.cache, [3, 9, 1, 12, 6])
    assert steps.load("b", keys, [0, 15, 4, 8, 2]) == set()
    assert steps.stats.loaded_blocks == 5
    assert all(torch.equal(a, b) for a, b in zip(expected, blocks(steps.cache, [0, 15, 4, 8, 2])))


@pytest.mark.usefixtures("fresh_stores")
@on_device[0]
@on_device[1]
def test_sleep_waits_for_a_save_in_flight_and_wake_up_loads_it_bitwise(held_saves) -> None:
    from kvlab.harness.worker_steps import WorkerSteps

    steps = WorkerSteps(device_cache("BLHNC", GQA), {"chunk_size": 32})
    release = held_saves(steps.worker)
    keys = steps.save("a", TOKENS, [3, 9, 1, 12, 6])
    expected = blocks(steps.cache, [3, 9, 1, 12, 6])
    assert steps.stats.saved_blocks == 0, "saves still in flight"
    threading.Timer(0.2, release.set).start()  # the saves go on while sleep waits for them
    steps.worker.suspend()  # what unregister_kv_caches does before Worker.sleep
    assert steps.stats.saved_blocks == 5, "sleep waited for the saves to read the device memory"
    for tensor in steps.cache.storage:
        tensor.zero_()  # the KV memory's contents are gone while asleep
    with pytest.raises(RuntimeError, match="while the KV cache sleeps"):
        steps.load("b", keys, [0, 15, 4, 8, 2])
    steps.worker.resume()
    assert steps.load("c", keys, [0, 15, 4, 8, 2]) == set()
    assert all(torch.equal(a, b) for a, b in zip(expected, blocks(steps.cache, [0, 15, 4, 8, 2])))


def test_the_worker_side_runs_without_vllm() -> None:
    """What the device machine has: torch, and no vLLM (refused here in a process of its own)."""
    code = textwrap.dedent("""
        import sys

        class NoVLLM:
            def find_spec(self, name, path=None, target=None):
                if name == "vllm" or name.startswith("vllm."):
                    raise ImportError("vLLM is not installed here")

        sys.meta_path.insert(0, NoVLLM())
        import torch
        from kvlab.cache import ModelGeometry, allocate
        from kvlab.harness.worker_steps import WorkerSteps

        cache = allocate("BLHNC", ModelGeometry("tiny", 2, 2, 16, torch.float32, 16), 8)
        for tensor in cache.storage:
            tensor.view(torch.int32).random_()
        steps = WorkerSteps(cache, {"chunk_size": 32})
        keys = steps.save("a", list(range(64)), [0, 1, 2, 3])
        steps.worker.flush()
        assert steps.load("b", keys, [4, 5, 6, 7]) == set()
        assert torch.equal(cache.storage[0][0:4].view(torch.int32), cache.storage[0][4:8].view(torch.int32))
        assert "vllm" not in sys.modules
        for call in (lambda: steps.save("c", list(range(64)), [0, 1]), lambda: steps.load("d", keys, [4, 5])):
            try:
                call()
            except ValueError as error:
                assert "block ids" in str(error), error
            else:
                raise AssertionError("too few block ids went unnoticed")
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
