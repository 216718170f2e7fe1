"""Notebooks 03 and 04: the connector's time to first token against the engine's own prefix
hit, the hooks traced layer by layer, per-layer against cross-layer hand-over, and inside the
engine. Overheads carry their interval; a comparison is claimed only beyond it."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from kvlab.experiments.paths import Reuse
from kvlab.experiments.ttft import CONNECTOR_MODES, engine_floor
from kvlab.plotting.common import as_records
from kvlab.plotting.story.claims import (Prose, Takeaways, against_target, amount, medians_only, number, paragraphs,
                                         prose, quantity, quoted, span, takeaways, versus)
from kvlab.plotting.story.serving import as_lies_point
from kvlab.harness.spread import (SAMPLES_KEY, Estimate, bootstrapped, median_only, row_difference, row_estimate,
                                  spread, summary_difference)

KVLAB_OVER_EXAMPLE_TARGET = 0.5  # KVLab's whole-step overhead at most half ExampleConnector's


def overhead(row: dict) -> Estimate:
    """A warm row's overhead over its own engine's floor, in seconds, with its interval."""
    if number(row.get("overhead_low_s")):
        samples = row.get("overhead_samples") or 1
        return Estimate(row["overhead_s"], row["overhead_low_s"], row["overhead_high_s"], int(samples),
                        row.get("overhead_interval") or "min-max")
    return row_difference(row, engine_floor(row)) if number(row.get("engine_floor_s")) else \
        median_only(row["overhead_s"])


def _median_overhead(warm: list[float], floor: list[float]) -> float:
    return statistics.median(warm) - statistics.median(floor)


def overhead_difference(a: dict, b: dict) -> Estimate:
    """(a's overhead) - (b's overhead), each over its own engine's floor: bootstrapped from
    the four sets of samples where the rows kept them, else from the two overheads' ranges."""
    groups = [a.get(SAMPLES_KEY), a.get("engine_floor_samples_s"), b.get(SAMPLES_KEY), b.get("engine_floor_samples_s")]
    if all(groups):
        return bootstrapped(lambda wa, fa, wb, fb: _median_overhead(wa, fa) - _median_overhead(wb, fb), *groups)
    return summary_difference(overhead(a), overhead(b))


def _ms(estimate: Estimate) -> str:
    return quantity(estimate.scaled(1e3), "ms", 1)


def _by_path(rows: list[dict]) -> dict[Reuse | None, list[dict]]:
    paths: dict[Reuse | None, list[dict]] = defaultdict(list)
    for r in rows:
        paths[Reuse.of(r["scenario"])].append(r)
    return paths


def _plain_floor(rows: list[dict]) -> dict | None:
    return next(iter(_by_path(rows)[Reuse.VLLM_PREFIX_HIT]), None)


def floor_flags(ttft: Any) -> list[str]:
    """Each engine whose own prefix hit differs from the plain engine's beyond their spread:
    a fault to find, so the text names it instead of reading an overhead off the plain floor."""
    rows = as_records(ttft)
    plain = _plain_floor(rows)
    flags, seen = [], set()
    for r in rows:
        if plain is None or r is plain or not number(r.get("engine_floor_s")) or r.get("phase") == "cold":
            continue
        floor = engine_floor(r)
        key = (round(r["engine_floor_s"], 9), len(floor.get(SAMPLES_KEY) or ()))
        drift = row_difference(floor, plain)
        if key in seen or not drift.excludes(0.0):
            continue
        seen.add(key)
        flags.append(f"The engine of **{r['scenario']}** served its own prefix hits in "
                     f"{_ms(row_estimate(floor))}, the engine without a connector in {_ms(row_estimate(plain))}: "
                     f"{versus(drift.scaled(1e3), 'its floor', 'the plain one')}. Its overhead is read against its "
                     "own floor, and this difference is a fault to find, not a finding.")
    return flags


