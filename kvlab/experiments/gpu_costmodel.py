"""What a KV copy between host memory and a GPU costs, one rule per copy mechanism, fitted on
named rows of the published table (kvlab.experiments.published) and checked on the rest.

    dma_batch           max(n x submit, B / bw)    cuMemcpyBatchAsync: the driver encodes descriptors
                                                   while the copy engine drains them (pipelined)
    memcpy_per_segment  n x call + B / link        a cudaMemcpyAsync per segment: copies in one stream
                                                   run one after another, each paying its fixed cost
    copy_kernel         B / min(link, kernel)      one launch over a run table: no per-run term
    nixl                (B + n x post) / link      posting per descriptor (``post``: bytes the link
                                                   moves meanwhile), then the movement

n: copies submitted (merged runs where the mechanism coalesces them), B: bytes. ``bw`` is the
link's, except for DMA loads of descriptors under 28 KiB: those run at the copy engine's
small-page rate (the cliff vLLM #42212 measured). Every parameter is fitted on exactly one row
of the table (FIT_PLAN, in order); a held-out row is never fitted. ``RULES`` names the overlap
rule of the two mechanisms that have one; ``rule_ablation`` shows the held-out errors under the
other rule, so the choice is visible rather than tuned.

Why it matters: the question of LMCache #2498 and vllm-ascend #2039 (does a cross-layer cache
make KV transfer cheaper?) is about GPUs; ``layout_question`` answers it for the reference
models' real geometries (kvlab's presets and segment arithmetic), with the held-out error band.
"""

from __future__ import annotations

import math
from statistics import median, quantiles
from typing import Any, Callable, Sequence

from kvlab.cache.geometry import ModelGeometry, preset
from kvlab.cache.segments import transfer_cost
from kvlab.experiments.published import UNITS, Measurement

SMALL_PAGE_BYTES = 28 * 1024  # vLLM #42212: DMA loads below this run at the small-page rate
FIT_TOLERANCE = 0.01  # a fitting row is reproduced within 1 % (tested)

# (parameter, the one row it is fitted on), in the order fitted: later ones use earlier ones.
FIT_PLAN: tuple[tuple[str, str], ...] = (
    ("submit_s", "vllm48434-8k-run1-unmerged-submit"),
    ("link_Bps:pcie5", "vllm48434-8k-run16-merged-b2b"),
    ("small_page_load_Bps", "vllm42212-16k-n100000"),
    ("call_s", "flexkv193-per-call"),
    ("kernel_Bps:pcie5", "blog-kernel-single-direction"),
    ("link_Bps:nvlink_c2c", "sglang40278-ce-h2d"),
    ("kernel_Bps:nvlink_c2c", "sglang40278-tma-h2d"),
    ("link_Bps:PegaFlow #128 host", "pegaflow128-page-first"),
    ("post_bytes:cuda_ipc", "vllm55434-cuda-ipc-posting"),
    ("post_bytes:rc_x", "vllm55434-rc-x-posting"),
)
PARAMETER_NAMES = {
    "submit_s": "CPU submission per DMA descriptor (cuMemcpyBatchAsync)",
    "call_s": "fixed cost per cudaMemcpyAsync call",
    "small_page_load_Bps": "DMA load rate for descriptors under 28 KiB",
    "link_Bps": "host link bandwidth",
    "kernel_Bps": "copy-kernel bandwidth",
    "post_bytes": "NIXL posting per descriptor, in bytes moved meanwhile",
}
RULES = {"dma_batch": "pipelined", "memcpy_per_segment": "additive"}
PREDICTED = ("fit", "held-out", "own")
MIN_BAND_ROWS = 3  # held-out rows a mechanism needs for an error band

