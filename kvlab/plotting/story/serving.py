"""Notebooks 04 and 05: stores over a network (Redis, Mooncake Store, a Redis
Cluster), what their measured costs predict for many hosts, where a hit's milliseconds go,
and how every cost grows. Each number names its run; a difference is claimed beyond its
spread only, and a target is judged on the whole interval."""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from kvlab.experiments.load_test import REMOTE_KILL
from kvlab.plotting.common import as_records, plural
from kvlab.plotting.story.claims import (Prose, Takeaways, against_target, amount, interval, medians_only, number,
                                         paragraphs, prose, quantity, quoted, span, takeaways, versus)
from kvlab.harness.spread import MEDIAN_ONLY, Estimate, bootstrapped, median_only, ratio, spread, summary_ratio

PER_RUN = "object per run"  # kvlab.experiments.network's strategy that stores a chunk as it lies
MEMORY_BOUND_TARGET = 1.5  # a hit from memory: overhead at most this multiple of the STREAM copy
# Each tier's hit the same way (shm is memory, and a file in the page cache nearly so)
HIT_BOUND_TARGETS = {"memory": MEMORY_BOUND_TARGET, "shm": 2.0, "disk": 2.5}
LOOKUP_TARGET_MS = 1.0
REDIS_PACE_TARGET = 1.2
CONCURRENT_TARGET = 0.95  # KVLab's throughput against vLLM's prefix cache at 16 concurrent requests
KILLED = {"redis": "the Redis server", "mooncake": "the Mooncake master"}  # what a load test's remote-kill SIGKILLs


def pace_ratio(row: dict, phase: str) -> Estimate | None:
    """A strategy's time over the store's own pace for the same bytes (``phase``: "store"
    or "fetch"), bootstrapped from the samples when the row kept them; None without a pace."""
    if not number(row.get(f"ceiling_{phase}_s")):
        return None
    mine, pace = row.get(f"{phase}_samples_s"), row.get(f"ceiling_{phase}_samples_s")
    if mine and pace:
        return ratio(mine, pace)
    value = row[f"{phase}_s"] / row[f"ceiling_{phase}_s"]
    return median_only(value)


def _median_difference(a: list[float], b: list[float]) -> float:
    return statistics.median(a) - statistics.median(b)


def time_difference(a: dict, b: dict, phase: str) -> Estimate:
    """a's ``phase`` time minus b's, in ms, bootstrapped where both kept their samples."""
    x, y = a.get(f"{phase}_samples_s"), b.get(f"{phase}_samples_s")
    if x and y:
        return bootstrapped(_median_difference, x, y).scaled(1e3)
    value = 1e3 * (a[f"{phase}_s"] - b[f"{phase}_s"])
    return median_only(value)


def strategies_reading(rows: Any, store: str) -> Prose:
    """Per layout and strategy through one store: objects per chunk and each phase against
    the store's own pace; then a per-layer chunk stored as it lies against a cross-layer one."""
    rows = [r for r in as_records(rows) if r.get("store", "redis") == store or store == "any"]
    if not rows:
        return prose(None)
    def paced(r: dict, phase: str) -> str:
        share = pace_ratio(r, phase)
        if share is None:
            return " (no pace measured beside it)"
        told = "" if share.how == MEDIAN_ONLY else f" ({interval(share, '×', 2)})"
        return f", {amount(share.value, '×', 2)} the store's pace{told}"

    note = medians_only(*(pace_ratio(r, phase) for r in rows for phase in ("store", "fetch")))
    lines = [f"- {r['layout']}, {r['strategy']}: {r['objects_per_chunk']:,.3g} objects a chunk; store "
             f"{amount(1e3 * r['store_s'])}{paced(r, 'store')}, fetch {amount(1e3 * r['fetch_s'])}{paced(r, 'fetch')}"
             for r in rows]
    compared = as_lies_point(rows)
    if compared is not None:
        compared = prose(compared, "Every strategy gave back every byte." if all(r["identical"] for r in rows) else
                         "Not every strategy gave back every byte: "
                         + ", ".join(f"{r['layout']} {r['strategy']}" for r in rows if not r["identical"]) + ".")
    head = prose(f"A {rows[0]['tokens']:,}-token prefix in {rows[0]['chunks']} chunks {quoted(rows)}; the pace is the "
                 "store moving the same bytes as one ready object per chunk:")
    return paragraphs(head, Prose("\n".join(lines)), compared, note)


