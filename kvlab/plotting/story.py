"""Each notebook's takeaways: a few key numbers read from its result rows and written as
Markdown, so a notebook's closing summary says what this run measured instead of numbers
typed in once (prose beside a figure ages; these cannot). A notebook's last cell ends with
its ``*_takeaways`` call and Jupyter shows the Markdown (``_repr_markdown_``); a notebook
without a helper of its own passes ready-made points to :func:`takeaways`."""

from __future__ import annotations

import math
import numbers
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable

from kvlab.cache.layouts import get_layout
from kvlab.experiments.paths import Reuse
from kvlab.plotting.common import as_records, human_bytes

PER_OBJECT = "object per run"  # kvlab.experiments.network's strategy that stores a chunk as it lies


@dataclass(frozen=True)
class Takeaways:
    """Points shown as a Markdown bullet list (plain lines where Markdown is not rendered)."""
    points: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("no takeaways: the rows given hold none of the numbers they are read from")

    def markdown(self) -> str:
        return "\n".join(f"- {point}" for point in self.points)

    def _repr_markdown_(self) -> str:
        return self.markdown()

    def __str__(self) -> str:
        return self.markdown()


def takeaways(*points: str | None) -> Takeaways:
    """Takeaways from ready-made points; a None point (its rows were missing) is left out."""
    return Takeaways(tuple(point for point in points if point))


def _number(value: Any) -> bool:
    """A measured number (numpy's and pandas' too), not a missing one (None, NaN, pd.NA)."""
    return isinstance(value, numbers.Real) and not math.isnan(value)


def _span(values: Iterable[float], unit: str = "") -> str:
    """``low–high`` (or one value) of counts, with thousands separators."""
    values = sorted(values)
    low, high = f"{values[0]:,.0f}", f"{values[-1]:,.0f}"
    return f"{low}{unit}" if low == high else f"{low}–{high}{unit}"


def _cross_layer(layout: str) -> bool:
    return get_layout(layout).is_cross_layer


def _short(model: str) -> str:
    """A model's name without its organisation."""
    return model.split("/")[-1]


# 01 and 05: what a transfer touches


def segments_point(rows: Any, block_size: int | None = None) -> str | None:
    """Copies per-layer and cross-layer layouts need to move the same tokens, from rows of
    kvlab.cache.transfer_cost or sweep (of the first token count and block size unless named)."""
    rows = [r for r in as_records(rows) if _number(r.get("segments"))]
    if not rows:
        return None
    block_size = rows[0].get("block_size") if block_size is None else block_size
    rows = [r for r in rows if r["tokens"] == rows[0]["tokens"] and r.get("block_size") == block_size]
    per_layer = [r for r in rows if not _cross_layer(r["layout"])]
    cross_layer = [r for r in rows if _cross_layer(r["layout"])]
    if not per_layer or not cross_layer:
        return None
    fewer = min(r["segments"] for r in per_layer) / max(r["segments"] for r in cross_layer)
    sized = f", block size {block_size}" if block_size else ""
    return (f"Moving {rows[0]['tokens']:,} tokens ({human_bytes(rows[0]['bytes'])}{sized}) from "
            f"{rows[0].get('block_ids', 'scattered')} blocks "
            f"takes the per-layer layouts {_span(r['segments'] for r in per_layer)} copies, the cross-layer ones "
            f"{_span(r['segments'] for r in cross_layer)}: {fewer:,.0f}× fewer than the fewest per-layer, "
            f"of {human_bytes(min(r['mean_segment_bytes'] for r in cross_layer))} or more each instead of at most "
            f"{human_bytes(max(r['mean_segment_bytes'] for r in per_layer))}.")


def layout_takeaways(rows: Any) -> Takeaways:
    """Notebook 01: the copies of one transfer at each block size, from kvlab.cache.sweep rows."""
    sizes = dict.fromkeys(r.get("block_size") for r in as_records(rows))
    return takeaways(*(segments_point(rows, size) for size in sizes))


def extension_takeaways(checks: Any, costs: Any, layout: str, method: str) -> Takeaways:
    """Notebook 05: the new ``layout`` and ``method`` in the round-trip checks (rows of
    kvlab.experiments.roundtrip.roundtrip) and in the segment arithmetic (transfer_cost rows:
    every layout at the last token count, the one that cuts a block)."""
    new = [r for r in as_records(checks) if r["layout"] == layout or r["method"] == method]
    exact = (f"{sum(bool(r['exact']) for r in new)} of {len(new)} round trips through the new {layout} layout "
             f"or the new {method} method came back exact." if new else None)
    costs = as_records(costs)
    cut = [r for r in costs if r["tokens"] == costs[-1]["tokens"]] if costs else []
    copies = (f"Moving {cut[0]['tokens']:,} tokens: "
              + ", ".join(f"{r['layout']} {r['segments']:,} copies" for r in cut) + "." if cut else None)
    return takeaways(exact, copies)


# 02: transfer timing