# The reference question: three machines by their host link (H200 has H100's PCIe Gen5 x16
# link; GB200 is modelled by the published Grace machines' NVLink-C2C rows), NIXL's transport
# on each, the models of the reference pull requests, and prefix lengths.
MACHINES = {"H100": "pcie5", "H200": "pcie5", "GB200": "nvlink_c2c"}
NIXL_TRANSPORTS = {"pcie5": "rc_x", "nvlink_c2c": "cuda_ipc"}
QUESTION_MODELS = ("llama-3.1-8b", "qwen3-30b-a3b", "deepseek-v2-lite")
QUESTION_TOKENS = (2048, 8192, 32768)
QUESTION_MECHANISMS = ("dma_batch", "memcpy_per_segment", "copy_kernel", "nixl")


def copy_bandwidth(params: dict[str, float], link: str, segment_bytes: float | None, direction: str,
                   mechanism: str) -> float:
    """Bytes per second the copy runs at: the link's, a kernel's cap, or DMA's small-page load rate."""
    bandwidth = params[f"link_Bps:{link}"]
    if mechanism == "copy_kernel":
        return min(bandwidth, params[f"kernel_Bps:{link}"])
    if mechanism == "dma_batch" and direction == "load" and segment_bytes is not None and segment_bytes < SMALL_PAGE_BYTES:
        return min(bandwidth, params["small_page_load_Bps"])
    return bandwidth


def transfer_seconds(params: dict[str, float], mechanism: str, link: str, nbytes: float, copies: float,
                     segment_bytes: float | None, direction: str = "load", transport: str = "",
                     rules: dict[str, str] = RULES) -> float:
    """One transfer's time under the mechanism's rule (see the module's docstring)."""
    if mechanism == "nixl":
        return (nbytes + copies * params[f"post_bytes:{transport}"]) / params[f"link_Bps:{link}"]
    moving = nbytes / copy_bandwidth(params, link, segment_bytes, direction, mechanism)
    fixed = {"dma_batch": "submit_s", "memcpy_per_segment": "call_s"}.get(mechanism)
    if fixed is None:  # a kernel, or one contiguous copy
        return moving
    issuing = copies * params[fixed]
    return max(issuing, moving) if rules.get(mechanism) == "pipelined" else issuing + moving


def predict(row: Measurement, params: dict[str, float], rules: dict[str, str] = RULES) -> float | None:
    """The model's value of a row's metric, in SI units (None: a metric the model does not predict)."""
    metric, mechanism = row.metric, row.mechanism
    copies, nbytes = row.submissions, row.nbytes

    def seconds(of: str = mechanism) -> float:
        return transfer_seconds(params, of, row.model_link, nbytes, copies, row.segment, row.direction, row.transport,
                                rules)

    if metric == "per_call_us":
        return params["submit_s" if mechanism == "dma_batch" else "call_s"]
    if metric in ("submit_us", "submit_ms"):
        return copies * params["submit_s"]
    if metric == "link_gbps":
        return params[f"link_Bps:{row.model_link}"]
    if metric == "posting_share":
        posting = copies * params[f"post_bytes:{row.transport}"]
        return posting / (nbytes + posting)
    if metric == "posting_cost_ratio":  # equal movement rates: the ratio of posting costs in bytes
        return params["post_bytes:cuda_ipc"] / params["post_bytes:rc_x"]
    if metric == "engine_ms":
        return nbytes / copy_bandwidth(params, row.model_link, row.segment, row.direction, mechanism)
    if metric in ("time_ms", "time_s"):
        return seconds()
    if metric in ("gbps", "b2b_gbps"):
        if nbytes is None and mechanism in ("copy_kernel", "copy_engine"):  # a rate that does not depend on size
            return copy_bandwidth(params, row.model_link, None, row.direction, mechanism)
        return nbytes / seconds()
    if metric == "difference_ms":  # the published DMA-minus-kernel gap of the same transfer
        return seconds() - seconds("copy_kernel")
    return None


def _solve(value_at: Callable[[float], float], target: float) -> float:
    """The parameter value at which ``value_at`` hits ``target`` (bisection over log scale:
    every prediction is monotone in each parameter)."""
    low, high = 1e-15, 1e15
    gap_low = math.log(value_at(low) / target)
    if gap_low * math.log(value_at(high) / target) > 0:
        raise ValueError("the row does not pin the parameter down (no value reproduces it)")
    for _ in range(300):
        middle = math.sqrt(low * high)
        gap = math.log(value_at(middle) / target)
        if (gap > 0) == (gap_low > 0):
            low, gap_low = middle, gap
        else:
            high = middle
    return math.sqrt(low * high)