def as_lies_point(rows: Any, store: str | None = None) -> str | None:
    """A per-layer chunk stored as it lies (an object per run) against a cross-layer one, in
    one store (``store`` names it in the sentence), storing and fetching; None without both."""
    as_lies = {r["layout"]: r for r in as_records(rows) if r["strategy"] == PER_RUN}
    per = next((r for r in as_lies.values() if not r["cross_layer"]), None)
    cross = next((r for r in as_lies.values() if r["cross_layer"]), None)
    if per is None or cross is None:
        return None
    return (f"Stored as it lies{f' in {store}' if store else ''}, a per-layer ({per['layout']}) chunk is "
            f"{per['objects_per_chunk']:,.0f} objects and a cross-layer ({cross['layout']}) one "
            f"{cross['objects_per_chunk']:,.0f}: storing, "
            f"{versus(time_difference(per, cross, 'store'), 'per-layer', 'cross-layer')}; fetching, "
            f"{versus(time_difference(per, cross, 'fetch'), 'per-layer', 'cross-layer')}"
            + (f" {quoted([per, cross])}." if store else "."))


def lease_reading(default_ms: int, peers_ms: int) -> Prose:
    """The Mooncake object lease the peers ran under, and why (settings, not measurements)."""
    return prose(f"kvlab's Mooncake master leases an object for {default_ms:,} ms after each put or get; an LMCache "
                 "chunk read over TCP on two busy cores outlived that lease (`LEASE_EXPIRED`), so the peers' runs "
                 f"lease for {peers_ms:,} ms. kvlab's tier reads a lease-expired chunk as a fault: a miss, recomputed.")


def scale_reading(fits: Sequence[Any], checked: Any, scale: Any, model: str, measured: Any) -> Prose:
    """The per-object and per-byte fit of each store, how well it predicts this host's own
    prefixes, and what it predicts for the largest deployment of ``scale`` for ``model``
    (``measured``: the rows the fit was made from, for whose run they are)."""
    checked = as_records(checked)
    scale = [r for r in as_records(scale) if r["model"] == model and r["direction"] == "get"]
    if not fits or not scale:
        return prose(None)
    stores = dict.fromkeys(f.method for f in fits)
    fitted = "; ".join(f"{store}: {span((1e6 * f.per_segment_s for f in fits if f.method == store), ' µs', 0)} per "
                       f"object and {span((f.bandwidth / 1e9 for f in fits if f.method == store), ' GB/s', 1)}"
                       for store in stores)
    errors = [r["error"] for r in checked]
    bias = (", biased low: the prefixes also read the block table and the cache's scattered runs, which ready objects "
            "do not" if errors and max(errors) < 0 else ", biased high" if errors and min(errors) > 0 else "")
    check = (f"Against this host's own prefixes the fit is within {span((100 * abs(e) for e in errors), '%')}"
             f"{bias}." if errors else None)
    most = max(r["hosts"] for r in scale)
    lines = []
    for store in dict.fromkeys(r["store"] for r in scale):
        at = {(r["layout"], r["way"], r["hosts"]): r for r in scale if r["store"] == store}
        one, many = at.get(("LBHNC", PER_RUN, 1)), at.get(("LBHNC", PER_RUN, most))
        cross = at.get(("BLHNC", PER_RUN, most))
        chunk = at.get(("LBHNC", "object per chunk", most))
        if one is None or many is None or cross is None:
            continue
        bound = "the store's per-object work" if many["server_bound_s"] > many["host_bound_s"] else "each host's bytes"
        lines.append(f"- {store} ({many['servers']} server{'s' if many['servers'] > 1 else ''}): per-layer runs "
                     f"{many['objects_per_prefix']:,} objects a prefix, {amount(many['predicted_s'], 's', 2)} for "
                     f"{many['prefixes']} prefixes a host at {most} hosts ({many['predicted_s'] / one['predicted_s']:,.0f}× "
                     f"one host; bound by {bound}), cross-layer runs {amount(cross['predicted_s'], 's', 2)}"
                     + (f", one object a chunk {amount(chunk['predicted_s'], 's', 2)}" if chunk else "") + ".")
    return paragraphs(prose(f"The fit from ready objects {quoted(measured)}: {fitted}.", check),
                      Prose(f"Predicted for {model.split('/')[-1]}, fetching:\n" + "\n".join(lines)) if lines else None)


