"""Takeaways read their numbers from the rows they are given, and say so when rows are missing."""

import pandas as pd
import pytest

from kvlab.cache import preset, sweep
from kvlab.plotting import story
from kvlab.plotting.story import (
    Takeaways,
    accuracy_takeaways,
    connector_takeaways,
    extension_takeaways,
    layout_takeaways,
    takeaways,
    transfer_takeaways,
)


def test_points_are_markdown_bullets_and_missing_ones_are_left_out():
    shown = takeaways("one", None, "two")
    assert shown.points == ("one", "two")
    assert shown._repr_markdown_() == "- one\n- two" == str(shown)
    with pytest.raises(ValueError, match="no takeaways"):
        takeaways(None)


def test_layout_takeaways_count_the_copies_of_each_block_size():
    rows = sweep(["LBHNC", "LHBNC", "BLHNC"], preset("llama-3.1-8b"), [256], [16, 64])
    first, second = layout_takeaways(rows).points
    # Llama-3.1-8B, 16 blocks: LBHNC one copy per block and layer (512), LHBNC per head too (4096)
    assert "256 tokens (32 MiB, block size 16)" in first and "512–4,096 copies" in first
    assert "cross-layer ones 16: 32× fewer" in first and "2 MiB or more each instead of at most 64 KiB" in first
    assert "block size 64" in second and "128–1,024 copies" in second and "ones 4:" in second


def _bench_row(layout, method, direction, ratio, segments, cross_layer, **extra):
    return {"status": "ok", "model": "org/Model", "tokens": 1024, "block_ids": "scattered", "target": "host",
            "hardware": "cpu: Test (2 cores)", "layout": layout, "method": method, "direction": direction,
            "ratio": ratio, "ratio_q1": ratio and ratio - 0.02, "ratio_q3": ratio and ratio + 0.02, "repeats": 9,
            "segments": segments, "cross_layer": cross_layer, "run_id": "r", **extra}


def test_transfer_takeaways_take_the_worse_direction_of_the_best_method():
    rows = [_bench_row("LBHNC", "gather", "offload", 0.8, 2048, False),
            _bench_row("LBHNC", "gather", "load", 0.6, 2048, False),
            _bench_row("LBHNC", "segments", "offload", 0.7, 2048, False),
            _bench_row("LBHNC", "segments", "load", 0.65, 2048, False),
            _bench_row("BLHNC", "gather", "offload", 0.9, 64, True),
            _bench_row("BLHNC", "gather", "load", 0.95, 64, True),
            _bench_row("BLHNC", "gather", "load", 0.1, 64, True, tokens=256),  # another token count
            _bench_row("BLHNC", "triton", "load", None, 64, True, status="unavailable: no GPU")]
    layerwise = [{"model": "org/Model", "tokens": 256, "intensity": i, "speedup": s} for i, s in
                 ((0.5, 0.7), (2, 1.2), (4, 1.5))]
    ratios, gains, copies, overlap = transfer_takeaways(pd.DataFrame(rows), "org/Model", 1024, layerwise).points
    assert "best cross-layer transfer (BLHNC, gather) reaches 0.90 (quartiles 0.88–0.92 over 9 repeats)" in ratios
    assert "the cross-layer one is the faster beyond the spread" in ratios
    assert "per copy method: `gather` 1.50× (above 1: cross-layer faster)" in gains  # segments: no cross-layer row
    assert "best per-layer one (LBHNC, segments) 0.65" in ratios and "cpu: Test (2 cores)" in ratios
    assert copies == "The same bytes take per-layer layouts 2,048 copies and cross-layer ones 64."
    assert "at best 1.50× (Model, 256 tokens, compute intensity 4)" in overlap
    assert "kept no interval, so this run cannot say where it beat loading first" in overlap


def test_transfer_takeaways_without_rows_of_the_headline_is_a_clear_error():
    with pytest.raises(ValueError, match="no takeaways"):
        transfer_takeaways([_bench_row("LBHNC", "gather", "load", 0.6, 2048, False)], "org/Other", 1024)


