"""The connector's performance targets in one table, each judged on the whole interval of
what its run measured (kvlab.plotting.story.claims.against_target): met or missed only
where the interval lies on one side of the target, and a median whose samples were not
kept decides nothing. The targets are the experiments' and readings' own constants."""

from __future__ import annotations

from typing import Any

from kvlab.experiments.deployed import DECODE_TARGET, SAVE_TARGET_MS, SAVE_REFERENCE_BYTES
from kvlab.plotting.common import as_records
from kvlab.plotting.story.claims import Prose, against_target, prose, source
from kvlab.plotting.story.connector import KVLAB_OVER_EXAMPLE_TARGET
from kvlab.plotting.story.serving import (CONCURRENT_TARGET, HIT_BOUND_TARGETS, LOOKUP_TARGET_MS, REDIS_PACE_TARGET,
                                          overhead_fault, throughput)
from kvlab.plotting.story.tables import markdown_table
from kvlab.harness.spread import Estimate, median_only, ratio, spread, summary_ratio

HIT_TOKENS = 2000  # the hit targets hold from prompts this long


def hit_bound(row: dict) -> Estimate:
    """A hit's overhead over its engine's own prefix hit as a multiple of the STREAM copy of
    its bytes: the min-max of its paired samples where the row kept them."""
    samples = row.get("overhead_samples_s")
    if not samples:
        return median_only(row["bound_ratio"])
    paired = spread(samples)
    return Estimate(paired.value / row["stream_s"], paired.low / row["stream_s"], paired.high / row["stream_s"],
                    paired.samples)


def concurrent_share(rows: list[dict], level: int) -> Estimate | None:
    """KVLabConnector's throughput over vLLM's own prefix cache at ``level`` concurrent
    requests: a bootstrap of their medians' ratio where both kept samples."""
    at = {r["server"]: r for r in rows if r["concurrency"] == level}
    ours, theirs = at.get("KVLabConnector"), at.get("vLLM prefix cache")
    if ours is None or theirs is None:
        return None
    a, b = ours.get("throughput_samples_rps"), theirs.get("throughput_samples_rps")
    return ratio(a, b) if a and b else summary_ratio(throughput(ours), throughput(theirs))


def _serving_targets(serving: list[dict]) -> list[tuple[str, str, list[dict]]]:
    by = {r["engine"]: r for r in serving}
    kvlab, example = by.get("KVLabConnector"), by.get("ExampleConnector")
    plain, decoding = by.get("decode, no connector"), by.get("decode, KVLabConnector")
    judged = []
    if kvlab and example and example["overhead_s"] > 0:
        judged.append(("In vLLM's own processes, KVLab's overhead over its engine's prefix hit, as a share of "
                       "ExampleConnector's",
                       against_target(median_only(kvlab["overhead_s"] / example["overhead_s"]),
                                      KVLAB_OVER_EXAMPLE_TARGET), [kvlab, example]))
    if kvlab:
        judged.append((f"The model runner blocked in save calls, per {SAVE_REFERENCE_BYTES / 2**20:,.1f} MiB stored",
                       against_target(median_only(1e3 * kvlab["save_s_per_reference"]), SAVE_TARGET_MS, unit="ms"),
                       [kvlab]))
    if plain and decoding:
        judged.append(("Decode throughput with the connector saving, over without",
                       against_target(median_only(decoding["tokens_per_s"] / plain["tokens_per_s"]), DECODE_TARGET,
                                      at_most=False), [plain, decoding]))
    return judged


def targets_table(lengths: Any, lookups: Any, pace: Any, concurrency: Any, serving: Any, level: int = 16) -> Prose:
    """One row per target: what it asks, what its run measured against it, whose run.
    (Rows of 03_costs_by_length, 03_lookup_scaling, 03_redis_pace, 03_concurrency, 03_serving.)"""
    judged: list[tuple[str, str, list[dict]]] = []
    for r in as_records(lengths):
        tier = str(r.get("path", "")).removeprefix("KVLab, ")
        if tier in HIT_BOUND_TARGETS and r.get("prompt_tokens", 0) >= HIT_TOKENS and r.get("overhead_s") is not None:
            where = f"{tier}, in the page cache" if tier == "disk" else tier
            judged.append((f"{r['prompt_tokens']:,}-token hit from {where}, over the engine's own prefix hit, "
                           "as a multiple of the STREAM copy of its bytes",
                           f"not judged: {overhead_fault(r)}" if overhead_fault(r)
                           else against_target(hit_bound(r), HIT_BOUND_TARGETS[tier]), [r]))
    lookups = as_records(lookups)
    for tier in dict.fromkeys(r["tier"] for r in lookups):
        most = max((r for r in lookups if r["tier"] == tier), key=lambda r: r["stored_chunks"])
        judged.append((f"A lookup of a {most['prompt_tokens']:,}-token prompt, {most['stored_chunks']:,} chunks "
                       f"in the {tier} tier",
                       against_target(median_only(most["lookup_ms"]), LOOKUP_TARGET_MS, unit="ms"), [most]))
    for r in as_records(pace):
        judged.append((f"A worker's Redis fetch of {r['kv_bytes'] / 1e6:,.1f} MB over the server's own pace",
                       against_target(median_only(r["ratio"]), REDIS_PACE_TARGET), [r]))
    share = concurrent_share(as_records(concurrency), level)
    if share is not None:
        judged.append((f"`vllm serve` throughput at {level} concurrent requests over vLLM's own prefix cache",
                       against_target(share, CONCURRENT_TARGET, at_most=False),
                       [r for r in as_records(concurrency) if r["concurrency"] == level]))
    judged += _serving_targets(as_records(serving))
    if not judged:
        return prose(None)
    return Prose(markdown_table(["target", "this run against it", "run"],
                                [[what, verdict, source(rows)] for what, verdict, rows in judged]))