def profile_reading(profile: Any) -> Prose:
    """Where one hit's milliseconds go, per tier and copy method: the copy against the STREAM
    copy of the same bytes, and everything the connector does besides (rows of
    hit_costs.overhead_profile; a file tier's copy is its read straight into the cache)."""
    rows = as_records(profile)
    out = []
    for tiers, method in dict.fromkeys((r.get("tiers", "memory"), r["method"]) for r in rows):
        mine = [r for r in rows if r.get("tiers", "memory") == tiers and r["method"] == method]
        calls = {r["call"]: r["ms"] for r in mine}
        if not {"copy", "total", "STREAM copy of the loaded bytes", "total without the copy"} <= set(calls):
            continue
        samples = {r["call"]: r.get("samples_ms") for r in mine}
        copy, stream = samples.get("copy"), samples.get("STREAM copy of the loaded bytes")
        share = (ratio(copy, stream) if copy and stream else
                 median_only(calls["copy"] / calls["STREAM copy of the loaded bytes"]))
        out.append(f"- from {tiers}, `{method}`: the copy {amount(calls['copy'], 'ms', 2)}, {quantity(share, '×', 2)} "
                   f"the STREAM copy of the same bytes ({amount(calls['STREAM copy of the loaded bytes'], 'ms', 2)}); "
                   f"every other call together {amount(calls['total without the copy'], 'ms', 2)}, of "
                   f"{amount(calls['total'], 'ms', 2)} in all.")
    if not out:
        return prose(None)
    first = rows[0]
    return paragraphs(prose(f"A whole-step hit of {first['tokens']:,} tokens ({first['kv_bytes'] / 1e6:,.1f} MB), "
                            f"every connector call timed {quoted(rows)}:"),
                      Prose("\n".join(out)))


def lengths_reading(lengths: Any) -> Prose:
    """A hit's overhead over the engine's own floor against prompt length, per path, as a
    multiple of the STREAM copy of its bytes; the memory tier judged against its target."""
    rows = [r for r in as_records(lengths) if number(r.get("overhead_s"))]
    if not rows:
        return prose(None)
    lines = []
    for path in dict.fromkeys(r["path"] for r in rows):
        mine = [r for r in rows if r["path"] == path]
        lines.append(f"- {path}: " + ", ".join(
            f"{r['prompt_tokens']:,} tokens {amount(1e3 * r['overhead_s'])} "
            + (f"({overhead_fault(r)})" if overhead_fault(r) else f"({r['bound_ratio']:.2f}× the STREAM copy)")
            for r in mine))
    negative = [r for r in rows if overhead_fault(r)]
    fault = (f"{len(negative)} of these {len(rows)} overheads are negative, which cannot be right: a hit does the "
             "engine's own prefix hit's work and more. This run's spread between samples is larger than what it "
             "measures, so it measures neither those paths nor their targets; measure again on a quieter or "
             "faster machine.") if negative else None
    judged = memory_bound_point(rows)
    note = medians_only(*(None if r.get("overhead_samples_s") else median_only(r["overhead_s"]) for r in rows))
    skipped = [f"{r['path']} at {r['prompt_tokens']:,} tokens: {r['skipped']}" for r in as_records(lengths)
               if r.get("skipped")]
    return paragraphs(prose(f"The time to first token over each engine's own prefix hit {quoted(rows)}:"),
                      Prose("\n".join(lines)),
                      prose(fault, judged,
                            ("Not run: " + "; ".join(skipped) + ".") if skipped else None, note))