def ttft_reading(ttft: Any) -> Prose:
    """Section 1: cached tokens, agreement with recompute beside vLLM's own prefix hit, each
    connector's overhead over its own engine's floor, KVLab's against ExampleConnector's, and
    any floor that differs from the plain engine's."""
    rows = as_records(ttft)
    paths = _by_path(rows)
    warm = [r for r in rows if r.get("phase") != "cold" and Reuse.of(r["scenario"]) not in
            (Reuse.VLLM_PREFIX_HIT, Reuse.RECOMPUTE)]
    control = _plain_floor(rows)
    if not warm or control is None:
        return prose(None)
    cached = span((r["cached_tokens"] for r in warm))
    agreement = {(r["identical"], r["prompts"]) for r in warm}
    agree = (f"exactly as far as vLLM's own prefix hit does ({control['identical']} of {control['prompts']} prompts "
             "identical to recompute)" if agreement == {(control["identical"], control["prompts"])} else
             "; ".join(f"{r['scenario']} {r['identical']} of {r['prompts']}" for r in warm)
             + f", vLLM's own prefix hit {control['identical']} of {control['prompts']}")
    opening = prose(f"Every warm run found {cached} of {span(r['prompt_tokens'] for r in warm)} prompt tokens "
                    "cached: every full block but the one holding the last token, which vLLM always computes.",
                    f"Against recompute, the warm generations agree {agree} {quoted(rows)}.")
    costs = Prose("\n".join(f"- **{r['scenario']}**: {_ms(overhead(r))} over its own engine's prefix hit."
                            for r in warm))
    note = medians_only(*(overhead(r) for r in warm))
    kvlab = next((r for r in paths[Reuse.KVLAB_WHOLE_STEP] if r["scenario"].endswith("memory")), None)
    example = next(iter(paths[Reuse.EXAMPLE_CONNECTOR]), None)
    compared = None
    if kvlab is not None and example is not None:
        gap = overhead_difference(kvlab, example).scaled(1e3)
        compared = prose(f"KVLab whole-step from memory against ExampleConnector, each over its own floor: "
                         f"{versus(gap, 'KVLab', 'ExampleConnector', 'ms', 1)}.",
                         target_sentence(kvlab, example))
    return paragraphs(opening, costs, prose(note) if note else None, compared, *floor_flags(rows))


def target_sentence(kvlab: dict, example: dict) -> str:
    """KVLab's overhead as a share of ExampleConnector's, against the target: judged only
    where ExampleConnector's own overhead is resolved above zero."""
    theirs = overhead(example)
    if not theirs.excludes(0.0) or theirs.value <= 0:
        return (f"The target (KVLab's overhead at most {KVLAB_OVER_EXAMPLE_TARGET:g}× ExampleConnector's) cannot be "
                "judged here: ExampleConnector's own overhead is not resolved above zero.")
    ours = overhead(kvlab)
    value = ours.value / theirs.value
    share = Estimate(value, min(value, ours.low / theirs.high), max(value, ours.high / theirs.low),
                     min(ours.samples, theirs.samples), ours.how)
    return (f"KVLab's overhead as a share of ExampleConnector's (the interval pairs the two overheads' extremes): "
            f"{against_target(share, KVLAB_OVER_EXAMPLE_TARGET, unit='×')}.")


def timeline_reading(timeline: Any, layer_bytes: float | None = None) -> Prose:
    """Section 2: per layer, the attention's time against the wait for that layer's load."""
    rows = as_records(timeline)
    spans: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        spans[r["event"]].append(1e3 * (r["end"] - r["start"]))
    if not spans.get("attention") or not spans.get("load_wait"):
        return prose(None)
    attention, wait = spread(spans["attention"]), spread(spans["load_wait"])
    share = sum(spans["load_wait"]) / (sum(spans["load_wait"]) + sum(spans["attention"]))
    sized = f" ({amount(layer_bytes / 2**20, 'MiB', 2)} of KV a layer)" if layer_bytes else ""
    return prose(f"Per layer{sized}, attention took {quantity(attention, 'ms', 3)} and the layer waited for its "
                 f"load {quantity(wait, 'ms', 3)}: waiting was {share:.1%} of the time the two took together "
                 f"{quoted(rows)}.",
                 "The copies ran ahead of the compute on a thread (on a GPU or NPU: a copy stream, an event a layer), "
                 "so a layer waits only when its copy is slower than the layers before it took to compute.")