def fit(rows: Sequence[Measurement], plan: Sequence[tuple[str, str]] = FIT_PLAN,
        rules: dict[str, str] = RULES) -> dict[str, float]:
    """Every parameter from its one fitting row, in the plan's order; refuses a plan row
    that is not marked ``fit`` in the table or is fitted twice."""
    by_id = {row.id: row for row in rows}
    marked = {row.id for row in rows if row.role == "fit"}
    planned = [row_id for _, row_id in plan]
    if sorted(planned) != sorted(marked):
        raise ValueError(f"the fit plan's rows {sorted(set(planned) ^ marked)} differ from the table's fit rows")
    params: dict[str, float] = {}
    for name, row_id in plan:
        row = by_id[row_id]
        try:
            params[name] = _solve(lambda value: predict(row, {**params, name: value}, rules), row.quoted)
        except (KeyError, ValueError) as error:
            raise ValueError(f"cannot fit {name} on {row_id}: {error}") from None
    return params


def describe(params: dict[str, float]) -> list[dict[str, Any]]:
    """The parameters as a table: what each is, its value in readable units, the row it came from."""
    rows_of = dict(FIT_PLAN)
    out = []
    for name, value in params.items():
        kind, _, key = name.partition(":")
        unit, scale = (("GB/s", 1e9) if kind.endswith("Bps") else ("µs", 1e-6) if kind.endswith("_s")
                       else ("KB", 1e3))
        out.append({"parameter": name, "meaning": PARAMETER_NAMES[kind] + (f" ({key})" if key else ""),
                    "value": value / scale, "unit": unit, "fitted on": rows_of.get(name, "")})
    return out


def evaluate(rows: Sequence[Measurement], params: dict[str, float], rules: dict[str, str] = RULES) -> list[dict[str, Any]]:
    """Every fitting, held-out and own row the model predicts: quoted, predicted (both in the
    row's unit) and the relative error."""
    out = []
    for row in rows:
        predicted = predict(row, params, rules) if row.role in PREDICTED else None
        if predicted is None:
            continue
        out.append({
            "id": row.id, "source": row.source, "url": row.url, "hardware": row.hardware, "link": row.model_link,
            "mechanism": row.mechanism, "metric": row.metric, "role": row.role, "unit": row.unit,
            "quoted": row.quoted / row.scale, "low": row.low / row.scale, "high": row.high / row.scale,
            "predicted": predicted / row.scale, "error": predicted / row.quoted - 1,
        })
    return out


def error_bands(evaluation: Sequence[dict[str, Any]]) -> dict[tuple[str, str], tuple[float, float, int]]:
    """(mechanism, link) -> the interquartile range of the held-out errors and how many rows
    gave it: the mechanism's held-out rows, plus those of that link's own bandwidth. Under
    MIN_BAND_ROWS rows there is no range to speak of: NaN."""
    held = [e for e in evaluation if e["role"] == "held-out"]
    bands = {}
    for mechanism in QUESTION_MECHANISMS:
        for link in sorted(set(MACHINES.values())):
            errors = [e["error"] for e in held
                      if e["mechanism"] == mechanism or (e["mechanism"] == "copy_engine" and e["link"] == link)]
            if len(errors) >= MIN_BAND_ROWS:
                first, _, third = quantiles(errors, n=4, method="inclusive")
                bands[mechanism, link] = (first, third, len(errors))
            else:
                bands[mechanism, link] = (math.nan, math.nan, len(errors))
    return bands


