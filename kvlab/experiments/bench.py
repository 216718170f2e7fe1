"""The benchmark harness: time transfers against the machine's own copy ceiling.

Every configuration is timed interleaved with a *ceiling*: one contiguous copy of the
same number of bytes in the same direction, on the same device, in the same run. The
ratio of the two medians is robust to a noisy machine in a way absolute GB/s is not.
Results are appended as JSONL (one ``run`` record with the hardware fingerprint, then
its ``row`` records) and every figure is drawn from those files.

Needs torch only (tqdm when present for progress bars: kvlab.runtime.progress).
"""

from __future__ import annotations

import ctypes
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from kvlab.cache.allocation import allocate
from kvlab.cache.devices import check_fits, resolve_device, synchronize
from kvlab.cache.geometry import ModelGeometry, dtype_name, resolve_model
from kvlab.cache.layouts import check_compatible, get_layout
from kvlab.cache.segments import contiguous_block_ids, scattered_block_ids
from kvlab.results import append_results, start_run
from kvlab.runtime.progress import progress
from kvlab.transfer.common import copy_stream
from kvlab.transfer.engine import Transfer, chunk_buffer, host_buffer
from kvlab.transfer.layerwise import LayerwiseLoad
from kvlab.transfer.methods.memcpy import copy_addresses, native_library
from kvlab.transfer.registry import ALL_METHODS, PEERS, method_status

DIRECTIONS = ("offload", "load")
MAX_SEGMENTS = 65536  # the segments method beyond this takes seconds per call: recorded, not timed


class _Clock:
    """Seconds one call takes: events on the copy stream of an accelerator (what a copy
    costs on the device), the wall clock on the CPU. ``whole_device`` times everything
    queued on the device (several streams) between two synchronisations instead."""

    def __init__(self, device: torch.device, whole_device: bool = False) -> None:
        self.device = device
        self.whole_device = whole_device

    def __call__(self, fn: Callable[[], Any]) -> float:
        if self.device.type == "cpu" or self.whole_device:
            synchronize(self.device)
            start = time.perf_counter()
            fn()
            synchronize(self.device)
            return time.perf_counter() - start
        module = getattr(torch, self.device.type)
        stream = copy_stream(self.device)
        synchronize(self.device)
        begin, end = module.Event(enable_timing=True), module.Event(enable_timing=True)
        begin.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        return begin.elapsed_time(end) / 1e3