def _ttft_rows(warm_ms: list[float], floor_ms: list[float], example_ms: list[float], plain_ms: list[float]) -> list:
    """Rows as ttft_scenarios writes them, samples kept, through with_overheads."""
    from kvlab.experiments.ttft import with_overheads

    def row(scenario, phase, samples, floor=None, connector="kvlab"):
        seconds = [x / 1e3 for x in samples]
        out = {"scenario": scenario, "phase": phase, "samples": len(seconds), "samples_s": seconds,
               "median_s": sorted(seconds)[len(seconds) // 2], "min_s": min(seconds), "max_s": max(seconds),
               "cached_tokens": 1984, "prompt_tokens": 2000, "identical": 4, "prompts": 5, "model": "smollm2",
               "connector": connector, "hardware": "cpu: Test (2 cores)", "profile": "paper", "run_date": "2026-12-07"}
        if floor is not None:
            secs = [x / 1e3 for x in floor]
            out.update(engine_floor_s=sorted(secs)[len(secs) // 2], engine_floor_samples_s=secs)
        return out

    plain = [x for x in plain_ms]
    return with_overheads([row("recompute", "cold", [4000.0, 4010, 3990], plain, "none"),
                           row("vLLM prefix hit", "floor", plain, plain, "none"),
                           row("KVLab whole-step, memory", "warm", warm_ms, floor_ms),
                           row("ExampleConnector", "warm", example_ms, floor_ms, "example")])


def test_connector_takeaways_claim_a_difference_only_beyond_its_interval():
    apart = _ttft_rows([90, 91, 92, 90.5, 91.5], [80, 80.5, 81, 79.5, 80.2], [100, 101, 99, 100.5, 99.5],
                       [80, 81, 79, 80.5, 80.2])
    first, versus = connector_takeaways(pd.DataFrame(apart)).points[:2]
    assert "**KVLab whole-step, memory** answers in 91.0 ms" in first and "(run: cpu: Test (2 cores), paper" in first
    assert "10.8 ms (95% bootstrap interval 9.5–12.0 ms, 5 samples a side)" in first
    assert "44× faster than recompute's 4,000 ms" in first
    assert versus.endswith("KVLab takes 9.0 ms less than ExampleConnector (95% bootstrap interval 7.5–10.7 ms, "
                           "5 samples a side).")
    close = _ttft_rows([90, 95, 85, 92, 88], [80, 85, 75, 82, 78], [91, 96, 86, 93, 89], [80, 81, 79, 80.5, 80.2])
    versus = connector_takeaways(close).points[1]
    assert versus.startswith("Against vLLM's ExampleConnector, each over its own floor: this run cannot tell KVLab "
                             "from ExampleConnector: KVLab takes 1.0 ms less, within the spread")
    one = _ttft_rows([90], [80], [100], [80])  # one sample a side: nothing is claimed
    assert "fewer than 3 samples a side" in connector_takeaways(one).points[1]


def test_a_floor_beyond_the_plain_engines_is_flagged_not_read_as_a_finding():
    slow = _ttft_rows([120, 121, 122, 120.5, 121.5], [78, 79, 78.5, 79.5, 78.2], [100, 101, 99, 100.5, 99.5],
                      [36, 37, 36.5, 37.5, 36.2])
    flags = story.floor_flags(slow)
    assert len(flags) == 1 and "**KVLab whole-step, memory**" in flags[0] and "a fault to find" in flags[0]
    assert {r["scenario"]: r["floor_differs"] for r in slow}["KVLab whole-step, memory"]
    assert not story.floor_flags(_ttft_rows([90, 91, 92], [80, 81, 79], [100, 101, 99], [80, 81, 79]))
    assert "a fault to find" in story.ttft_reading(slow).markdown()


def test_rows_without_samples_are_shown_never_compared():
    legacy = [{k: v for k, v in r.items() if k not in ("samples_s", "engine_floor_samples_s")}
              for r in _ttft_rows([90, 91, 92], [80, 81, 79], [100, 101, 99], [80, 81, 79])]
    from kvlab.experiments.ttft import with_overheads

    text = story.ttft_reading(with_overheads(legacy)).markdown()
    assert "but the samples were not kept to compare" in text and "no difference is claimed" in text


def test_accuracy_takeaways():
    roundtrips = [{"model": "m", "round_trips": 24, "bit_exact": 24, "checksums_equal": 24},
                  {"model": "m", "round_trips": 0, "bit_exact": 0, "checksums_equal": 0}]  # unavailable method
    generations = [{"path": p, "identical": 30, "prompts": 30, "max_logprob_diff_vs_control": d, "run_id": "a"}
                   for p, d in (("recompute", 0.0), ("vLLM prefix-cache hit", 0.0), ("KVLab whole-step", 0.0),
                                ("LMCache", 2.3e-5))]
    task = [{"path": p, "filter": f, "accuracy": a, "stderr": 0.035, "run_id": "a"} for p, f, a in
            (("recompute", "strict-match", 0.0), ("KVLab whole-step", "strict-match", 0.0),
             ("recompute", "exact-match", 0.565), ("KVLab whole-step", "exact-match", 0.565))]
    damaged = [{"path": "KVLab whole-step", "damage": d, "filter": "exact-match", "changed_generations": n,
                "prompts": 200} for d, n in (("zeroed", 200), ("block-order", 0))]
    exact, identical, score, damage = accuracy_takeaways(pd.DataFrame(roundtrips), generations, task, damaged).points
    assert exact.startswith("24 of 24 KV round trips (1 layout × method pairs of 1 models)")
    assert identical.endswith("KVLab whole-step 30/30 (bitwise), LMCache 30/30 (2.3e-05); "
                              "vLLM's own prefix hit, the control, 30/30 (run: this machine, unrecorded profile).")
    assert score == "On the task (exact-match) recompute scores 0.565 ± 0.035, the 1 reuse paths 0.565."
    assert damage.endswith("every layer zeroed, 200 of 200; the prefix's blocks in another order, 0 of 200.")


def test_extension_takeaways_look_at_the_new_layout_and_method_only():
    checks = [{"layout": "LBHNC", "method": "gather", "exact": False},  # not the new ones: left out
              {"layout": "BNLHC", "method": "gather", "exact": True},
              {"layout": "LBHNC", "method": "index_put", "exact": True}]
    costs = [{"layout": layout, "tokens": tokens, "segments": n} for tokens, layout, n in
             ((256, "BLHNC", 16), (250, "BLHNC", 271), (250, "BNLHC", 16))]
    exact, copies = extension_takeaways(checks, costs, layout="BNLHC", method="index_put").points
    assert exact.startswith("2 of 2 round trips")
    assert copies == "Moving 250 tokens: BLHNC 271 copies, BNLHC 16 copies."
    assert isinstance(extension_takeaways([], costs, "BNLHC", "index_put"), Takeaways)


def test_the_new_notebooks_takeaways_read_their_committed_rows():
    """Notebook 04's: a chunk's copies per layout in the engine and its objects in each store;
    notebook 05's: each cost judged against its target. Each names the run it quotes."""
    from kvlab.results import committed_results_dir, results_for

    committed = committed_results_dir()
    cross = story.cross_layer_takeaways(*(results_for(stem, committed) for stem in
                                          ("03_engine_layouts", "03_network", "03_beyond")))
    assert len(cross.points) == 4 and "240 copies per-layer and 8 cross-layer" in cross.points[0]
    assert [p.split(",")[0] for p in cross.points[1:]] == [
        "Stored as it lies in Redis", "Stored as it lies in Mooncake Store", "Stored as it lies in a Redis Cluster"]
    deployed = story.deployment_takeaways(*(results_for(stem, committed) for stem in
                                            ("03_costs_by_length", "03_lookup_scaling", "03_concurrency")))
    assert len(deployed.points) == 3 and all("target" in point for point in deployed.points)
    with pytest.raises(ValueError, match="no takeaways"):
        story.cross_layer_takeaways([], [], [])


def test_a_headline_outside_a_notebook_shows_nothing_and_passes_its_takeaways_on():
    points = story.takeaways("one point")
    assert story.Headline().show(points) is points


def test_the_load_test_reading_names_the_mode_the_layout_and_the_remote_tier_killed():
    from kvlab.plotting.story.serving import load_test_reading

    run = {"requests_sent": 240, "clients": 16, "num_gpu_blocks": 96, "fault_interval_s": 1.0, "failed": 0,
           "differing_tokens": 0, "within_drift": 240, "max_gap": 3.1e-5, "identical": 0, "hits": 120,
           "hardware": "cpu: Test (2 cores)", "profile": "paper", "run_date": "2026-12-08",
           "faults": {"shm-vanish": 3, "disk-damage": 3, "disk-vanish": 2, "remote-kill": 1},
           "kvlab": {"load_errors": 4, "fallback_loads": 1, "cancelled_saves": 2, "preemptions": 3}}
    killed = {**run, "mode": "hooks", "layout": "CPU_BLHNC", "cross_layer": True, "remote": "mooncake",
              "killed_at_s": 61.2, "longest_request_s": 9.87, "wall_s": 130.4,
              "before_kill": {"requests_sent": 118, "hits": 60, "cached_tokens": 25_000, "longest_request_s": 3.21},
              "after_kill": {"requests_sent": 105, "hits": 52, "cached_tokens": 21_000, "longest_request_s": 9.87}}
    text = str(load_test_reading([killed]))
    assert ("KVLabConnector in hooks mode on a CPU_BLHNC cache (cross-layer asked for), tiers memory, shared memory, "
            "disk and mooncake, the Mooncake master SIGKILLed once half the requests were answered" in text)
    assert "every 1 s (8: shm-vanish 3, disk-damage 3, disk-vanish 2)" in text and "4 failed loads" in text
    assert ("Before the kill (61 s in) 118 requests were answered, 60 of them hits (25,000 tokens cached), the "
            "longest in 3.2 s; after it 105 were sent, 52 hits (21,000 tokens), the longest in 9.9 s; 17 requests "
            "in flight across it." in text)
    assert "The longest request took 9.9 s, the run 130 s." in text
    # a run from before these columns: whole-step, its layout not recorded, no tier killed
    older = str(load_test_reading([{**run, "faults": {"shm-vanish": 3, "disk-damage": 3, "disk-vanish": 2}}]))
    assert "KVLabConnector in whole-step mode, a fault injected" in older
    assert "kill" not in older and "longest" not in older


def test_a_concurrency_ratio_says_when_its_servers_threads_were_not_recorded():
    from kvlab.plotting.story.serving import concurrency_point

    row = {"concurrency": 16, "throughput_rps": 60.0}
    old = [{**row, "server": "KVLabConnector"}, {**row, "server": "vLLM prefix cache", "throughput_rps": 40.0}]
    assert "did not record the cores" in concurrency_point(old)
    pinned = [{**r, "compute_threads": 1} for r in old]
    assert "did not record" not in concurrency_point(pinned) and "thread counts" not in concurrency_point(pinned)
    assert "measures the threads" in concurrency_point([{**pinned[0], "compute_threads": 2}, pinned[1]])


def test_the_engine_differences_reading_says_what_this_run_found():
    """Notebook 06, 2c: no claim that bf16 differs where the run shows it bitwise, and the
    batch-invariant row's plain reason."""
    from kvlab.plotting.story import engine_differences_reading

    def row(path, drift, to_control):
        return {"table": "generations", "path": path, "prompts": 40, "identical": 40, "max_logprob_diff": drift,
                "max_logprob_diff_vs_control": to_control, "hardware": "cpu: Test (2 cores)", "profile": "paper",
                "run_date": "2026-12-07"}

    unavailable = {"table": "batch invariance", "available": False, "reason": "no Triton backend here"}
    same = str(engine_differences_reading([unavailable, row("recompute", 0.0, 0.0),
                                           row("vLLM prefix-cache hit", 0.0, 0.0), row("KVLab whole-step", 0.0, 0.0)]))
    assert "gives logprobs bitwise recompute's" in same and "bitwise the control's: KVLab whole-step" in same
    assert "cannot run here: no Triton backend here." in same
    apart = str(engine_differences_reading([row("vLLM prefix-cache hit", 0.03, 0.0), row("KVLab whole-step", 0.03, 0.0)]))
    assert "sits 3.0e-02 from recompute" in apart and "batch-invariant" not in apart


def _tier_rows(buffered_ms: float, direct_ms: float, repeats: int = 5) -> list[dict]:
    meta = {"tokens": 2048, "kv_bytes": 47_185_920, "chunks": 8, "layout": "CPU_LBHNC", "hardware": "cpu: Test (2 cores)",
            "profile": "paper", "run_date": "2026-12-07"}

    def part(tier, path, name, ms):
        samples = [ms + 0.01 * i for i in range(repeats)]
        return {**meta, "tier": tier, "path": path, "part": name, "ms": ms, "samples_ms": samples}

    return [part("memory", "buffered", "copy into the cache", 5.0), part("memory", "reference", "STREAM copy of the bytes", 4.0),
            part("disk", "buffered", "read and checksum", buffered_ms - 5.0),
            part("disk", "buffered", "copy into the cache", 5.0), part("disk", "buffered", "in all", buffered_ms),
            part("disk", "into the cache", "read and checksum", direct_ms)]


def test_the_tier_reads_table_compares_the_two_reads_within_their_spread():
    """Notebook 05, section 2: each read as a multiple of the STREAM copy, and the read straight
    into the cache claimed faster only beyond the spread."""
    text = str(story.tier_reads_table(_tier_rows(20.0, 10.0)))
    assert "| disk | straight into the cache |" in text and "2.50×" in text
    assert "A read from disk straight into the cache takes 10.0 ms less than the buffered read and copy" in text
    close = str(story.tier_reads_table(_tier_rows(10.0, 10.0, repeats=2)))
    assert "this run cannot tell a read from disk straight into the cache from the buffered read" in close.lower()


def _sharing_rows(own_ms: float, converted_ms: float, identical: int = 1, pairs: int = 9) -> list[dict]:
    meta = {"tier": "shm", "cached_tokens": 1984, "kv_bytes": 45_711_360, "samples": pairs, "floor_s": 0.09,
            "hardware": "cpu: Test (2 cores)", "profile": "paper", "run_date": "2026-12-07"}

    def row(reader, stored, ms):
        samples = [(ms + 0.1 * i) / 1e3 for i in range(pairs)]
        return {**meta, "layout": reader, "stored_as": stored, "overhead_samples_s": samples,
                "identical_to_control": identical}

    return [row(reader, stored, own_ms if reader == stored else converted_ms)
            for reader in ("LBHNC", "BLHNC") for stored in ("LBHNC", "BLHNC")]


def test_the_engine_sharing_table_claims_a_conversion_cost_only_beyond_the_spread():
    """Notebook 04: each engine's overhead on its own chunks and on the other layout's, with
    whether each hit was bitwise its control; what converting costs claimed only beyond the spread."""
    text = str(story.engine_sharing_table(_sharing_rows(10.0, 15.0)))
    assert "| LBHNC | BLHNC | 10.4 (10.0–10.8) ms | 1 of 1 | 15.4 (15.0–15.8) ms | 1 of 1 | 90.0 ms |" in text
    assert "A BLHNC engine's hit of LBHNC's chunks takes 5.0 ms more than one of its own" in text
    close = str(story.engine_sharing_table(_sharing_rows(10.0, 10.0, identical=0)))
    assert "this run cannot tell a lbhnc engine's hit of blhnc's chunks from one of its own" in close.lower()
    assert "| 0 of 1 |" in close, "a hit that differs from its control shows"
    with pytest.raises(ValueError, match="no rows of engines sharing a store"):
        story.engine_sharing_table([])


def test_the_conversions_table_judges_each_pair_by_its_worse_direction():
    """A pair is met only when both directions' best methods reach the target over their
    interquartile range; the cache's own copy stands beside it, and a pair below is missed."""
    from kvlab.plotting.story.tables import conversions_table

    def row(layout, target, direction, method, ratio):
        return {"status": "ok", "model": "smollm2-135m", "tokens": 4096, "layout": layout, "target": target, "direction": direction,
                "method": method, "ratio": ratio, "ratio_q1": ratio - 0.01, "ratio_q3": ratio + 0.01, "segments": 1440,
                "mean_segment_bytes": 2048, "repeats": 15, "native_ratio": ratio - 0.05, "hardware": "cpu: Test (2 cores)", "profile": "paper",
                "run_date": "2026-12-07"}

    rows = [row("CPU_BLHNC", "host", d, "memcpy", 0.97) for d in ("load", "offload")]
    rows += [row("CPU_BLHNC", "CPU_LBHNC", "load", "memcpy", 0.95), row("CPU_BLHNC", "CPU_LBHNC", "load", "gather", 0.5),
             row("CPU_BLHNC", "CPU_LBHNC", "offload", "memcpy", 0.93),
             row("LBHNC", "LBNHC", "load", "memcpy", 0.6), row("LBHNC", "LBNHC", "offload", "memcpy", 0.95)]
    lines = str(conversions_table(rows)).splitlines()
    met = next(line for line in lines if "CPU_BLHNC ← CPU_LBHNC" in line)
    assert "0.95 (0.94–0.96) `memcpy`, 0.90 of STREAM" in met and "0.97 (0.96–0.98) `memcpy`" in met
    assert met.endswith("| met | missed (0.88) |"), "the offload reached 0.88 of the STREAM copy"
    assert next(line for line in lines if "LBHNC ← LBNHC" in line).endswith("| missed | missed (0.55) |")
    shards = [{**row("CPU_LBHNC", "host", d, "memcpy", 0.96), "ranks": 2} for d in ("load", "offload")]
    shard = next(line for line in str(conversions_table(rows + shards)).splitlines() if "TP shards" in line)
    assert "CPU_LBHNC ← CPU_LBHNC, one of 2 TP shards" in shard and shard.endswith("| met | met |")
    with pytest.raises(ValueError, match="no conversion rows"):
        conversions_table(rows[:2])


def test_each_tier_s_hit_is_judged_against_its_own_target():
    from kvlab.plotting.story.targets import targets_table

    def hit(path, ratio):
        return {"path": path, "prompt_tokens": 2048, "overhead_s": ratio * 0.004, "stream_s": 0.004, "bound_ratio": ratio,
                "overhead_samples_s": [ratio * 0.004] * 5, "hardware": "cpu: Test (2 cores)", "profile": "paper",
                "run_date": "2026-12-07"}

    text = str(targets_table([hit("KVLab, memory", 1.4), hit("KVLab, shm", 2.2), hit("KVLab, disk", 2.2)], [], [], [], []))
    assert "hit from memory" in text and "at most 1.50×: met" in text
    assert "hit from shm" in text and "at most 2.00×: missed" in text
    assert "hit from disk, in the page cache" in text and "at most 2.50×: met" in text


def test_a_negative_overhead_is_a_fault_of_its_run_never_a_target_met():
    """A hit cheaper than the engine's own prefix hit cannot be right: the reading says so and
    neither it nor the targets table judges the row (a negative multiple would read as met)."""
    from kvlab.plotting.story.serving import lengths_reading
    from kvlab.plotting.story.targets import targets_table

    def hit(path, overhead_s):
        return {"path": path, "prompt_tokens": 2048, "overhead_s": overhead_s, "stream_s": 0.004,
                "bound_ratio": overhead_s / 0.004, "overhead_samples_s": [overhead_s] * 5,
                "stream_samples_s": [0.004] * 5, "hardware": "cpu: Test (2 cores)", "profile": "paper",
                "run_date": "2026-12-07"}

    rows = [hit("KVLab, memory", -0.003), hit("KVLab, shm", 0.006)]
    reading = str(lengths_reading(rows))
    assert "1 of these 2 overheads are negative, which cannot be right" in reading
    assert "a negative overhead, which cannot be right" in reading and "1.50× the STREAM copy" in reading
    assert "A hit from memory" not in reading, "a fault is not judged"
    table = str(targets_table(rows, [], [], [], []))
    assert "not judged: a negative overhead" in table and "met" not in table.split("hit from memory")[1].split("\n")[0]
