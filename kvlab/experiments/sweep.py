"""The transfer sweep: time transfers against the machine's own copy ceiling.

Every configuration is timed interleaved with a *ceiling*: one contiguous copy of the
same number of bytes in the same direction, on the same device, in the same run. The
ratio of the two medians is robust to a noisy machine in a way absolute GB/s is not.
Results are appended as JSONL (one ``run`` record with the hardware fingerprint, then
its ``row`` records) and every figure is drawn from those files. The sweep refuses bad
input (a profile, a configuration, a repeat count) with a ValueError before it measures.

Needs torch only (tqdm when present for progress bars: kvlab.runtime.progress).
"""

from __future__ import annotations

import ctypes
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from kvlab.cache.allocation import allocate
from kvlab.cache.devices import check_fits, resolve_device
from kvlab.cache.geometry import ModelGeometry, dtype_name, resolve_model
from kvlab.cache.fits import check_compatible
from kvlab.cache.layouts import LAYOUTS, get_layout
from kvlab.cache.segments import contiguous_block_ids, scattered_block_ids
from kvlab.experiments.timing import Clock, check_positive_int, interleaved
from kvlab.results import append_results, start_run
from kvlab.runtime.progress import progress
from kvlab.transfer.common import copy_stream
from kvlab.transfer.engine import Transfer, chunk_buffer, host_buffer
from kvlab.transfer.methods.memcpy import copy_addresses, native_library
from kvlab.transfer.plan import HeadSlice
from kvlab.transfer.registry import ALL_METHODS, get_method, method_status

DIRECTIONS = ("offload", "load")
MAX_SEGMENTS = 65536  # the segments method beyond this takes seconds per call: recorded, not timed


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


