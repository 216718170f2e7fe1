"""The explorer's numbers: the real transfer of each layout, and its estimated offload time
from the fitted cost model (kvlab.experiments.costmodel) of this machine where it was
measured, else of the machines that were, named as not this one (kvlab.plotting.explorer
draws the maps and the widget)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Sequence

import pandas as pd

from kvlab.cache.geometry import ModelGeometry, preset
from kvlab.cache.quant import QUANTS
from kvlab.cache.segments import transfer_cost
from kvlab.experiments.costmodel import CostFit, fit
from kvlab.plotting.common import human_bytes, short_hardware
from kvlab.results import committed_results_dir, fingerprint, load_results

KV_FORMATS = ("unquantized", *QUANTS)  # a preset as published, or its KV in a quantized format
# The estimate: an offload by the fastest batched copy method measured on a machine (memcpy
# moves every segment in one call, gather in one per tensor: docs/results.md's transfer tables show
# them hide nearly all the cost of a copy), fitted on its transfer timings.
DIRECTION, BATCHED = "offload", ("memcpy", "gather")
TRANSFER_RESULTS = ("02_transfer-*.jsonl", "02_ceiling-*.jsonl")


def _time(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9)):
        if seconds >= scale or unit == "ns":
            return f"{seconds / scale:.3g} {unit}"
    raise AssertionError


def kv_geometry(model: str, kv_format: str, block_size: int = 16) -> ModelGeometry:
    """A preset, its KV unquantized or in ``kv_format``."""
    if kv_format not in KV_FORMATS:
        raise ValueError(f"the KV format is one of {KV_FORMATS}, not {kv_format!r}")
    real = preset(model, block_size=block_size)
    return real if kv_format == "unquantized" else real.quantized(kv_format)


@functools.lru_cache(maxsize=None)
def measured_fits(results_dir: Path | None = None) -> tuple[CostFit, ...]:
    """Each measured machine's cost model of an offload by its fastest batched copy method
    (BATCHED, in order), from its transfer timings in ``results_dir`` (default data/results:
    the committed ones and what `make run` added), fitted once per process."""
    folder = Path(results_dir or committed_results_dir())
    files = sorted(path for pattern in TRANSFER_RESULTS for path in folder.glob(pattern))
    batched = [f for f in fit(load_results(files)) if f.direction == DIRECTION and f.method in BATCHED]
    fastest: dict[str, CostFit] = {}
    for f in sorted(batched, key=lambda f: BATCHED.index(f.method)):
        fastest.setdefault(f.hardware, f)
    return tuple(fastest[machine] for machine in sorted(fastest))


@functools.lru_cache(maxsize=None)
def this_machine() -> str:
    """This machine as result rows name it (kvlab.results.fingerprint)."""
    return fingerprint()["hardware"]


def estimate_sources(fits: Sequence[CostFit], here: str) -> list[tuple[CostFit, str]]:
    """The fits an estimate uses, each with whose machine it is: this machine's own where it
    was measured, else every measured machine's, said plainly not to be this one."""
    own = [f for f in fits if f.hardware == here]
    if own:
        return [(f, f"this machine ({short_hardware(here)})") for f in own]
    return [(f, f"{short_hardware(f.hardware)}, not this machine") for f in fits]


def numbers(model: str, layouts: Sequence[str], block_size: int, tokens: int, fits: Sequence[CostFit] | None = None,
            here: str | None = None, kv_format: str = "unquantized") -> tuple[list[str], pd.DataFrame]:
    """The explorer's numbers: notes (how many times fewer copies one layout needs, what the
    estimate rests on) and a table of the real transfer per layout with its
    estimated time, machine and copy method (``fits``: default measured_fits(); ``here``:
    default this machine)."""
    if len(layouts) != 2:
        raise ValueError(f"the explorer compares two layouts, got {list(layouts)}")
    real = kv_geometry(model, kv_format, block_size)
    costs = [(name, transfer_cost(name, real, tokens)) for name in layouts]
    sources = estimate_sources(measured_fits() if fits is None else fits, this_machine() if here is None else here)
    notes = [fewer_copies(costs)] + estimate_notes(real.num_layers, sources)
    return notes, pd.DataFrame([row for name, cost in costs for row in table_rows(name, cost, sources)])


def fewer_copies(costs: Sequence[tuple[str, dict]]) -> str:
    """'BLHNC needs 32x fewer copies than LBHNC for the same 32 MiB'."""
    (few, low), (many, high) = sorted(costs, key=lambda item: item[1]["segments"])
    same = f"the same {human_bytes(low['bytes_moved'])}"
    if low["segments"] == high["segments"]:
        return f"{few} and {many} need as many copies ({low['segments']:,}) for {same}"
    return f"{few} needs {high['segments'] / low['segments']:.3g}x fewer copies than {many} for {same}"


def estimate_notes(layers: int, sources: Sequence[tuple[CostFit, str]]) -> list[str]:
    """Whose machine and which copy method each estimate comes from, its fitted costs and
    the segment size from which a per-layer layout costs within 10 % of a cross-layer one."""
    if not sources:
        return [f"estimated {DIRECTION} time: no measured results"]
    return [f"estimate measured on {machine}: {f.method} (batched), {_time(f.per_segment_s)} a copy + "
            f"{f.bandwidth / 1e9:.3g} GB/s, break-even {human_bytes(round(f.break_even_segment_bytes(layers)))}"
            for f, machine in sources]


def table_rows(name: str, cost: dict, sources: Sequence[tuple[CostFit, str]]) -> list[dict]:
    """One layout's real transfer, a row per machine estimated on."""
    row = {"layout": name, "segments": cost["segments"], "mean segment": human_bytes(cost["mean_segment_bytes"]),
           "bytes": human_bytes(cost["bytes_moved"])}
    if "scale_bytes" in cost:  # a quantized cache: its scales and padding move inside the same segments
        row["of which scales + padding"] = human_bytes(cost["scale_bytes"] + cost["padding_bytes"])
    if not sources:
        return [{**row, f"estimated {DIRECTION} time": "no measured results", "measured on": "", "copy method": ""}]
    return [{**row, f"estimated {DIRECTION} time": _time(f.predict(cost["segments"], cost["bytes_moved"])),
             "measured on": machine, "copy method": f.method} for f, machine in sources]