def registration_reading(registration: Any) -> Prose:
    """Section 3: copies per save and load, per-layer against cross-layer hand-overs, and
    whether the fastest of each differ in time beyond their samples' spread."""
    rows = as_records(registration)
    groups = {cross: [r for r in rows if r.get("cross_layer") == cross] for cross in (True, False)}
    if not groups[True] or not groups[False]:
        return prose(None)
    sentences = [f"Handing {rows[0]['tokens']:,} tokens to the connector, per-layer registrations cost "
                 f"{span(r['save_segments'] for r in groups[False])} copies per save and "
                 f"{span(r['load_segments'] for r in groups[False])} per load, cross-layer ones "
                 f"{span(r['save_segments'] for r in groups[True])} and {span(r['load_segments'] for r in groups[True])} "
                 f"{quoted(rows)}."]
    for direction in ("save", "load"):
        best = {cross: min(group, key=lambda r: r[f"{direction}_ms"]) for cross, group in groups.items()}
        a, b = best[True].get(f"{direction}_samples_ms"), best[False].get(f"{direction}_samples_ms")
        if a and b:
            gap = bootstrapped(lambda x, y: statistics.median(x) - statistics.median(y), a, b)
            sentences.append(f"The fastest {direction}s: {versus(gap, 'cross-layer (' + best[True]['registration'] + ')', 'per-layer (' + best[False]['registration'] + ')', 'ms', 2)}.")
        else:
            sentences.append(f"The fastest {direction}s: cross-layer {amount(best[True][f'{direction}_ms'], 'ms', 2)}, "
                             f"per-layer {amount(best[False][f'{direction}_ms'], 'ms', 2)}, medians whose samples "
                             "these rows did not keep, so this run cannot tell them apart.")
    return prose(*sentences)


def _bitwise(r: dict) -> bool:
    return r.get("identical") == r.get("prompts") and r.get("max_logprob_diff") == 0


def layouts_reading(layouts: Any) -> Prose:
    """Section 4: per mode and tier, per-layer against cross-layer overhead (each over its own
    engine's floor, compared beyond the spread), their copy times and segments, the share of
    the copying hidden behind compute, and whether every variant is bitwise its control."""
    rows = [r for r in as_records(layouts) if isinstance(r.get("hand_over"), str)]
    if not rows:
        return prose(None)
    by = {(r["layout"], r["mode"], r["tier"]): r for r in rows}
    lines = []
    for mode in CONNECTOR_MODES:
        for tier in ("memory", "Redis"):
            per, cross = by.get(("LBHNC", mode, tier)), by.get(("BLHNC", mode, tier))
            if per is None or cross is None:
                continue
            gap = overhead_difference(cross, per).scaled(1e3)
            line = (f"- **{mode}, {tier}**: over the floor {amount(1e3 * per['overhead_s'])} per-layer, "
                    f"{amount(1e3 * cross['overhead_s'])} cross-layer; {versus(gap, 'cross-layer', 'per-layer')}. "
                    f"Copy {amount(1e3 * per['copy_s'])} against {amount(1e3 * cross['copy_s'])}, in "
                    f"{per['segments_per_chunk']:,.0f} against {cross['segments_per_chunk']:,.0f} segments a chunk")
            if mode != "whole-step" and number(per.get("hidden_share")) and number(cross.get("hidden_share")):
                line += (f"; hidden behind compute {per['hidden_share']:.0%} per-layer, "
                         f"{cross['hidden_share']:.0%} cross-layer")
            lines.append(line + ".")
    note = medians_only(*(overhead(r) for r in rows))
    exact = sum(_bitwise(r) for r in rows)
    closing = (f"{exact} of {len(rows)} variants gave tokens and logprobs bitwise those of vLLM's own prefix hit "
               f"in the same engine (the same prefill split); the largest logprob gap to recompute, which splits "
               f"the prefill otherwise, was {max(r.get('gap_vs_recompute') or 0 for r in rows):.2g} {quoted(rows)}.")
    return paragraphs(Prose("\n".join(lines)), note, closing)


