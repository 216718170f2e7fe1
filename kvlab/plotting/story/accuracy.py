"""Notebook 06: round trips, generations and logprobs against recompute and the same-split
control, the task score, damaged KV, every architecture and the reference request, read
from the rows on the page. A statement of equality is made only where the rows show it."""

from __future__ import annotations

from typing import Any

from kvlab.experiments.paths import Reuse
from kvlab.plotting.common import as_records
from kvlab.plotting.story.claims import Prose, Takeaways, number, paragraphs, prose, quoted, span, takeaways
from kvlab.store.damage import DAMAGES


def _roundtrip_point(rows: list[dict]) -> str | None:
    ran = [r for r in rows if number(r.get("round_trips")) and r["round_trips"] > 0]
    if not ran:
        return None
    return (f"{sum(r['bit_exact'] for r in ran):,} of {sum(r['round_trips'] for r in ran):,} KV round trips "
            f"({len(ran)} layout × method pairs of {len({r.get('model') for r in ran})} models) came back bit-exact; "
            f"checksums agreed in {sum(r['checksums_equal'] for r in ran):,} {quoted(ran)}.")


def _path_totals(rows: list[dict]) -> dict[Reuse, list[float]]:
    totals: dict[Reuse, list[float]] = {}
    for r in rows:
        path = Reuse.of(r["path"])
        if path not in (None, Reuse.RECOMPUTE) and number(r.get("identical")):
            identical, prompts, diff = totals.get(path, [0, 0, 0.0])
            totals[path] = [identical + r["identical"], prompts + r["prompts"],
                            max(diff, r.get("max_logprob_diff_vs_control") or 0.0)]
    return totals


def _generations_point(rows: list[dict]) -> str | None:
    totals = _path_totals(rows)
    if not totals:
        return None
    control = totals.pop(Reuse.VLLM_PREFIX_HIT, None)
    paths = [f"{path.label} {identical:,}/{prompts:,} ({'bitwise' if diff == 0 else f'{diff:.1e}'})"
             for path, (identical, prompts, diff) in totals.items()]
    against = f"; vLLM's own prefix hit, the control, {control[0]:,}/{control[1]:,}" if control else ""
    runs = len({r.get("run_id") for r in rows})
    return (f"Greedy generations identical to recompute's{f' over {runs} runs' if runs > 1 else ''} (and the "
            f"largest logprob difference from the control): {', '.join(paths)}{against} {quoted(rows)}.")


def generations_reading(generations: Any) -> Prose:
    """Which reuse paths gave logprobs bitwise the control's, which only within a drift, and
    how far the control itself sits from recompute (another prefill split)."""
    rows = as_records(generations)
    control = next((r for r in rows if Reuse.of(r["path"]) is Reuse.VLLM_PREFIX_HIT), None)
    reuse = [r for r in rows if Reuse.of(r["path"]) not in (None, Reuse.RECOMPUTE, Reuse.VLLM_PREFIX_HIT)]
    if control is None or not reuse:
        return prose(None)
    bitwise = [r["path"] for r in reuse if r.get("max_logprob_diff_vs_control") == 0]
    other = [f"{r['path']} ({r['max_logprob_diff_vs_control']:.1e})" for r in reuse
             if r.get("max_logprob_diff_vs_control") != 0]
    drift = control["max_logprob_diff"]
    apart = ("gives logprobs bitwise recompute's" if drift == 0 else
             f"sits {drift:.1e} from recompute at most (its forward continues the cached prefix with the last tokens "
             "on their own, not inside one long prefill: another split of the same compute)")
    return prose(f"vLLM's own prefix hit, the control, {apart} {quoted(rows)}.",
                 f"Logprobs bitwise the control's: {', '.join(bitwise)}." if bitwise else
                 "No reuse path gave logprobs bitwise the control's.",
                 f"Within a drift of the control: {', '.join(other)}." if other else None)


def engine_differences_reading(differences: Any) -> Prose:
    """Section 2c: in bf16, how far vLLM's own prefix hit sits from recompute (the engine's
    difference) and each reuse path from that control (the connector's), and whether vLLM's
    batch-invariant mode could run here (a row that says why not, checked before measuring)."""
    rows = as_records(differences)
    invariance = next((r for r in rows if r.get("table") == "batch invariance"), None)
    if invariance is None:
        mode = None
    elif invariance.get("available"):
        mode = "vLLM's batch-invariant mode ran here: its rows are in the table above."
    else:
        mode = f"vLLM's batch-invariant mode cannot run here: {invariance.get('reason') or 'the row gives no reason'}."
    return paragraphs(generations_reading([r for r in rows if r.get("table") == "generations"]), prose(mode))