def ceiling_copy(nbytes: int, direction: str, device: torch.device, native: bool = False) -> Callable[[], None]:
    """One contiguous copy of ``nbytes`` in ``direction`` (device -> host for offload),
    into pinned host memory on an accelerator. On the CPU, ``native`` makes it kvlab's C
    batch copy on torch's thread count instead of torch's ``copy_``: a STREAM-style copy,
    the machine's physical bound, where torch's own copy may fall short of it."""
    words = max(1, nbytes // 8)
    pinned = device.type != "cpu"
    on_device = torch.empty(words, dtype=torch.int64, device=device).fill_(7)
    on_host = torch.empty(words, dtype=torch.int64, pin_memory=pinned).fill_(3)
    src, dst = (on_device, on_host) if direction == "offload" else (on_host, on_device)
    if device.type == "cpu":
        if native:
            run = [torch.tensor([x.data_ptr()]) for x in (src, dst)] + [torch.tensor([words * 8])]
            return lambda held=(src, dst): copy_addresses(*run)  # the buffers live as long as the copy
        return lambda: dst.copy_(src)
    module = getattr(torch, device.type)
    stream = copy_stream(device)

    def copy() -> None:
        with module.stream(stream):
            dst.copy_(src, non_blocking=True)

    return copy


def interleaved(fns: Sequence[Callable[[], Any]], clock: _Clock, repeats: int, warmup: int = 2) -> list[list[float]]:
    """Seconds of each of ``fns`` (a transfer and its ceilings), taken in turn within each
    repeat so all see the same machine state."""
    for _ in range(warmup):
        for fn in fns:
            clock(fn)
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            out.append(clock(fn))
    return times


@dataclass(frozen=True)
class Config:
    """One measured configuration. ``target`` is ``"host"`` (a host buffer in the cache's
    layout) or an LMCache chunk format."""

    geometry: ModelGeometry
    layout: str
    method: str
    direction: str
    tokens: int
    block_ids: str = "scattered"
    target: str = "host"

    def __post_init__(self) -> None:
        if get_layout(self.layout).is_chunk_format:
            raise ValueError(f"{self.layout} is an LMCache chunk format, not a paged cache: use it as a target")
        if self.target != "host" and not get_layout(self.target).is_chunk_format:
            raise ValueError(f"target must be 'host' or an LMCache chunk format, not {self.target!r}")
        if self.direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, not {self.direction!r}")
        if self.block_ids not in ("scattered", "contiguous"):
            raise ValueError(f"block_ids must be 'scattered' or 'contiguous', not {self.block_ids!r}")
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens <= 0:
            raise ValueError(f"tokens must be a positive integer, got {self.tokens!r}")

    @property
    def blocks(self) -> int:
        """Blocks moved."""
        return -(-self.tokens // self.geometry.block_size)

    @property
    def cache_blocks(self) -> int:
        """Blocks of the cache they are scattered over: room for no two adjacent."""
        return 2 * self.blocks + 8

    @property
    def memory_bytes(self) -> int:
        """What measuring it holds at once: the cache, the buffer and the ceiling's two copies."""
        return (self.cache_blocks + 3 * self.blocks) * self.geometry.block_bytes

    def describe(self) -> dict[str, Any]:
        layout = get_layout(self.layout)
        return {
            "model": self.geometry.name,
            "dtype": dtype_name(self.geometry.dtype),
            "block_size": self.geometry.block_size,
            "num_layers": self.geometry.num_layers,
            "layout": layout.name,
            "cross_layer": layout.is_cross_layer,
            "method": self.method,
            "direction": self.direction,
            "tokens": self.tokens,
            "block_ids": self.block_ids,
            "target": self.target,
        }


class _Setup:
    """Caches and buffers for a geometry/layout/tokens, shared by every method and direction."""

    def __init__(self, config: Config, device: torch.device, seed: int) -> None:
        g, blocks = config.geometry, config.blocks
        ids = scattered_block_ids(blocks, config.cache_blocks, seed) if config.block_ids == "scattered" else \
            contiguous_block_ids(blocks, 4)
        self.cache = allocate(config.layout, g, config.cache_blocks, device, fill="empty")
        for i, t in enumerate(self.cache.storage):  # touch every page: untouched memory copies unfairly fast
            t.view(torch.uint8).fill_(17 + i % 100)
        if config.target == "host":
            self.buffer = host_buffer(self.cache, blocks)
        else:
            self.buffer = chunk_buffer(self.cache, config.target, blocks * g.block_size)
        self.ids = ids


def measure(config: Config, device: torch.device, repeats: int, setup: _Setup, seed: int = 0) -> dict[str, Any]:
    """Time one configuration against its ceiling; a method that cannot run here is a row
    that says why."""
    row: dict[str, Any] = {"record": "row", **config.describe()}
    src, dst = (setup.cache, setup.buffer) if config.direction == "offload" else (setup.buffer, setup.cache)
    problem = method_status(config.method, src, dst)
    if problem:
        return {**row, "status": f"unavailable: {problem}"}
    src_ids, dst_ids = (setup.ids, None) if config.direction == "offload" else (list(range(len(setup.ids))), setup.ids)
    started = time.perf_counter()
    transfer = Transfer(src, src_ids, dst, dst_ids, config.method, blocking=device.type == "cpu")
    plan = transfer.plan
    plan_s = time.perf_counter() - started
    if config.method == "segments" and plan.segments > MAX_SEGMENTS:
        return {**row, "status": f"skipped: {plan.segments} segments, too many to copy one by one",
                "segments": plan.segments, "bytes": plan.nbytes}
    clock = _Clock(device)
    ceilings_to_time = [ceiling_copy(plan.nbytes, config.direction, device)]
    native = device.type == "cpu" and isinstance(native_library(), ctypes.CDLL)
    if native:
        ceilings_to_time.append(ceiling_copy(plan.nbytes, config.direction, device, native=True))
    try:
        first = clock(transfer.run)  # includes any one-off compilation
        times, ceilings, *native_times = interleaved([transfer.run, *ceilings_to_time], clock, repeats)
    except Exception as error:
        if config.method not in PEERS:
            raise
        return {**row, "status": f"unavailable: {type(error).__name__}: {error}"}
    median, ceiling_median = statistics.median(times), statistics.median(ceilings)
    bound = None
    if native_times:  # the STREAM-style bound beside torch's copy
        bound = statistics.median(c / t for c, t in zip(native_times[0], times))
        row.update(native_ceiling_gbps=plan.nbytes / statistics.median(native_times[0]) / 1e9, native_ratio=bound)
    return {
        **row,
        "status": "ok",
        "bytes": plan.nbytes,
        "segments": plan.segments,
        "mean_segment_bytes": plan.nbytes / max(plan.segments, 1),
        "seconds": median,
        "seconds_min": min(times),
        "seconds_max": max(times),
        "first_call_s": first,
        "plan_s": plan_s,
        "gbps": plan.nbytes / median / 1e9,
        "ceiling_seconds": ceiling_median,
        "ceiling_gbps": plan.nbytes / ceiling_median / 1e9,
        **ratio_spread(times, ceilings, bound),
        "repeats": repeats,
    }


# A transfer cannot beat one contiguous copy of its bytes on the same engine by more than
# timing noise: a ratio above this says the measurement, not the method, is off.
NOISE_RATIO = 1.1


def ratio_spread(times: Sequence[float], ceilings: Sequence[float], bound: float | None = None) -> dict[str, Any]:
    """Each repeat's ratio against the ceiling timed next to it (pairing cancels the slow
    drift of a shared machine), as median, quartiles, and a ``noisy`` flag: quartiles more
    than a fifth of the median apart, or a ratio above NOISE_RATIO against the physical
    ``bound`` where one was measured (else against this ceiling): beating torch's copy is
    possible where torch's copy falls short of the memory, beating the memory is not."""
    ratios = sorted(c / t for c, t in zip(ceilings, times))
    median = statistics.median(ratios)
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (median, median, median)
    above = (median if bound is None else bound) > NOISE_RATIO
    return {"ratio": median, "ratio_q1": q1, "ratio_q3": q3, "noisy": bool(above or q3 - q1 > 0.2 * median)}


PROFILES: dict[str, dict[str, Any]] = {
    # finishes in about a minute on a 2-core machine; 9 interleaved repeats keep the
    # quartiles readable
    "quick": {"models": ["llama-3.1-8b"], "tokens": [256, 1024], "layouts": ["LBHNC", "BLHNC"],
              "methods": ["segments", "gather", "compiled"], "repeats": 9, "chunks": False},
    # notebook 02 in make run's standard profile: every layout and method, a dense model and
    # MLA, 256 and 1024 tokens, scattered blocks; about a minute on 2 cores
    "standard": {"models": ["llama-3.1-8b", "deepseek-v2-lite"], "tokens": [256],
                 "layouts": ["LBHNC", "LHBNC", "BLHNC", "ascend_kv_tuple"], "methods": ALL_METHODS, "repeats": 5,
                 "chunks": True, "extra_tokens": [1024], "block_ids": ["scattered"]},
    # the main job on a CPU machine (notebook 02, the paper profile): several minutes on 2 cores
    "full": {"models": ["llama-3.1-8b", "qwen3-8b", "qwen3-30b-a3b", "deepseek-r1-distill-qwen-1.5b",
                        "smollm2-135m", "deepseek-v2-lite"],
             "tokens": [256], "layouts": ["LBHNC", "LHBNC", "BLHNC", "ascend_kv_tuple"],
             "methods": ALL_METHODS, "repeats": 9, "chunks": True, "extra_tokens": [64, 1024]},
    # one GPU, torch only (scripts/device-check): per-layer against cross-layer, every
    # method, 256 to 16k tokens, in a few minutes on one H200
    "gpu": {"models": ["llama-3.1-8b", "deepseek-v2-lite"], "tokens": [256, 1024, 4096],
            "layouts": ["LBHNC", "LHBNC", "ascend_kv_tuple", "BLHNC"], "methods": ALL_METHODS, "repeats": 10,
            "chunks": False, "extra_tokens": [16384]},
    # the CPU copy engines against the ceiling (the targets below): one size, scattered
    # blocks, many repeats; run three times in a row (``kvlab bench --profile ceiling --runs 3``)
    "ceiling": {"models": ["llama-3.1-8b"], "tokens": [1024], "layouts": ["LBHNC", "LHBNC", "ascend_kv_tuple", "BLHNC"],
                "methods": ["segments", "memcpy", "gather", "compiled"], "repeats": 15, "chunks": False,
                "block_ids": ["scattered"]},
    # scripts/device-check's dry run on a CPU (DEVICE=cpu): every code path, seconds
    "dry": {"models": ["smollm2-135m", "deepseek-v2-lite"], "tokens": [32],
            "layouts": ["LBHNC", "LHBNC", "ascend_kv_tuple", "BLHNC"], "methods": ALL_METHODS, "repeats": 3,
            "chunks": False},
}


def configs(profile: dict[str, Any], dtype: str | None = None, block_size: int = 16) -> list[Config]:
    """The configurations a profile sweeps: every model x layout x tokens x method x
    direction, plus (``chunks``) LMCache chunk targets and (``extra_tokens``) more sizes
    for the first model, so the cost model sees a wide range of segment counts."""
    out = []
    for model_index, model in enumerate(profile["models"]):
        geometry = resolve_model(model, dtype=dtype, block_size=block_size)
        layouts = [(get_layout(l).mla_twin if geometry.is_mla else None) or l for l in profile["layouts"]]
        for layout in layouts:  # a layout that cannot hold this model's KV is an error, not a gap in the results
            check_compatible(layout, geometry)
        tokens = list(profile["tokens"]) + (profile.get("extra_tokens", []) if model_index == 0 else [])
        for count in sorted(set(tokens)):
            for layout in layouts:
                kinds = ("scattered", "contiguous") if model_index == 0 else ("scattered",)
                for block_ids in profile.get("block_ids", kinds):
                    for method in profile["methods"]:
                        for direction in DIRECTIONS:
                            out.append(Config(geometry, layout, method, direction, count, block_ids))
            if profile.get("chunks") and count <= 1024:
                paged, chunk = ("mla_v0.12", "KV_MLA_FMT") if geometry.is_mla else ("flash_attn_v0.12", "KV_2LTD")
                for source in (paged, "BLHNC"):
                    for method in profile["methods"]:
                        for direction in DIRECTIONS:
                            out.append(Config(geometry, source, method, direction, count, "scattered", chunk))
    return out


def run_sweep(configurations: Sequence[Config], device: str | torch.device = "auto", repeats: int = 7,
              seed: int = 0, out: str | Path | None = None) -> list[dict[str, Any]]:
    """Measure every configuration (progress bar), append the results to ``out`` (JSONL)."""
    device = resolve_device(device)
    _check_repeats(repeats)
    largest = max(configurations, key=lambda c: c.memory_bytes, default=None)
    if largest is not None:
        check_fits(largest.memory_bytes, device, f"measuring {largest.tokens:,} tokens of {largest.geometry.name}")
    run = start_run(device, out)
    rows = []
    setups: dict[tuple, _Setup] = {}
    for config in progress(list(configurations), "transfer sweep", leave=False):
        key = (config.geometry, config.layout, config.tokens, config.block_ids, config.target)
        if key not in setups:
            setups.clear()  # one set of caches at a time: memory stays bounded
            setups[key] = _Setup(config, device, seed)
        rows.append({"run_id": run["run_id"], **measure(config, device, repeats, setups[key], seed)})
        append_results(out, rows[-1:])  # row by row: a run cut short keeps what it measured
    setups.clear()
    return rows


# What the CPU copy engines should reach, as a share of the same-run ceiling, judged by the
# worse of offload and load (Llama-3.1-8B bf16, 1024 tokens, scattered blocks: the ceiling profile).
CPU_TARGETS = {"cross-layer": 0.95, "per-layer": 0.9, "LHBNC": 0.7}


def ceiling_targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per run and per target: the best method's worse direction, against torch's copy
    (``ratio``) and against the STREAM-style native copy (``native_ratio``), and whether
    the target is met."""
    ok = [r for r in rows if r.get("status") == "ok" and r.get("target") == "host"]
    out = []
    for run_id in dict.fromkeys(r["run_id"] for r in ok):
        worse: dict[tuple[str, str], dict[str, Any]] = {}
        for r in (r for r in ok if r["run_id"] == run_id):
            key = (r["layout"], r["method"])
            if key not in worse or r["ratio"] < worse[key]["ratio"]:
                worse[key] = r
        groups = {"cross-layer": [r for r in worse.values() if r["cross_layer"]],
                  "per-layer": [r for r in worse.values() if not r["cross_layer"]],
                  "LHBNC": [r for r in worse.values() if r["layout"] == "LHBNC"]}
        for name, group in groups.items():
            if group:
                best = max(group, key=lambda r: r["ratio"])
                out.append({"hardware": best.get("hardware", ""), "run_id": run_id, "target": name, "goal": CPU_TARGETS[name], "layout": best["layout"],
                            "method": best["method"], "direction": best["direction"], "ratio": best["ratio"],
                            "native_ratio": best.get("native_ratio"), "ceiling_gbps": best["ceiling_gbps"],
                            "native_ceiling_gbps": best.get("native_ceiling_gbps"),
                            "met": best["ratio"] >= CPU_TARGETS[name]})
    return out


def format_targets(targets: Sequence[dict[str, Any]]) -> str:
    lines = [f"{'run':12s} {'target':12s} {'goal':>5s} {'best (worse direction)':34s} {'ratio':>6s} "
             f"{'vs memcpy':>9s} {'ceiling':>8s} {'memcpy':>7s}  met"]
    for t in targets:
        native = f"{t['native_ratio']:9.2f}" if t["native_ratio"] is not None else f"{'-':>9s}"
        memcpy = f"{t['native_ceiling_gbps']:7.2f}" if t["native_ceiling_gbps"] is not None else f"{'-':>7s}"
        lines.append(f"{t['run_id']:12s} {t['target']:12s} {t['goal']:5.2f} "
                     f"{t['layout'] + ' ' + t['method'] + ' (' + t['direction'] + ')':34s} {t['ratio']:6.2f} {native} "
                     f"{t['ceiling_gbps']:8.2f} {memcpy}  {'yes' if t['met'] else 'NO'}")
    return "\n".join(lines)


def _check_positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_repeats(repeats: int) -> None:
    _check_positive_int("repeats", repeats)


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
    _check_repeats(repeats)
    _check_positive_int("tokens", tokens)
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
    clock = _Clock(device, whole_device=True)  # compute and copies run on different streams
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
        times = max(0, round(intensity * per_layer_load / one_matmul))

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
            **timing, "repeats": repeats, "status": "ok",
        })
    return rows


def overlap_timing(load: Callable[[], Any], compute: Callable[[], Any], layerwise: Callable[[], Any], num_layers: int,
                   clock: _Clock, repeats: int, warmup: int = 1) -> dict[str, float]:
    """Load-then-compute (``load``, then ``compute`` over every layer) against ``layerwise``
    (the same load overlapped layer by layer with the same compute), and each part alone,
    all four timed in turn within each repeat so they see the same machine: the medians in
    seconds, the speedup, and the ideal speedup of perfect overlap (the longer of load and
    compute, plus one layer of the shorter)."""
    def sequential() -> None:
        load()
        compute()

    seq, pipe, compute_s, load_s = map(statistics.median, interleaved([sequential, layerwise, compute, load], clock,
                                                                      repeats, warmup))
    overlapped = max(load_s, compute_s) + min(load_s, compute_s) / num_layers
    return {"load_s": load_s, "compute_s": compute_s, "sequential_s": seq, "layerwise_s": pipe, "speedup": seq / pipe,
            "ideal_speedup": (load_s + compute_s) / overlapped}


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


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    """A readable table of sweep rows."""
    lines = [f"{'model':34s} {'layout':18s} {'blocks':10s} {'target':10s} {'method':9s} {'dir':7s} {'tokens':>6s} "
             f"{'segments':>8s} {'GB/s':>7s} {'ceiling':>7s} {'ratio':>6s} {'quartiles':>11s}"]
    for r in rows:
        head = (f"{r['model'][-34:]:34s} {r['layout']:18s} {r['block_ids']:10s} {r['target']:10s} {r['method']:9s} "
                f"{r['direction']:7s} {r['tokens']:6d}")
        if r["status"] != "ok":
            lines.append(f"{head} {r['status'][:70]}")
        else:
            spread = f"{r['ratio_q1']:.2f}-{r['ratio_q3']:.2f}" if "ratio_q1" in r else ""
            native = f"  memcpy-bound {r['native_ratio']:.2f}" if "native_ratio" in r else ""
            noise = "  noise" if r.get("noisy") else ""
            lines.append(f"{head} {r['segments']:8d} {r['gbps']:7.2f} {r['ceiling_gbps']:7.2f} {r['ratio']:6.2f} "
                         f"{spread:>11s}{native}{noise}")
    return "\n".join(lines)


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
                            geometry.num_layers, _Clock(device, whole_device=True), repeats)
    return {
        "record": "row", "kind": "attention", "model": geometry.name, "num_layers": geometry.num_layers,
        "dtype": dtype_name(geometry.dtype), "layout": layout, "method": method, "prefix_tokens": prefix_tokens,
        "new_tokens": new_tokens, **timing, "intensity": timing["compute_s"] / timing["load_s"],
        "repeats": repeats, "status": "ok",
    }


def _check_attention(geometry: ModelGeometry, prefix_tokens: int, new_tokens: int, device: torch.device,
                     repeats: int) -> None:
    """Refuse what attention_pipeline could only fail at after measuring began."""
    _check_positive_int("prefix_tokens", prefix_tokens)
    _check_positive_int("new_tokens", new_tokens)
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