def _worse_direction(rows: list[dict]) -> dict[tuple[str, str], float]:
    """Each (layout, method)'s ratio to the ceiling, the worse of offload and load."""
    worse: dict[tuple[str, str], float] = {}
    for r in rows:
        key = (r["layout"], r["method"])
        worse[key] = min(worse.get(key, math.inf), r["ratio"])
    return worse


def transfer_takeaways(rows: Any, model: str, tokens: int, layer_rows: Any = None) -> Takeaways:
    """Notebook 02: the best per-layer and cross-layer ratio to the copy ceiling and their
    copies for ``tokens`` tokens of ``model`` (bench rows, scattered blocks to host memory, one
    machine: the first's), and the best layerwise speed-up (run_pipeline_sweep rows)."""
    headline = [r for r in as_records(rows) if r.get("status") == "ok" and r["model"] == model
                and r["tokens"] == tokens and r.get("block_ids") == "scattered" and r.get("target") == "host"
                and _number(r.get("ratio"))]
    headline = [r for r in headline if r.get("hardware") == headline[0].get("hardware")] if headline else []
    points = []
    if headline:
        worse = _worse_direction(headline)
        best = {cross: max(((key, ratio) for key, ratio in worse.items() if _cross_layer(key[0]) == cross),
                           key=lambda item: item[1], default=None) for cross in (True, False)}
        if best[True] and best[False]:
            (cross_layout, cross_method), cross_ratio = best[True]
            (layer_layout, layer_method), layer_ratio = best[False]
            points.append(f"Moving {tokens:,} tokens of {_short(model)}, the best cross-layer transfer ({cross_layout}, "
                          f"{cross_method}) reaches {cross_ratio:.2f} of the copy ceiling, the best per-layer one "
                          f"({layer_layout}, {layer_method}) {layer_ratio:.2f} (each the worse of offload and load; "
                          f"{headline[0].get('hardware', 'this machine')}).")
        segments = {cross: [r["segments"] for r in headline if _cross_layer(r["layout"]) == cross] for cross in (True, False)}
        if segments[True] and segments[False]:
            points.append(f"The same bytes take per-layer layouts {_span(segments[False])} copies and cross-layer "
                          f"ones {_span(segments[True])}.")
    points.append(layerwise_point(layer_rows))
    return takeaways(*points)


def layerwise_point(rows: Any) -> str | None:
    """The best layerwise speed-up and where loading layer by layer beat loading first."""
    rows = [r for r in as_records(rows) if _number(r.get("speedup"))]
    if not rows:
        return None
    best = max(rows, key=lambda r: r["speedup"])
    faster = [r for r in rows if r["speedup"] > 1]
    where = (f"it beat loading first in {len(faster)} of {len(rows)} settings, none below compute intensity "
             f"{min(r['intensity'] for r in faster):g}" if faster else f"it never beat loading first in {len(rows)} settings")
    return (f"Layerwise loading: at best {best['speedup']:.2f}× ({_short(best['model'])}, {best['tokens']:,} tokens, "
            f"compute intensity {best['intensity']:g}); {where}.")


# 03: the connector


def connector_takeaways(ttft: Any, registration: Any = None, network: Any = None) -> Takeaways:
    """Notebook 03: KVLab's time to first token against vLLM's own prefix hit, recompute and
    ExampleConnector (ttft_scenarios rows with_overheads), the copies of per-layer and
    cross-layer hand-overs (registration_costs rows), and Redis objects per chunk
    (redis_prefix_costs rows)."""
    return takeaways(*_ttft_points(as_records(ttft)), _registration_point(as_records(registration)),
                     _network_point(as_records(network)))


def _ttft_points(rows: list[dict]) -> list[str | None]:
    by_path = defaultdict(list)
    for r in rows:
        by_path[Reuse.of(r["scenario"])].append(r)
    kvlab = [r for r in by_path[Reuse.KVLAB_WHOLE_STEP] if _number(r.get("overhead_s"))]
    floor, recompute = by_path[Reuse.VLLM_PREFIX_HIT], by_path[Reuse.RECOMPUTE]
    if not kvlab or not floor or not recompute:
        return [None]
    fastest = min(kvlab, key=lambda r: r["median_s"])
    example = [r for r in by_path[Reuse.EXAMPLE_CONNECTOR] if _number(r.get("overhead_s"))]
    versus = f"; ExampleConnector adds {1e3 * example[0]['overhead_s']:.1f} ms" if example else ""
    return [f"With {fastest['cached_tokens']:,} of {fastest['prompt_tokens']:,} prompt tokens served from its store, "
            f"**{fastest['scenario']}** answers in {1e3 * fastest['median_s']:.0f} ms: "
            f"{1e3 * fastest['overhead_s']:.1f} ms over vLLM's own prefix hit ({1e3 * floor[0]['median_s']:.0f} ms), "
            f"{recompute[0]['median_s'] / fastest['median_s']:.0f}× faster than recompute "
            f"({1e3 * recompute[0]['median_s']:,.0f} ms){versus}.",
            f"Its warm generations equal recompute's token for token on {fastest['identical']} of "
            f"{fastest['prompts']} prompts ({_short(fastest['model'])})."]