def layout_question(params: dict[str, float], evaluation: Sequence[dict[str, Any]],
                    models: Sequence[str | ModelGeometry] = QUESTION_MODELS, tokens: Sequence[int] = QUESTION_TOKENS,
                    machines: dict[str, str] = MACHINES, mechanisms: Sequence[str] = QUESTION_MECHANISMS,
                    per_layer: str = "LBHNC", cross_layer: str = "BLHNC") -> list[dict[str, Any]]:
    """Loading a prefix (scattered 16-token blocks, host to GPU) per-layer against cross-layer,
    for every model x prefix x machine x mechanism, with the held-out error band: were the model
    off as on the middle half of its held-out rows (errors q1 to q3), a true time would lie in
    [predicted / (1 + q3), predicted / (1 + q1)]; the gain's band combines the two layouts' bands
    at their worst. NIXL's times need its link's bandwidth,
    which no published row gives: its rows carry the gain alone (time scales as B + n x post).
    ``models``: preset names or geometries (a model folder's, at its block size)."""
    bands = error_bands(evaluation)
    out = []
    for model in models:
        geometry = model if isinstance(model, ModelGeometry) else preset(model)
        for count in tokens:
            costs = [transfer_cost(layout, geometry, count) for layout in (per_layer, cross_layer)]
            for machine, link in machines.items():
                for mechanism in mechanisms:
                    transport = NIXL_TRANSPORTS[link] if mechanism == "nixl" else ""
                    if mechanism == "nixl":
                        work = [c["bytes_moved"] + c["segments"] * params[f"post_bytes:{transport}"] for c in costs]
                        times: list[float | None] = [None, None]
                    else:
                        work = times = [transfer_seconds(params, mechanism, link, c["bytes_moved"], c["segments"],
                                                         c["mean_segment_bytes"], "load") for c in costs]
                    smallest, largest, _ = bands[mechanism, link]
                    gain = work[0] / work[1]
                    out.append({
                        "model": geometry.name, "tokens": count, "machine": machine, "link": link,
                        "mechanism": mechanism, "transport": transport, "bytes": costs[0]["bytes_moved"],
                        "per_layer_segments": costs[0]["segments"], "cross_layer_segments": costs[1]["segments"],
                        "per_layer_segment_bytes": costs[0]["mean_segment_bytes"],
                        "per_layer_s": times[0], "cross_layer_s": times[1], "gain": gain,
                        "gain_low": gain * (1 + smallest) / (1 + largest),
                        "gain_high": gain * (1 + largest) / (1 + smallest),
                        "band": (smallest, largest),
                    })
    return out


def rule_ablation(rows: Sequence[Measurement]) -> list[dict[str, Any]]:
    """The held-out median |error| of each mechanism that has an overlap rule, under its
    rule and under the other one (everything refitted): the rule is chosen, not tuned."""
    out = []
    for mechanism, chosen in RULES.items():
        for rule in ("pipelined", "additive"):
            rules = {**RULES, mechanism: rule}
            errors = [abs(e["error"]) for e in evaluate(rows, fit(rows, rules=rules), rules)
                      if e["role"] == "held-out" and e["mechanism"] == mechanism]
            out.append({"mechanism": mechanism, "rule": rule, "chosen": rule == chosen, "held_out_rows": len(errors),
                        "median_abs_error": median(errors), "max_abs_error": max(errors)})
    return out


def geometry_check(rows: Sequence[Measurement]) -> list[dict[str, Any]]:
    """The segment sizes vLLM published (role ``geometry``: a per-layer K or V sub-block in
    0.11, a whole cross-layer block in 0.12) against kvlab's presets at the same block size."""
    presets = {preset(name).name.split("/")[-1].lower(): name for name in QUESTION_MODELS + ("qwen3-8b",)}
    out = []
    for row in rows:
        if row.role != "geometry":
            continue
        name = row.moved.split()[0].split("/")[-1].lower()
        geometry = preset(presets[name], block_size=int(row.block_tokens))
        old = row.layout.startswith("per-layer")
        # a per-layer block splits into K and V sub-blocks; MLA's latent does not split
        expected = (geometry.page_bytes // (1 if geometry.is_mla else 2)) if old else geometry.block_bytes
        out.append({"id": row.id, "model": row.moved, "layout": row.layout, "published": f"{row.value} {row.unit}",
                    "kvlab": expected / UNITS[row.unit], "unit": row.unit, "error": expected / row.quoted - 1})
    return out
