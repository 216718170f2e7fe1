"""Takeaways read their numbers from the rows they are given, and say so when rows are missing."""

import pandas as pd
import pytest

from kvlab.cache import preset, sweep
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
            "ratio": ratio, "segments": segments, "cross_layer": cross_layer, **extra}


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
    ratios, copies, overlap = transfer_takeaways(pd.DataFrame(rows), "org/Model", 1024, layerwise).points
    assert "best cross-layer transfer (BLHNC, gather) reaches 0.90" in ratios
    assert "best per-layer one (LBHNC, segments) 0.65" in ratios and "cpu: Test (2 cores)" in ratios
    assert copies == "The same bytes take per-layer layouts 2,048 copies and cross-layer ones 64."
    assert "at best 1.50× (Model, 256 tokens, compute intensity 4)" in overlap
    assert "2 of 3 settings, none below compute intensity 2" in overlap


def test_transfer_takeaways_without_rows_of_the_headline_is_a_clear_error():
    with pytest.raises(ValueError, match="no takeaways"):
        transfer_takeaways([_bench_row("LBHNC", "gather", "load", 0.6, 2048, False)], "org/Other", 1024)


def test_connector_takeaways():
    ttft = [{"scenario": s, "median_s": m, "overhead_s": o, "cached_tokens": 1984, "prompt_tokens": 2000,
             "identical": 4, "prompts": 5, "model": "smollm2"} for s, m, o in
            (("recompute", 4.0, None), ("vLLM prefix hit", 0.08, 0.0), ("KVLab whole-step, memory", 0.09, 0.01),
             ("KVLab whole-step, disk", 0.1, 0.02), ("ExampleConnector", 0.1, 0.018))]
    registration = [{"cross_layer": c, "tokens": 1024, "save_segments": n, "save_ms": ms}
                    for c, n, ms in ((False, 2048, 64.0), (False, 16384, 89.0), (True, 64, 35.0))]
    network = [{"layout": layout, "strategy": strategy, "tokens": 2048, "objects_per_chunk": n, "store_s": s}
               for layout, strategy, n, s in (("LBHNC", "object per run", 240, 0.049),
                                              ("BLHNC", "object per run", 8, 0.013),
                                              ("BLHNC", "object per chunk (gather)", 1, 0.035))]
    ttft_point, identical, handover, redis = connector_takeaways(pd.DataFrame(ttft), registration, network).points
    assert "**KVLab whole-step, memory** answers in 90 ms: 10.0 ms over vLLM's own prefix hit (80 ms)" in ttft_point
    assert "44× faster than recompute (4,000 ms); ExampleConnector adds 18.0 ms" in ttft_point
    assert "on 4 of 5 prompts (smollm2)" in identical
    assert "per-layer registrations cost 2,048–16,384 copies per save (64–89 ms)" in handover
    assert "cross-layer ones 64 copies per save (35 ms)" in handover
    assert "240 objects per chunk per-layer (LBHNC) and 8 cross-layer (BLHNC): stored in 49 ms against 13 ms" in redis
    assert len(connector_takeaways(ttft).points) == 2  # the other tables are optional


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
                              "vLLM's own prefix hit, the control, 30/30.")
    assert score == "On the task (exact-match) recompute scores 0.565 ± 0.035, the 1 reuse paths 0.565."
    assert damage.endswith("zeroed 200/200, block-order 0/200.")


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