def overhead_fault(row: dict) -> str | None:
    """What is wrong with a hit's overhead over the engine's own prefix hit that cannot be
    right (a negative one: the hit does that work and more), or None: such a row is a fault
    of its run, never judged against a target."""
    return "a negative overhead, which cannot be right" if row["overhead_s"] < 0 else None


def memory_bound_point(lengths: Any) -> str | None:
    """A hit from memory of 2,000 tokens or more, its overhead over the engine's own floor as a
    multiple of the STREAM copy of its bytes, judged against its target; None without one."""
    judged, used = [], []
    for r in as_records(lengths):
        if r.get("path") == "KVLab, memory" and r["prompt_tokens"] >= 2000 and number(r.get("overhead_s")) \
                and not overhead_fault(r):
            overheads, streams = r.get("overhead_samples_s"), r.get("stream_samples_s")
            bound = ratio(overheads, streams) if overheads and streams else median_only(r["bound_ratio"])
            judged.append(f"at {r['prompt_tokens']:,} tokens, {against_target(bound, MEMORY_BOUND_TARGET, unit='×')}")
            used.append(r)
    return ("A hit from memory, its overhead as a multiple of the STREAM copy of its bytes: "
            + "; ".join(judged) + f" {quoted(used)}.") if judged else None


def lookups_reading(lookups: Any) -> Prose:
    """A lookup's time against the chunks a tier holds, judged against its target."""
    rows = as_records(lookups)
    if not rows:
        return prose(None)
    lines = []
    for tier in dict.fromkeys(r["tier"] for r in rows):
        mine = sorted((r for r in rows if r["tier"] == tier), key=lambda r: r["stored_chunks"])
        most = mine[-1]
        lookup = spread(most["lookup_samples_ms"]) if most.get("lookup_samples_ms") else median_only(most["lookup_ms"])
        lines.append(f"- {tier}: " + ", ".join(f"{amount(r['lookup_ms'], 'ms', 2)} with {r['stored_chunks']:,} chunks"
                                               for r in mine)
                     + f" (start-up {amount(most['startup_ms'], 'ms', 1)}); with {most['stored_chunks']:,} stored, "
                     + against_target(lookup, LOOKUP_TARGET_MS, unit="ms"))
    return paragraphs(prose(f"A repeated lookup of a {rows[0]['prompt_tokens']:,}-token prompt {quoted(rows)}:"),
                      Prose("\n".join(lines)))


def pace_reading(pace: dict) -> Prose:
    """A worker's Redis fetch against the server's own pace for the same ready values."""
    mine, theirs = pace.get("worker_fetch_samples_s"), pace.get("server_get_samples_s")
    share = ratio(mine, theirs) if mine and theirs else median_only(pace["ratio"])
    return prose(f"Fetching {pace['kv_bytes'] / 1e6:,.1f} MB in {pace['chunks']} chunks, the worker took "
                 f"{amount(1e3 * pace['worker_fetch_s'])} against {amount(1e3 * pace['server_get_s'])} for the "
                 f"server's own GETs into memory: {against_target(share, REDIS_PACE_TARGET, unit='×')}; redis-py's "
                 f"own GET took {amount(1e3 * pace['redis_py_get_s'])} {quoted([pace])}.")


def throughput(row: dict) -> Estimate:
    samples = row.get("throughput_samples_rps")
    if samples:
        return spread(samples)
    return median_only(row["throughput_rps"])


