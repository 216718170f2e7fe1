"""The harness, the cost model and the bench CLI: correct records, not speed."""

import json

import pytest

from kvlab import results
from kvlab.cache import preset
from kvlab.cli import main
from kvlab.experiments import bench, costmodel, layerwise_timing, sweep
from kvlab.transfer import ALL_METHODS

SMALL = preset("smollm2-135m").with_(num_layers=4)


def test_measure_row_has_every_field():
    """A row carries what a reader needs to judge it: bytes, segments, spread, ceiling, ratio."""
    config = bench.Config(SMALL, "LBHNC", "gather", "offload", 64)
    row = bench.measure(config, bench.resolve_device("cpu"), 3, bench.Setup(config, bench.resolve_device("cpu"), 0))
    assert row["status"] == "ok"
    assert row["bytes"] == 64 * SMALL.token_bytes
    assert 4 <= row["segments"] <= 4 * 4  # 4 scattered blocks x 4 layers, a few merged across layer ends
    assert row["seconds_min"] <= row["seconds"] <= row["seconds_max"]
    assert row["ratio"] > 0 and row["ceiling_gbps"] > 0 and row["repeats"] == 3


def test_unavailable_method_is_a_row_that_says_why():
    config = bench.Config(SMALL, "LBHNC", "vllm", "load", 64)
    row = bench.measure(config, bench.resolve_device("cpu"), 2, bench.Setup(config, bench.resolve_device("cpu"), 0))
    assert row["status"].startswith("unavailable: ")


def test_sweep_appends_jsonl_with_fingerprint(tmp_path):
    out = tmp_path / "r.jsonl"
    configs = [bench.Config(SMALL, layout, "segments", direction, 32)
               for layout in ("LBHNC", "BLHNC") for direction in bench.DIRECTIONS]
    bench.run_sweep(configs, "cpu", repeats=2, out=out)
    bench.run_sweep(configs[:1], "cpu", repeats=2, out=out)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    runs = [r for r in records if r["record"] == "run"]
    assert len(runs) == 2 and len(records) == 2 + 5
    for key in ("device_name", "cpu_model", "cpu_cores", "memory_bytes", "torch", "vllm", "lmcache", "date", "git_commit"):
        assert key in runs[0]
    latest = results.load_results([out])
    assert len(latest) == 1 and latest[0]["hardware"] == runs[1]["hardware"]
    assert len(results.load_results([out], latest=False)) == 5


def test_corrupt_results_file_is_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"record": "run"\n')
    with pytest.raises(ValueError, match="bad.jsonl:1 is not JSON"):
        results.load_results([bad])


def test_profiles_build_configs():
    for name, profile in bench.PROFILES.items():
        configs = bench.configs(profile)
        assert configs, name
        assert all(c.method in ALL_METHODS for c in configs)
    mla = [c for c in bench.configs(bench.PROFILES["full"]) if c.geometry.is_mla]
    assert {c.layout for c in mla} >= {"ascend_mla_tuple", "BLHNC", "mla_v0.12"}


def test_a_conversion_row_times_a_cache_against_a_buffer_of_another_layout():
    """The conversions profile pairs each cache layout with the layout its chunks were stored
    in; a row moves the cache's blocks to and from a host buffer of that layout, every byte
    of them (the bytes are the cache's own copy's, the segments another count)."""
    pairs = bench.PROFILES["conversions"]["conversions"]
    configs = bench.configs(bench.PROFILES["conversions"])
    assert {(c.layout, c.target) for c in configs if c.target != "host"} == set(pairs)
    cpu = bench.resolve_device("cpu")
    rows = {}
    for target in ("host", "CPU_LBHNC"):
        config = bench.Config(SMALL, "CPU_BLHNC", "memcpy", "load", 64, target=target)
        setup = bench.Setup(config, cpu, 0)
        assert setup.buffer.layout.name == ("CPU_BLHNC" if target == "host" else "CPU_LBHNC")
        rows[target] = bench.measure(config, cpu, 3, setup)
    assert rows["CPU_LBHNC"]["status"] == "ok" and rows["CPU_LBHNC"]["target"] == "CPU_LBHNC"
    assert rows["CPU_LBHNC"]["bytes"] == rows["host"]["bytes"] == 64 * SMALL.token_bytes
    assert rows["CPU_LBHNC"]["segments"] > rows["host"]["segments"]  # a page per layer and head, not a run per block