def task_reading(task: Any) -> Prose:
    """How often the model solves the task under recompute: a check is informative only on a
    task it solves sometimes but not always."""
    rows = [r for r in as_records(task) if Reuse.of(r["path"]) is Reuse.RECOMPUTE and number(r.get("accuracy"))]
    if not rows:
        return prose(None)
    best = max(rows, key=lambda r: r["accuracy"])
    return prose(f"Under recompute the model scores {best['accuracy']:.3f} ± {best['stderr']:.3f} ({best['filter']}, "
                 f"{best['n']:,} problems) {quoted(rows)}, so a damaged KV could move the score either way.")


def damages_reading() -> Prose:
    """The deliberate faults the sensitivity runs apply, in words (settings, not results)."""
    return prose("KVLab whole-step runs the same requests once more for each deliberate fault in its stored chunks "
                 "(`kvlab.store.damage`; the bytes are put back after each): "
                 + "; ".join(damage.describe() for damage in DAMAGES.values()) + ".")


def connectors_reading(comparison: Any) -> Prose:
    """Why store throughput is read from the runner's blocked time, not from two cold prefills."""
    rows = [r for r in as_records(comparison) if number(r.get("cold_s"))]
    if not rows:
        return prose(None)
    return prose(f"Store throughput is the KV bytes over `runner_save_ms`, the time the model runner blocked inside "
                 f"the connector's save calls during the cold forward, not the difference of two cold prefills "
                 f"(`cold_overhead_ms`): the engines' cold prefills took {span((r['cold_s'] for r in rows), ' s', 2)} "
                 f"here, a spread that a store's cost drowns in {quoted(rows)}.")


def _task_point(rows: list[dict]) -> str | None:
    scored = [r for r in rows if number(r.get("accuracy"))]
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
        if Reuse.of(r["path"]) is Reuse.KVLAB_WHOLE_STEP and number(r.get("changed_generations")):
            seen.setdefault(r["damage"], r)
    if not seen:
        return None
    return ("The same KV damaged on purpose changes KVLab whole-step's generations: "
            + "; ".join(f"{_damage_name(damage)}, {r['changed_generations']:,.0f} of {r['prompts']:,.0f}"
                        for damage, r in seen.items()) + ".")


def _damage_name(key: str) -> str:
    return DAMAGES[key].describe().split(" (")[0] if key in DAMAGES else key


def _architectures_point(rows: list[dict]) -> str | None:
    reuse = [r for r in rows if r.get("path") and Reuse.of(r["path"]) not in (Reuse.VLLM_PREFIX_HIT, None)
             and number(r.get("max_logprob_diff_vs_control"))]
    if not reuse:
        return None
    exact = [r for r in reuse if r["max_logprob_diff_vs_control"] == 0 and r.get("identical") == r.get("prompts")]
    return (f"Across {len({r['model'] for r in reuse})} architectures, {len(exact)} of {len(reuse)} reuse paths "
            f"gave tokens and logprobs bitwise their control's {quoted(reuse)}.")


def _seed_point(rows: list[dict]) -> str | None:
    repeats = [r for r in rows if "repeat" in str(r.get("request", ""))]
    if not repeats:
        return None
    served = [r for r in repeats if number(r.get("cached_tokens")) and r["cached_tokens"] > 0]
    return (f"vllm-ascend #2039's request through `vllm serve`: {len(served)} of {len(repeats)} repeated requests "
            f"were served from the connector ({span(r['cached_tokens'] for r in served)} cached tokens) "
            f"{quoted(rows)}." if served else
            f"vllm-ascend #2039's request through `vllm serve`: no repeated request was served from the connector "
            f"{quoted(rows)}.")


def accuracy_takeaways(roundtrips: Any, generations: Any = None, task: Any = None, sensitivity: Any = None,
                       architectures: Any = None, seed_requests: Any = None) -> Takeaways:
    """Notebook 06: bit-exact round trips (roundtrip_summary rows), generations identical to
    recompute per reuse path (against_control rows), the task score, how far the same KV
    damaged on purpose moved the generations, every architecture, and the reference request."""
    return takeaways(_roundtrip_point(as_records(roundtrips)), _generations_point(as_records(generations)),
                     _task_point(as_records(task)), _damage_point(as_records(sensitivity)),
                     _architectures_point(as_records(architectures)), _seed_point(as_records(seed_requests)))