def concurrency_reading(concurrency: Any, level: int = 16) -> Prose:
    """Throughput per server at each level, KVLab's against vLLM's own prefix cache at
    ``level`` (a bootstrap of the ratio of their medians), and the threads each computed on."""
    rows = as_records(concurrency)
    if not rows:
        return prose(None)
    lines = []
    for server in dict.fromkeys(r["server"] for r in rows):
        mine = sorted((r for r in rows if r["server"] == server), key=lambda r: r["concurrency"])
        threads = mine[0].get("compute_threads")
        computed = f" ({plural(threads, 'compute thread')})" if threads else ""
        lines.append(f"- {server}{computed}: " + ", ".join(f"{r['concurrency']} at a time {quantity(throughput(r), 'req/s', 1)}" for r in mine))
    return paragraphs(prose(f"Requests per second through `vllm serve` {quoted(rows)}:"), Prose("\n".join(lines)),
                      prose(concurrency_point(rows, level), medians_only(*(throughput(r) for r in rows))))


def concurrency_point(concurrency: Any, level: int = 16) -> str | None:
    """KVLab's throughput against vLLM's own prefix cache at ``level`` concurrent requests,
    judged against its target; None without both."""
    at = {r["server"]: r for r in as_records(concurrency) if r["concurrency"] == level}
    if "KVLabConnector" not in at or "vLLM prefix cache" not in at:
        return None
    ours, theirs = at["KVLabConnector"], at["vLLM prefix cache"]
    a, b = ours.get("throughput_samples_rps"), theirs.get("throughput_samples_rps")
    share = ratio(a, b) if a and b else summary_ratio(throughput(ours), throughput(theirs))
    judged = (f"At {level} concurrent requests, KVLabConnector's throughput over vLLM's own prefix cache: "
              f"{against_target(share, CONCURRENT_TARGET, at_most=False, unit='×')} {quoted([ours, theirs])}.")
    if ours.get("compute_threads") and ours.get("compute_threads") != theirs.get("compute_threads"):
        judged += (" The two servers computed on different thread counts, so this ratio measures the threads, "
                   "not the connector.")
    elif not ours.get("compute_threads"):  # a run from before the sweep pinned and recorded its threads
        judged += (" This run did not record the cores each server computed on: with a connector configured, vLLM's "
                   "CPU worker reserves no core on a machine this small and computes on every one, vLLM's own "
                   "prefix cache on one fewer, so the ratio may measure the cores, not the connector.")
    return judged


def deployment_takeaways(lengths: Any, lookups: Any = None, concurrency: Any = None) -> Takeaways:
    """Notebook 05's takeaways: a hit from memory against the STREAM copy of its bytes, a
    lookup against the chunks a tier holds, and throughput under concurrent requests
    against vLLM's own prefix cache, each judged on its interval."""
    rows = as_records(lookups)
    most = max(rows, key=lambda r: r["stored_chunks"]) if rows else None
    lookup = None
    if most is not None:
        estimate = spread(most["lookup_samples_ms"]) if most.get("lookup_samples_ms") else median_only(most["lookup_ms"])
        lookup = (f"A repeated lookup of a {most['prompt_tokens']:,}-token prompt in a {most['tier']} tier holding "
                  f"{most['stored_chunks']:,} chunks: {against_target(estimate, LOOKUP_TARGET_MS, unit='ms')} "
                  f"{quoted([most])}.")
    return takeaways(memory_bound_point(lengths), lookup, concurrency_point(as_records(concurrency)))