def connector_takeaways(ttft: Any, registration: Any = None, layouts: Any = None) -> Takeaways:
    """Notebook 03's takeaways: KVLab's overhead over its own floor and against ExampleConnector
    (ttft_scenarios rows with_overheads), the copies of per-layer and cross-layer hand-overs
    (registration_costs rows), and per-layer against cross-layer inside the engine
    (layouts_in_the_engine rows), each claim within its spread."""
    rows = as_records(ttft)
    paths = _by_path(rows)
    kvlab = [r for r in paths[Reuse.KVLAB_WHOLE_STEP] if r.get("phase") != "cold" and number(r.get("overhead_s"))]
    recompute = next(iter(paths[Reuse.RECOMPUTE]), None)
    points: list[str | None] = []
    if kvlab and recompute is not None:
        memory = next((r for r in kvlab if r["scenario"].endswith("memory")), kvlab[0])
        faster = recompute["median_s"] / memory["median_s"]
        points.append(f"With {memory['cached_tokens']:,.0f} of {memory['prompt_tokens']:,.0f} prompt tokens served "
                      f"from its memory tier, **{memory['scenario']}** answers in "
                      f"{_ms(row_estimate(memory))}: {_ms(overhead(memory))} over its own engine's prefix hit, "
                      f"{faster:,.0f}× faster than recompute's {amount(1e3 * recompute['median_s'], 'ms', 0)} "
                      f"{quoted(rows)}.")
        example = next(iter(paths[Reuse.EXAMPLE_CONNECTOR]), None)
        if example is not None:
            gap = overhead_difference(memory, example).scaled(1e3)
            points.append(f"Against vLLM's ExampleConnector, each over its own floor: "
                          f"{versus(gap, 'KVLab', 'ExampleConnector')}.")
        points.extend(floor_flags(rows))
    registration = as_records(registration)
    groups = {cross: [r for r in registration if r.get("cross_layer") == cross] for cross in (True, False)}
    if groups[True] and groups[False]:
        points.append(f"Handing {registration[0]['tokens']:,} tokens to the connector, per-layer registrations cost "
                      f"{span(r['save_segments'] for r in groups[False])} copies per save, cross-layer ones "
                      f"{span(r['save_segments'] for r in groups[True])}.")
    points.append(engine_point(layouts))
    return takeaways(*points)


def engine_point(layouts: Any) -> str | None:
    """Per-layer against cross-layer inside the engine, whole-step from memory, each over its
    own engine's floor (layouts_in_the_engine rows); None without both."""
    engine = [r for r in as_records(layouts) if isinstance(r.get("hand_over"), str) and r.get("mode") == "whole-step"
              and r.get("tier") == "memory"]
    per = next((r for r in engine if r["layout"] == "LBHNC"), None)
    cross = next((r for r in engine if r["layout"] == "BLHNC"), None)
    if per is None or cross is None:
        return None
    return (f"Inside the engine, whole-step from memory, a chunk is {per['segments_per_chunk']:,.0f} copies per-layer "
            f"and {cross['segments_per_chunk']:,.0f} cross-layer: "
            f"{versus(overhead_difference(cross, per).scaled(1e3), 'cross-layer', 'per-layer')} {quoted(engine)}.")


def cross_layer_takeaways(layouts: Any, network: Any = None, beyond: Any = None) -> Takeaways:
    """Notebook 04's takeaways: per-layer against cross-layer inside the engine
    (layouts_in_the_engine rows) and stored as it lies in each network store (rows of
    redis_prefix_costs and of scale_model.measure_stores), each claim within its spread."""
    prefixes = [r for r in as_records(beyond) if r.get("kind") == "prefix"]
    stores = [("Redis", as_records(network))] + [(name, [r for r in prefixes if r.get("store") == store])
                                                  for name, store in (("Mooncake Store", "mooncake"),
                                                                      ("a Redis Cluster", "redis cluster"))]
    return takeaways(engine_point(layouts), *(as_lies_point(rows, name) for name, rows in stores))