@dataclass(frozen=True)
class Config:
    """One measured configuration. ``target`` is ``"host"`` (a host buffer in the cache's
    layout), an LMCache chunk format, or another paged layout (a host buffer in that layout:
    a chunk an engine of that layout stored, converted as it moves). With ``ranks`` > 1 the
    buffer is one of so many tensor-parallel shards of the cache's heads: loaded, a chunk a
    rank of that size stored, gathered into this cache's first heads; offloaded, the heads a
    rank of that size slices out of a chunk of every head (kvlab.connector.shards)."""

    geometry: ModelGeometry
    layout: str
    method: str
    direction: str
    tokens: int
    block_ids: str = "scattered"
    target: str = "host"
    ranks: int = 1

    def __post_init__(self) -> None:
        if get_layout(self.layout).is_chunk_format:
            raise ValueError(f"{self.layout} is an LMCache chunk format, not a paged cache: use it as a target")
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, int) or self.ranks < 1 \
                or self.geometry.num_kv_heads % self.ranks or (self.ranks > 1 and self.geometry.is_mla):
            raise ValueError(f"ranks must split {self.geometry.name}'s {self.geometry.num_kv_heads} kv heads evenly "
                             f"(and an MLA latent not at all), got {self.ranks!r}")
        if self.target == self.layout or (self.target != "host" and self.target not in LAYOUTS):
            raise ValueError(f"target must be 'host', an LMCache chunk format or another layout than the cache's "
                             f"{self.layout}, not {self.target!r}")
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
            "ranks": self.ranks,
        }

    @property
    def heads(self) -> HeadSlice | None:
        """The heads moved between the cache and a shard buffer (the cache's first ones)."""
        return HeadSlice(0, 0, self.geometry.num_kv_heads // self.ranks) if self.ranks > 1 else None


class Setup:
    """Caches and buffers for a geometry/layout/tokens, shared by every method and direction."""

    def __init__(self, config: Config, device: torch.device, seed: int) -> None:
        g, blocks = config.geometry, config.blocks
        ids = scattered_block_ids(blocks, config.cache_blocks, seed) if config.block_ids == "scattered" else \
            contiguous_block_ids(blocks, 4)
        self.cache = allocate(config.layout, g, config.cache_blocks, device, fill="empty")
        for i, t in enumerate(self.cache.storage):  # touch every page: untouched memory copies unfairly fast
            t.view(torch.uint8).fill_(17 + i % 100)
        shard = g.with_(num_kv_heads=g.num_kv_heads // config.ranks)
        if config.target == "host" and config.ranks == 1:
            self.buffer = host_buffer(self.cache, blocks)
        elif not get_layout(config.target if config.target != "host" else config.layout).is_chunk_format:
            self.buffer = allocate(config.target if config.target != "host" else config.layout, shard, blocks, "cpu",
                                   pin_memory=device.type != "cpu")
        else:
            self.buffer = chunk_buffer(self.cache, config.target, blocks * g.block_size)
        self.ids = ids


def measure(config: Config, device: torch.device, repeats: int, setup: Setup) -> dict[str, Any]:
    """Time one configuration against its ceiling; a method that cannot run here (checked
    before anything is timed) is a row that says why, and one that raises while timed fails
    the sweep: a failure is never a row."""
    row: dict[str, Any] = {"record": "row", **config.describe()}
    src, dst = (setup.cache, setup.buffer) if config.direction == "offload" else (setup.buffer, setup.cache)
    problem = method_status(config.method, src, dst)
    if problem:
        return {**row, "status": f"unavailable: {problem}"}
    src_ids, dst_ids = (setup.ids, None) if config.direction == "offload" else (list(range(len(setup.ids))), setup.ids)
    started = time.perf_counter()
    transfer = Transfer(src, src_ids, dst, dst_ids, config.method, blocking=device.type == "cpu", heads=config.heads)
    plan = transfer.plan
    plan_s = time.perf_counter() - started
    if config.method == "segments" and plan.segments > MAX_SEGMENTS:
        return {**row, "status": f"skipped: {plan.segments} segments, too many to copy one by one",
                "segments": plan.segments, "bytes": plan.nbytes}
    clock = Clock(device)
    ceilings_to_time = [ceiling_copy(plan.nbytes, config.direction, device)]
    native = device.type == "cpu" and isinstance(native_library(), ctypes.CDLL)
    if native:
        ceilings_to_time.append(ceiling_copy(plan.nbytes, config.direction, device, native=True))
    first = clock(transfer.run)  # includes any one-off compilation; a method that raises fails the sweep
    times, ceilings, *native_times = interleaved([transfer.run, *ceilings_to_time], clock, repeats)
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
    # method, 256 to 16k tokens, LMCache's chunk targets: every configuration notebook 02
    # measures (standard and ceiling profiles), in a few minutes on one H200
    "gpu": {"models": ["llama-3.1-8b", "deepseek-v2-lite"], "tokens": [256, 1024, 4096],
            "layouts": ["LBHNC", "LHBNC", "ascend_kv_tuple", "BLHNC"], "methods": ALL_METHODS, "repeats": 10,
            "chunks": True, "extra_tokens": [16384]},
    # the CPU copy engines against the ceiling (the targets below): one size, scattered
    # blocks, many repeats; run three times in a row (``kvlab bench --profile ceiling --runs 3``)
    "ceiling": {"models": ["llama-3.1-8b"], "tokens": [1024], "layouts": ["LBHNC", "LHBNC", "ascend_kv_tuple", "BLHNC"],
                "methods": ["segments", "memcpy", "gather", "compiled"], "repeats": 15, "chunks": False,
                "block_ids": ["scattered"]},
    # engines of other layouts sharing one store (kvlab.store.keys.signature): a cache's blocks
    # copied to and from a host buffer of another layout (cache layout, stored layout), beside
    # each layout's own copy; 4,096 tokens, so that even SmolLM2's 94 MB outgrow the last-level
    # cache and the same-run ceiling (at 1,024 tokens it came out from 0.3 to 1.7 of itself); a few minutes on 2 cores
    "conversions": {"models": ["smollm2-135m", "llama-3.1-8b"], "tokens": [4096],
                    "layouts": ["CPU_LBHNC", "CPU_BLHNC", "LBHNC", "BLHNC", "LBNHC"],
                    "methods": ["memcpy", "gather"], "repeats": 15, "chunks": False, "block_ids": ["scattered"],
                    "conversions": [("CPU_BLHNC", "CPU_LBHNC"), ("CPU_LBHNC", "CPU_BLHNC"), ("BLHNC", "LBHNC"),
                                    ("LBHNC", "BLHNC"), ("LBHNC", "LBNHC"), ("LBNHC", "LBHNC")],
                    # engines of two tensor-parallel sizes: (cache layout, stored layout, ranks) of a model whose
                    # heads split so: half of Llama's 8 heads into or out of a TP=2 shard
                    "shards": [("CPU_LBHNC", "host", 2), ("CPU_BLHNC", "CPU_LBHNC", 2)]},
    # scripts/device-check's dry run on a CPU (DEVICE=cpu): every code path, seconds
    "dry": {"models": ["smollm2-135m", "deepseek-v2-lite"], "tokens": [32],
            "layouts": ["LBHNC", "LHBNC", "ascend_kv_tuple", "BLHNC"], "methods": ALL_METHODS, "repeats": 3,
            "chunks": False},
}


_PROFILE_KEYS = ("models", "tokens", "layouts", "methods")


def check_methods(methods: Sequence[str]) -> None:
    """Refuse a method that is not registered (kvlab.transfer.registry)."""
    unknown = [m for m in methods if m not in ALL_METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {list(ALL_METHODS)}")


def check_profile(profile: dict[str, Any]) -> None:
    """Refuse a profile configs() could not sweep: a missing key, a token count below one,
    an unknown layout or method (models are resolved, and checked, by configs itself)."""
    missing = [key for key in _PROFILE_KEYS if key not in profile]
    if missing:
        raise ValueError(f"a profile needs {list(_PROFILE_KEYS)}; this one lacks {missing}")
    if any(isinstance(t, bool) or not isinstance(t, int) or t <= 0 for t in profile["tokens"]):
        raise ValueError(f"tokens must be positive, got {profile['tokens']}")
    shards = [name for layout, stored, _ in profile.get("shards", []) for name in (layout, stored) if name != "host"]
    for layout in [*profile["layouts"], *(name for pair in profile.get("conversions", []) for name in pair), *shards]:
        get_layout(layout)
    check_methods(profile["methods"])


def configs(profile: dict[str, Any], dtype: str | None = None, block_size: int = 16) -> list[Config]:
    """The configurations a profile sweeps: every model x layout x tokens x method x
    direction, plus (``chunks``) LMCache chunk targets, (``conversions``) (cache layout,
    stored layout) pairs and (``extra_tokens``) more sizes for the first model, so the cost
    model sees a wide range of segment counts."""
    check_profile(profile)
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
            for layout, stored in profile.get("conversions", []):
                for method in profile["methods"]:
                    for direction in DIRECTIONS:
                        out.append(Config(geometry, layout, method, direction, count, "scattered", stored))
            for layout, stored, ranks in profile.get("shards", []):  # where the model's heads split so
                if geometry.is_mla or geometry.num_kv_heads % ranks:
                    continue
                for method in (m for m in profile["methods"] if get_method(m).plan_runs):
                    for direction in DIRECTIONS:
                        out.append(Config(geometry, layout, method, direction, count, "scattered", stored, ranks))
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
    check_positive_int("repeats", repeats)
    configurations = list(configurations)
    wrong = [c for c in configurations if not isinstance(c, Config)]
    if wrong:
        raise ValueError(f"run_sweep measures Config objects (see configs()), got {wrong[0]!r}")
    check_methods(dict.fromkeys(c.method for c in configurations))
    largest = max(configurations, key=lambda c: c.memory_bytes, default=None)
    if largest is not None:
        check_fits(largest.memory_bytes, device, f"measuring {largest.tokens:,} tokens of {largest.geometry.name}")
    run = start_run(device, out)
    rows = []
    setups: dict[tuple, Setup] = {}
    for config in progress(configurations, "transfer sweep", leave=False):
        key = (config.geometry, config.layout, config.tokens, config.block_ids, config.target, config.ranks)
        if key not in setups:
            setups.clear()  # one set of caches at a time: memory stays bounded
            setups[key] = Setup(config, device, seed)
        rows.append({"run_id": run["run_id"], **measure(config, device, repeats, setups[key])})
        append_results(out, rows[-1:])  # row by row: a run cut short keeps what it measured
    setups.clear()
    return rows


def _target(row: dict[str, Any]) -> str:
    """The buffer a row moved to or from: "host", a layout or chunk format, "/p" for one of p
    tensor-parallel shards of the cache's heads."""
    return row["target"] + (f"/{row['ranks']}" if row.get("ranks", 1) > 1 else "")


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    """A readable table of sweep rows."""
    lines = [f"{'model':34s} {'layout':18s} {'blocks':10s} {'target':10s} {'method':9s} {'dir':7s} {'tokens':>6s} "
             f"{'segments':>8s} {'GB/s':>7s} {'ceiling':>7s} {'ratio':>6s} {'quartiles':>11s}"]
    for r in rows:
        head = (f"{r['model'][-34:]:34s} {r['layout']:18s} {r['block_ids']:10s} {_target(r):10s} {r['method']:9s} "
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