def serve_reading(serve: Any) -> Prose:
    """LMCache #2498's `vllm serve` command run as written: what a prompt found cached the
    first time, repeated (vLLM's own prefix cache), and repeated after its reset (the connector)."""
    rows = as_records(serve)
    if not rows:
        return prose(None)
    r = rows[0]
    return prose(f"{r['processes']} processes, ready in {amount(r['startup_s'], 's', 0)}; a "
                 f"{r['prompt_tokens']:,}-token prompt found {r['cold_cached']:,} tokens cached the first time, "
                 f"{r['vllm_repeat_cached']:,} repeated (vLLM's own prefix cache) and "
                 f"{r['connector_repeat_cached']:,} repeated after `/reset_prefix_cache` (the connector), "
                 f"{'with' if r['same_text'] else 'but not with'} the same text {quoted(rows)}.")


def load_test_reading(runs: Any) -> Prose:
    """``kvlab loadtest``: every run of it given (the connector under faults, in its mode, on
    the layout it registered, with a remote tier's server killed half-way or not, and vLLM's
    own prefix cache under the same load as the baseline), what failed, what differed from its
    same-split control, what the connector counted, and around a kill what was hit before it
    and after it and how long the longest request took."""
    said = []
    for r in as_records(runs):
        counted = r.get("kvlab") or {}
        files = {kind: count for kind, count in (r.get("faults") or {}).items() if kind != REMOTE_KILL}
        injected = (f", a fault injected into the files every {amount(r['fault_interval_s'], 's', 0)} "
                    f"({sum(files.values()):,}: " + ", ".join(f"{kind} {count:,}" for kind, count in files.items())
                    + ")" if counted else ", no connector and no faults (the baseline)")
        setup = ""
        if counted:
            layout = f" on a {r['layout']} cache" if r.get("layout") else ""
            asked = " (cross-layer asked for)" if r.get("cross_layer") else ""
            remote = (f", tiers memory, shared memory, disk and {r['remote']}, {KILLED[r['remote']]} SIGKILLed "
                      f"once half the requests were answered" if r.get("remote") else "")
            setup = f", KVLabConnector in {r.get('mode', 'whole-step')} mode{layout}{asked}{remote}"
        connector = (f" The connector counted {counted['load_errors']:,.0f} failed loads (recomputed), "
                     f"{counted['fallback_loads']:,.0f} loads from a further tier, {counted['cancelled_saves']:,.0f} "
                     f"saves cancelled and {counted['preemptions']:,.0f} preemptions." if counted else "")
        timing = (f" The longest request took {amount(r['longest_request_s'], 's')}, the run "
                  f"{amount(r['wall_s'], 's', 0)}." if "longest_request_s" in r else "")
        said.append(f"{r['requests_sent']:,} requests from {r['clients']} clients with a {r['num_gpu_blocks']}-block "
                    f"KV cache{setup}{injected}: {r['failed']:,} failed, {r['differing_tokens']:,} with tokens other "
                    f"than their same-split control's, {r['within_drift']:,} within its drift (the largest logprob gap "
                    f"{r['max_gap']:.2g}), {r['identical']:,} bitwise, {r['hits']:,} prefix hits {quoted([r])}."
                    f"{connector}{kill_reading(r)}{timing}")
    return Prose("\n\n".join(said)) if said else prose(None)


def kill_reading(run: dict) -> str:
    """A load test's requests answered before its remote tier's server was killed and those
    sent after it: their hits, cached tokens and longest wait ("" for a run with no kill)."""
    before, after = run.get("before_kill"), run.get("after_kill")
    if not (before and after):
        return ""
    across = run["requests_sent"] - before["requests_sent"] - after["requests_sent"]
    return (f" Before the kill ({amount(run['killed_at_s'], 's', 0)} in) {before['requests_sent']:,} requests were "
            f"answered, {before['hits']:,} of them hits ({before['cached_tokens']:,} tokens cached), the longest in "
            f"{amount(before['longest_request_s'], 's')}; after it {after['requests_sent']:,} were sent, "
            f"{after['hits']:,} hits ({after['cached_tokens']:,} tokens), the longest in "
            f"{amount(after['longest_request_s'], 's')}; {plural(across, 'request')} in flight across it.")