def test_a_shard_row_times_the_heads_of_one_tensor_parallel_rank():
    """The conversions profile's shard rows move the heads of one TP shard between a cache of
    every head and a buffer of that shard (Llama's 8 heads in 2: SmolLM2's 3 do not split), with
    the methods that copy a head slice; a row moves exactly the shard's bytes, every head of the
    buffer landing where the plan says (loaded, then offloaded back into a zeroed buffer)."""
    configs = [c for c in bench.configs(bench.PROFILES["conversions"]) if c.ranks > 1]
    assert {(c.geometry.name, c.layout, c.target, c.ranks) for c in configs} == {
        ("meta-llama/Llama-3.1-8B-Instruct", layout, target, 2) for layout, target, _ in bench.PROFILES["conversions"]["shards"]}
    assert {c.method for c in configs} == {"memcpy"}, "gather copies whole heads"
    cpu = bench.resolve_device("cpu")
    config = bench.Config(SMALL.with_(num_kv_heads=4), "CPU_BLHNC", "memcpy", "load", 64, target="CPU_LBHNC", ranks=2)
    setup = bench.Setup(config, cpu, 0)
    assert setup.buffer.geometry.num_kv_heads == 2 and setup.buffer.layout.name == "CPU_LBHNC"
    row = bench.measure(config, cpu, 3, setup)
    assert row["status"] == "ok" and row["ranks"] == 2 and row["bytes"] == 64 * SMALL.with_(num_kv_heads=2).token_bytes
    with pytest.raises(ValueError, match="ranks must split"):
        bench.Config(SMALL.with_(num_kv_heads=3), "CPU_LBHNC", "memcpy", "load", 64, ranks=2)


def _synthetic_rows(per_segment, bandwidth, method="segments"):
    rows = []
    for segments, nbytes in [(16, 1 << 20), (512, 1 << 22), (2048, 1 << 24), (64, 1 << 26), (8192, 1 << 25)]:
        rows.append({"record": "row", "status": "ok", "hardware": "test", "direction": "offload", "method": method,
                     "segments": segments, "bytes": nbytes, "seconds": segments * per_segment + nbytes / bandwidth})
    return rows


def test_cost_model_recovers_known_parameters():
    (fit,) = costmodel.fit(_synthetic_rows(5e-6, 10e9))
    assert fit.per_segment_s == pytest.approx(5e-6, rel=1e-6)
    assert fit.bandwidth == pytest.approx(10e9, rel=1e-6)
    assert fit.mean_abs_error < 1e-9
    # per-layer within 10% of cross-layer from s >= 10 * c * bw * (1 - 1.1 / L)
    assert fit.break_even_segment_bytes(32) == pytest.approx(10 * 5e-6 * 10e9 * (1 - 1.1 / 32))
    predicted = costmodel.predictions(_synthetic_rows(5e-6, 10e9), [fit])
    assert all(abs(r["error"]) < 1e-9 for r in predicted)


def test_cost_model_never_fits_negative_costs():
    rows = _synthetic_rows(0.0, 10e9)
    rows[0]["seconds"] *= 0.5  # noise that would pull the per-segment cost below zero
    (fit,) = costmodel.fit(rows)
    assert fit.per_segment_s >= 0 and fit.bandwidth > 0