def _registration_point(rows: list[dict]) -> str | None:
    groups = {cross: [r for r in rows if r.get("cross_layer") == cross] for cross in (True, False)}
    if not groups[True] or not groups[False]:
        return None

    def cost(group: list[dict]) -> str:
        return f"{_span(r['save_segments'] for r in group)} copies per save ({_span((r['save_ms'] for r in group), ' ms')})"

    return (f"Handing {rows[0]['tokens']:,} tokens to KVLabConnector, per-layer registrations cost "
            f"{cost(groups[False])}, cross-layer ones {cost(groups[True])}.")


def _network_point(rows: list[dict]) -> str | None:
    as_lies = [r for r in rows if r.get("strategy") == PER_OBJECT]
    groups = {cross: [r for r in as_lies if _cross_layer(r["layout"]) == cross] for cross in (True, False)}
    if not groups[True] or not groups[False]:
        return None
    layer, cross = groups[False][0], groups[True][0]
    return (f"Through Redis, a {layer['tokens']:,}-token prefix stored as it lies is {layer['objects_per_chunk']:,.0f} "
            f"objects per chunk per-layer ({layer['layout']}) and {cross['objects_per_chunk']:,.0f} cross-layer "
            f"({cross['layout']}): stored in {1e3 * layer['store_s']:.0f} ms against {1e3 * cross['store_s']:.0f} ms.")


# 04: accuracy


def accuracy_takeaways(roundtrips: Any, generations: Any = None, task: Any = None, sensitivity: Any = None) -> Takeaways:
    """Notebook 04: bit-exact round trips (roundtrip_summary rows), generations identical to
    recompute per reuse path (against_control rows), the task score, and how far the same KV
    damaged on purpose moved the generations."""
    return takeaways(_roundtrip_point(as_records(roundtrips)), _generations_point(as_records(generations)),
                     _task_point(as_records(task)), _damage_point(as_records(sensitivity)))


def _roundtrip_point(rows: list[dict]) -> str | None:
    ran = [r for r in rows if _number(r.get("round_trips")) and r["round_trips"] > 0]
    if not ran:
        return None
    return (f"{sum(r['bit_exact'] for r in ran):,} of {sum(r['round_trips'] for r in ran):,} KV round trips "
            f"({len(ran)} layout × method pairs of {len({r.get('model') for r in ran})} models) came back bit-exact; "
            f"checksums agreed in "
            f"{sum(r['checksums_equal'] for r in ran):,}.")


def _generations_point(rows: list[dict]) -> str | None:
    totals: dict[Reuse, list[float]] = {}
    for r in rows:
        path = Reuse.of(r["path"])
        if path not in (None, Reuse.RECOMPUTE) and _number(r.get("identical")):
            identical, prompts, diff = totals.get(path, [0, 0, 0.0])
            totals[path] = [identical + r["identical"], prompts + r["prompts"],
                            max(diff, r.get("max_logprob_diff_vs_control") or 0.0)]
    if not totals:
        return None
    control = totals.pop(Reuse.VLLM_PREFIX_HIT, None)
    paths = [f"{path.label} {identical:,}/{prompts:,} ({'bitwise' if diff == 0 else f'{diff:.1e}'})"
             for path, (identical, prompts, diff) in totals.items()]
    against = f"; vLLM's own prefix hit, the control, {control[0]:,}/{control[1]:,}" if control else ""
    runs = len({r.get("run_id") for r in rows})
    return (f"Greedy generations identical to recompute's{f' over {runs} runs' if runs > 1 else ''} (and the "
            f"largest logprob difference from the control): {', '.join(paths)}{against}.")


def _task_point(rows: list[dict]) -> str | None:
    scored = [r for r in rows if _number(r.get("accuracy"))]
    references = [r for r in scored if Reuse.of(r["path"]) is Reuse.RECOMPUTE]
    if not references:
        return None
    reference = max(references, key=lambda r: r["accuracy"])  # the task the model solves sometimes
    same = [r for r in scored if r["filter"] == reference["filter"] and r.get("run_id") == reference.get("run_id")
            and Reuse.of(r["path"]) not in (None, Reuse.RECOMPUTE)]
    if not same:
        return None
    scores = ", ".join(sorted({f"{r['accuracy']:.3f}" for r in same}))
    return (f"On the task ({reference['filter']}) recompute scores {reference['accuracy']:.3f} ± "
            f"{reference['stderr']:.3f}, the {len(same)} reuse paths {scores}.")


def _damage_point(rows: list[dict]) -> str | None:
    seen: dict[str, dict] = {}
    for r in rows:
        if Reuse.of(r["path"]) is Reuse.KVLAB_WHOLE_STEP and _number(r.get("changed_generations")):
            seen.setdefault(r["damage"], r)
    if not seen:
        return None
    return ("The same KV damaged on purpose changes KVLab whole-step's generations: "
            + ", ".join(f"{damage} {r['changed_generations']:,.0f}/{r['prompts']:,.0f}" for damage, r in seen.items())
            + ".")
