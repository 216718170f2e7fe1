"""Layerwise loading timed: loading layer by layer overlapped with compute, against
loading everything then computing; the compute a tuned matmul stand-in
(pipeline_timing) or kvlab's tiny attention stack through the hooks
(attention_pipeline). Each refuses bad input with a ValueError before it measures."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from kvlab.cache.allocation import allocate
from kvlab.cache.devices import check_fits, resolve_device
from kvlab.cache.geometry import ModelGeometry, dtype_name, resolve_model
from kvlab.cache.segments import scattered_block_ids
from kvlab.experiments.timing import Clock, check_positive_int, interleaved
from kvlab.harness.spread import ratio
from kvlab.results import append_results, start_run
from kvlab.runtime.progress import progress
from kvlab.transfer.engine import Transfer, host_buffer
from kvlab.transfer.layerwise import LayerwiseLoad


def _stand_in_compute(tokens: int, hidden: int, device: torch.device):
    """A per-layer stand-in for attention + MLP: a chain of fp32 [tokens, hidden] matmuls."""
    x = torch.randn(tokens, hidden, device=device)
    w = torch.randn(hidden, hidden, device=device) / hidden**0.5

    def step(times: int) -> None:
        y = x
        for _ in range(times):
            y = y @ w

    return step


# the stand-in compute's widths, tried narrowest first
_HIDDEN_SIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)


def _check_pipeline(geometry: ModelGeometry, tokens: int, intensities: Sequence[float], device: torch.device,
                    repeats: int) -> None:
    """Refuse what pipeline_timing could only fail at (or hang in) after measuring began."""
    check_positive_int("repeats", repeats)
    check_positive_int("tokens", tokens)
    if not intensities or not all(math.isfinite(i) and i > 0 for i in intensities):
        raise ValueError(f"intensities must be finite compute/load ratios > 0, got {list(intensities)}")
    blocks = -(-tokens // geometry.block_size)
    widest = _HIDDEN_SIZES[-1]
    # the cache (room for scattered blocks), the buffer, and the widest stand-in's fp32 tensors
    needed = (3 * blocks + 8) * geometry.block_bytes + (3 * tokens * widest + widest**2) * 4
    check_fits(needed, device, f"layerwise loading of {tokens:,} tokens of {geometry.name}")


def pipeline_timing(geometry: ModelGeometry, tokens: int, intensities: Sequence[float], device: str | torch.device = "auto",
                    repeats: int = 5, method: str = "gather", seed: int = 0) -> list[dict[str, Any]]:
    """Load everything then compute, against loading layer by layer overlapped with
    compute. ``intensity`` is one layer's compute time over one layer's load time."""
    device = resolve_device(device)
    _check_pipeline(geometry, tokens, intensities, device, repeats)
    blocks = -(-tokens // geometry.block_size)
    cache = allocate("LBHNC", geometry, 2 * blocks + 8, device, fill="empty")
    ids = scattered_block_ids(blocks, cache.num_blocks, seed)
    buffer = host_buffer(cache, blocks)
    for t in buffer.storage:
        t.view(torch.uint8).fill_(5)
    whole = Transfer(buffer, list(range(blocks)), cache, ids, method)
    layerwise = LayerwiseLoad(buffer, cache, ids, method=method)
    clock = Clock(device, whole_device=True)  # compute and copies run on different streams
    load_s = statistics.median(clock(whole.run) for _ in range(3))
    per_layer_load = load_s / geometry.num_layers
    # the widest matmul that still cuts one layer's load time into at least 8 steps
    chosen = None
    for hidden in _HIDDEN_SIZES:
        candidate = _stand_in_compute(tokens, hidden, device)
        seconds = statistics.median(clock(lambda: candidate(1)) for _ in range(5))
        if chosen is not None and seconds > per_layer_load / 8:
            break
        chosen = (hidden, candidate, seconds)
    hidden, compute, one_matmul = chosen
    rows = []
    for intensity in intensities:
        # at least one matmul: on a slow machine even the narrowest can outlast a small layer's load,
        # and a stand-in of no compute would time nothing (the row says the intensity it reached)
        times = max(1, round(intensity * per_layer_load / one_matmul))

        def compute_all() -> None:
            for _ in range(geometry.num_layers):
                compute(times)

        def pipelined() -> None:
            layerwise.start()
            for layer in range(geometry.num_layers):
                layerwise.wait(layer)
                compute(times)
            layerwise.finish()

        # no warm-up: the load and the matmul already ran while the stand-in was chosen
        timing = overlap_timing(whole.run, compute_all, pipelined, geometry.num_layers, clock, repeats, warmup=0)
        rows.append({
            "record": "row", "kind": "layerwise", "model": geometry.name, "num_layers": geometry.num_layers,
            "tokens": tokens, "method": method, "intensity": intensity, "matmuls_per_layer": times, "hidden": hidden,
            "matmul_s": one_matmul, "layer_load_s": per_layer_load,
            "reached_intensity": times * one_matmul / per_layer_load,
            **timing, "repeats": repeats, "status": "ok",
        })
    return rows


def overlap_timing(load: Callable[[], Any], compute: Callable[[], Any], layerwise: Callable[[], Any], num_layers: int,
                   clock: Callable[[Callable[[], Any]], float], repeats: int, warmup: int = 1) -> dict[str, float]:
    """Load-then-compute (``load``, then ``compute`` over every layer) against ``layerwise``
    (the same load overlapped layer by layer with the same compute), and each part alone,
    all four timed in turn within each repeat so they see the same machine: the medians in
    seconds, the speedup with its bootstrap interval (``speedup_low``, ``speedup_high``: a
    speedup is claimed only where the interval clears 1), and the ideal speedup of perfect
    overlap (the longer of load and compute, plus one layer of the shorter)."""
    def sequential() -> None:
        load()
        compute()

    timed = interleaved([sequential, layerwise, compute, load], clock, repeats, warmup)
    seq, pipe, compute_s, load_s = map(statistics.median, timed)
    overlapped = max(load_s, compute_s) + min(load_s, compute_s) / num_layers
    speedup = ratio(timed[0], timed[1])
    return {"load_s": load_s, "compute_s": compute_s, "sequential_s": seq, "layerwise_s": pipe, "speedup": seq / pipe,
            "speedup_low": speedup.low, "speedup_high": speedup.high, "ideal_speedup": (load_s + compute_s) / overlapped}


def _layerwise_sweep(models: Sequence[str], sizes: Sequence[int], device: torch.device, out: str | Path | None,
                     check: Callable[[ModelGeometry, int], None],
                     measure: Callable[[ModelGeometry, int], list[dict[str, Any]]], description: str) -> list[dict[str, Any]]:
    """``measure(geometry, size)`` for every model and size, its rows tagged with the run
    and appended to ``out`` as measured; ``check`` sees every pair first, so a size that
    cannot be measured (too big for the memory, a bad argument) is refused before any is."""
    geometries = {model: resolve_model(model) for model in models}
    cases = [(geometries[model], size) for model in models for size in sizes]
    for case in cases:
        check(*case)
    run = start_run(device, out)
    rows = []
    for case in progress(cases, description, leave=False):
        measured = [{"run_id": run["run_id"], **row} for row in measure(*case)]
        append_results(out, measured)
        rows += measured
    return rows


def run_pipeline_sweep(models: Sequence[str], tokens: Sequence[int], intensities: Sequence[float],
                       device: str | torch.device = "auto", repeats: int = 5,
                       out: str | Path | None = None) -> list[dict[str, Any]]:
    device = resolve_device(device)
    return _layerwise_sweep(models, tokens, device, out,
                            lambda geometry, count: _check_pipeline(geometry, count, intensities, device, repeats),
                            lambda geometry, count: pipeline_timing(geometry, count, intensities, device, repeats),
                            "layerwise sweep")


def attention_pipeline(geometry: ModelGeometry, prefix_tokens: int, new_tokens: int, device: str | torch.device = "auto",
                       repeats: int = 5, method: str = "gather", layout: str = "LBHNC") -> dict[str, Any]:
    """Layerwise loading against load-then-compute with real attention as the compute: a
    prefix of ``prefix_tokens`` comes back from pinned host memory while kvlab's tiny
    attention stack (kvlab.hooks) runs ``new_tokens`` over it, driven through the hooks as
    a layerwise connector would be. The overlap comes from the model, not from a tuned
    stand-in, so ``intensity`` (compute / load) is measured, not chosen."""
    from kvlab.hooks import LayerwiseOffloader, OffloadPlan, TinyAttentionStack

    device = resolve_device(device)
    _check_attention(geometry, prefix_tokens, new_tokens, device, repeats)
    block_size = geometry.block_size
    prefix_blocks = -(-prefix_tokens // block_size)
    blocks = -(-(prefix_tokens + new_tokens) // block_size)
    cache = allocate(layout, geometry, 2 * blocks + 8, device, fill="empty")
    ids = scattered_block_ids(blocks, cache.num_blocks, seed=0)
    stack = TinyAttentionStack(geometry)
    generator = torch.Generator().manual_seed(0)
    prompt, new = (torch.randn(n, stack.hidden, generator=generator) for n in (prefix_tokens, new_tokens))
    offloader = LayerwiseOffloader(cache, prefix_blocks, method)
    with offloader.step(OffloadPlan(save_blocks=ids[:prefix_blocks])):  # the prefix's KV into the host buffer
        stack(prompt, cache, ids, connector=offloader)
    whole = Transfer(offloader.buffer, list(range(prefix_blocks)), cache, ids[:prefix_blocks], method)
    plan = OffloadPlan(load_blocks=ids[:prefix_blocks])

    def layerwise() -> None:
        with offloader.step(plan):
            stack(new, cache, ids, start=prefix_tokens, connector=offloader)

    timing = overlap_timing(whole.run, lambda: stack(new, cache, ids, start=prefix_tokens), layerwise,
                            geometry.num_layers, Clock(device, whole_device=True), repeats)
    return {
        "record": "row", "kind": "attention", "model": geometry.name, "num_layers": geometry.num_layers,
        "dtype": dtype_name(geometry.dtype), "layout": layout, "method": method, "prefix_tokens": prefix_tokens,
        "new_tokens": new_tokens, **timing, "intensity": timing["compute_s"] / timing["load_s"],
        "repeats": repeats, "status": "ok",
    }


def _check_attention(geometry: ModelGeometry, prefix_tokens: int, new_tokens: int, device: torch.device,
                     repeats: int) -> None:
    """Refuse what attention_pipeline could only fail at after measuring began."""
    check_positive_int("prefix_tokens", prefix_tokens)
    check_positive_int("new_tokens", new_tokens)
    _check_pipeline(geometry, prefix_tokens + new_tokens, [1.0], device, repeats)


def run_attention_sweep(models: Sequence[str], prefix_tokens: Sequence[int], new_tokens: int,
                        device: str | torch.device = "auto", repeats: int = 5,
                        out: str | Path | None = None) -> list[dict[str, Any]]:
    """attention_pipeline for every model and prefix size (one run, rows appended to ``out``)."""
    device = resolve_device(device)
    return _layerwise_sweep(models, prefix_tokens, device, out,
                            lambda geometry, count: _check_attention(geometry, count, new_tokens, device, repeats),
                            lambda geometry, count: [attention_pipeline(geometry, count, new_tokens, device, repeats)],
                            "attention sweep")