def test_chunk_gain_favours_cross_layer_when_segments_cost():
    (fit,) = costmodel.fit(_synthetic_rows(5e-6, 10e9))
    (row,) = costmodel.chunk_gain([fit], [preset("llama-3.1-8b")])
    assert row["per_layer_segments"] == 512 and row["cross_layer_segments"] == 16
    assert row["gain"] > 1


def test_bench_cli(tmp_path, capsys):
    out = tmp_path / "cli.jsonl"
    assert main(["bench", "--model", "smollm2-135m", "--tokens", "32", "--layouts", "LBHNC,BLHNC",
                 "--methods", "segments,gather", "--device", "cpu", "--repeats", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "LBHNC" in text and "ratio" in text and "appended" in text
    # 2 layouts x scattered|contiguous x 2 methods x 2 directions, plus chunk rows (2 sources x 2 x 2)
    assert len(results.load_results([out])) == 16 + 8


@pytest.mark.parametrize("argv, message", [
    (["--methods", "teleport"], "unknown method"),
    (["--layouts", "XYZ"], "unknown layout"),
    (["--tokens", "0"], "tokens must be positive, got [0]"),
    (["--tokens", "a,b"], "comma-separated list of int"),
    (["--device", "tpu"], "unknown device"),
])
def test_bench_cli_bad_input(argv, message, capsys):
    assert main(["bench", "--no-save", "--model", "smollm2-135m", "--tokens", "32", *argv]) == 2
    assert message in capsys.readouterr().err


def test_layerwise_rows(tmp_path):
    """One row per intensity, the stand-in compute scaled to it: as many matmuls as the
    intensity asks of a layer's load, at least one (on a slow machine even the narrowest
    matmul can outlast a small layer's load), and the intensity that count reaches."""
    rows = layerwise_timing.pipeline_timing(SMALL, 64, [0.5, 2], "cpu", repeats=1)
    assert [(r["intensity"], r["tokens"], r["num_layers"], r["kind"]) for r in rows] == [
        (0.5, 64, 4, "layerwise"), (2, 64, 4, "layerwise")]
    for r in rows:
        assert r["matmuls_per_layer"] == max(1, round(r["intensity"] * r["layer_load_s"] / r["matmul_s"]))
        assert r["reached_intensity"] == pytest.approx(r["matmuls_per_layer"] * r["matmul_s"] / r["layer_load_s"])
    low, high = (r["matmuls_per_layer"] for r in rows)
    assert 1 <= low <= high
    assert rows[0]["hidden"] == rows[1]["hidden"] in layerwise_timing._HIDDEN_SIZES


def test_overlap_timing_names_each_median():
    """A clock that reports what each part costs (load 4 s, compute 2 s, overlapped 4.5 s):
    each median lands under its own name, and the speedups follow from them."""
    spent = []

    def clock(fn):
        spent.clear()
        fn()
        return sum(spent)

    timing = layerwise_timing.overlap_timing(lambda: spent.append(4.0), lambda: spent.append(2.0),
                                             lambda: spent.append(4.5), 8, clock, repeats=3)
    assert timing == pytest.approx({"load_s": 4.0, "compute_s": 2.0, "sequential_s": 6.0, "layerwise_s": 4.5,
                                    "speedup": 6.0 / 4.5, "speedup_low": 6.0 / 4.5, "speedup_high": 6.0 / 4.5,
                                    "ideal_speedup": 6.0 / (4.0 + 2.0 / 8)})


def test_attention_sweep_rows(tmp_path, monkeypatch):
    """The attention stack over a loaded prefix: one row per model and prefix, appended
    after the run record, carrying what overlap_timing measured for that model's layers
    and the intensity (compute over load) it gives."""
    (tmp_path / "config.json").write_text(
        '{"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256}')
    real, seen = layerwise_timing.overlap_timing, []

    def timed(load, compute, layerwise, num_layers, clock, repeats, warmup=1):
        seen.append((num_layers, repeats, real(load, compute, layerwise, num_layers, clock, repeats, warmup)))
        return {**seen[-1][2], "load_s": 0.5, "compute_s": 1.5}

    monkeypatch.setattr(layerwise_timing, "overlap_timing", timed)
    out = tmp_path / "02_attention.jsonl"
    rows = layerwise_timing.run_attention_sweep([str(tmp_path)], [16, 40], 4, "cpu", repeats=1, out=out)
    assert [(r["prefix_tokens"], r["new_tokens"], r["kind"]) for r in rows] == [(16, 4, "attention"), (40, 4, "attention")]
    assert [(layers, repeats) for layers, repeats, _ in seen] == [(2, 1), (2, 1)]
    for row, (_, _, measured) in zip(rows, seen):
        assert (row["num_layers"], row["load_s"], row["compute_s"], row["intensity"]) == (2, 0.5, 1.5, 3.0)
        assert (row["sequential_s"], row["layerwise_s"]) == (measured["sequential_s"], measured["layerwise_s"])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["record"] for r in records] == ["run", "row", "row"]
    assert {r["run_id"] for r in records} == {records[0]["run_id"]}


def test_rows_are_written_as_measured(tmp_path, monkeypatch):
    """A sweep cut short (the GPU script runs under a timeout) keeps the rows it measured."""
    out = results.default_results_path("02_transfer", "cpu", tmp_path)
    assert out.parent == tmp_path and out.name.startswith("02_transfer-cpu-")
    real = sweep.measure

    def cut_at_third(config, *args):
        if config.direction == "load":
            raise KeyboardInterrupt  # what the timeout's signal becomes
        return real(config, *args)

    monkeypatch.setattr(sweep, "measure", cut_at_third)
    configs = [bench.Config(SMALL, "LBHNC", "segments", "offload", 32)] * 2 + [bench.Config(SMALL, "LBHNC", "segments", "load", 32)]
    with pytest.raises(KeyboardInterrupt):
        bench.run_sweep(configs, "cpu", repeats=1, out=out)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["record"] for r in records] == ["run", "row", "row"]


def test_sweep_refuses_bad_input_before_it_measures(tmp_path, monkeypatch):
    """An unknown method, a bad repeat count or something not a Config: a ValueError before
    the run record is written (nothing half-measured to read back)."""
    out = tmp_path / "r.jsonl"
    monkeypatch.setattr(sweep, "measure", lambda *a: pytest.fail("measured before refusing"))
    good = bench.Config(SMALL, "LBHNC", "segments", "offload", 32)
    for configs, repeats, message in [
        ([good, bench.Config(SMALL, "LBHNC", "nosuch", "load", 32)], 1, r"unknown method\(s\) \['nosuch'\]; choose from"),
        ([good], 0, "repeats must be a positive integer, got 0"),
        ([good], True, "repeats must be a positive integer, got True"),
        ([good, ("LBHNC", "segments")], 1, "run_sweep measures Config objects"),
    ]:
        with pytest.raises(ValueError, match=message):
            bench.run_sweep(configs, "cpu", repeats=repeats, out=out)
    assert not out.exists()


@pytest.mark.parametrize("changes, message", [
    ({"tokens": [256, 0]}, r"tokens must be positive, got \[256, 0\]"),
    ({"tokens": [2.5]}, "tokens must be positive"),
    ({"layouts": ["LBHNC", "XYZ"]}, "unknown layout 'XYZ'"),
    ({"methods": ["gather", "teleport"]}, r"unknown method\(s\) \['teleport'\]"),
    ({"models": None}, r"a profile needs \['models', 'tokens', 'layouts', 'methods'\]; this one lacks \['models'\]"),
])
def test_configs_refuse_a_bad_profile(changes, message):
    profile = {**bench.PROFILES["quick"], **changes}
    profile = {k: v for k, v in profile.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        bench.configs(profile)


@pytest.mark.parametrize("changes, message", [
    ({"layout": "KV_2LTD"}, "chunk format, not a paged cache"),
    ({"target": "LBHNC"}, "target must be 'host', an LMCache chunk format or another layout than the cache's LBHNC"),
    ({"target": "XYZ"}, "target must be 'host', an LMCache chunk format or another layout"),
    ({"direction": "sideways"}, "direction must be one of"),
    ({"block_ids": "random"}, "block_ids must be"),
    ({"tokens": 0}, "tokens must be a positive integer"),
])
def test_config_bad_input(changes, message):
    with pytest.raises(ValueError, match=message):
        bench.Config(**{"geometry": SMALL, "layout": "LBHNC", "method": "gather", "direction": "load",
                        "tokens": 32, **changes})


def test_bad_repeats_and_intensities(tmp_path):
    with pytest.raises(ValueError, match="repeats must be a positive integer"):
        bench.run_sweep([bench.Config(SMALL, "LBHNC", "gather", "load", 32)], "cpu", repeats=0)
    with pytest.raises(ValueError, match="intensities must be"):
        bench.pipeline_timing(SMALL, 32, [-1], "cpu")


def test_a_run_that_measured_nothing_does_not_hide_the_last_one(tmp_path):
    out = tmp_path / "r.jsonl"
    bench.run_sweep([bench.Config(SMALL, "LBHNC", "segments", "offload", 32)], "cpu", repeats=1, out=out)
    with pytest.raises(ValueError):
        bench.run_sweep([bench.Config(SMALL, "LBHNC", "nosuch", "offload", 32)], "cpu", repeats=1, out=out)
    assert len(results.load_results([out])) == 1


def test_ceiling_targets_judge_the_worse_direction():
    """A method counts by its worse direction; each target takes the best method so judged."""
    def row(layout, method, direction, ratio, cross=False):
        return {"status": "ok", "target": "host", "run_id": "r1", "layout": layout, "method": method,
                "direction": direction, "ratio": ratio, "cross_layer": cross, "ceiling_gbps": 10.0}

    rows = [row("BLHNC", "gather", "offload", 0.99, True), row("BLHNC", "gather", "load", 0.7, True),
            row("BLHNC", "memcpy", "offload", 0.96, True), row("BLHNC", "memcpy", "load", 0.97, True),
            row("LBHNC", "memcpy", "offload", 0.85), row("LBHNC", "memcpy", "load", 0.92),
            row("LHBNC", "gather", "offload", 0.75), row("LHBNC", "gather", "load", 0.8)]
    targets = {t["target"]: t for t in bench.ceiling_targets(rows)}
    assert (targets["cross-layer"]["method"], targets["cross-layer"]["ratio"], targets["cross-layer"]["met"]) == (
        "memcpy", 0.96, True)
    assert (targets["per-layer"]["layout"], targets["per-layer"]["ratio"], targets["per-layer"]["met"]) == (
        "LBHNC", 0.85, False)
    assert targets["LHBNC"]["ratio"] == 0.75 and targets["LHBNC"]["met"] and "NO" in bench.format_targets(list(targets.values()))


def test_a_method_that_raises_while_timed_fails_the_sweep_instead_of_becoming_a_row(monkeypatch):
    """Only what is checked before timing (method_status) may be an "unavailable" row."""
    from kvlab.cache import preset
    from kvlab.experiments import sweep as sweeps
    from kvlab.transfer import Transfer

    def broken(self):
        raise TypeError("'function' object is not subscriptable")

    monkeypatch.setattr(Transfer, "run", broken)
    pytest.importorskip("lmcache")
    config = sweeps.Config(preset("llama-3.1-8b"), "flash_attn_v0.12", "lmcache", "offload", 32, "scattered", "KV_2LTD")
    with pytest.raises(TypeError, match="not subscriptable"):  # LMCache's own function, a peer, raising
        sweeps.run_sweep([config], "cpu", repeats=1, out=None)
