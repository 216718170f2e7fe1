"""How the costs grow (kvlab.experiments.scaling and hit_costs): what each measurement
reports, on small sizes; the timings themselves are notebook 05's, not asserted here."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from kvlab.cache import ModelGeometry  # noqa: E402
from kvlab.experiments import hit_costs, scaling  # noqa: E402

TINY = ModelGeometry("scale-test", 2, 2, 16, torch.bfloat16, 16)


def test_a_hits_profile_names_every_call_and_the_copy_within_the_load() -> None:
    rows = {row["call"]: row for row in hit_costs.overhead_profile(TINY, tokens=256, repeats=2)}
    assert set(hit_costs.SCHEDULER_CALLS + hit_costs.WORKER_CALLS) < set(rows)
    assert 0 < rows["copy"]["ms"] <= rows["start_load_kv"]["ms"] <= rows["total"]["ms"]
    assert rows["total"]["kv_bytes"] == 240 * TINY.token_bytes, "15 full blocks loaded, the last token computed"
    assert rows["STREAM copy of the loaded bytes"]["ms"] > 0


def test_layouts_sharing_times_each_layout_s_hit_of_its_own_and_of_the_other_s_chunks(tmp_path) -> None:
    """Each reader hits the whole prompt from each file tier, of chunks it stored and of the
    other layout's (converted: the same bytes loaded); a converted hit needs a shared tier."""
    rows = [r for r in hit_costs.layouts_sharing(TINY, tmp_path, tokens=128, repeats=2) if r["call"] == "total"]
    assert {(r["tiers"], r["layout"], r["stored_as"]) for r in rows} == {
        (tier, reader, stored) for tier in ("shm", "disk") for reader in ("CPU_LBHNC", "CPU_BLHNC")
        for stored in ("CPU_LBHNC", "CPU_BLHNC")}
    assert {r["kv_bytes"] for r in rows} == {112 * TINY.token_bytes}, "7 full blocks loaded each time"
    with pytest.raises(ValueError, match="reaches this one through a shared tier"):
        hit_costs.overhead_profile(TINY, tokens=128, repeats=1, stored_as="CPU_BLHNC")


def test_engines_sharing_a_store_take_one_prompt_per_writer_of_one_length(tmp_path) -> None:
    """Each writer layout stores a prompt of its own, and both readers hit prompts of the same
    bytes: other counts or lengths are refused before any engine starts."""
    from kvlab.experiments.engine_sharing import engines_sharing_a_store

    (tmp_path / "config.json").write_text("{}")
    for prompts in ([[1] * 64], [[1] * 64, [2] * 96], [[1] * 64] * 3):
        with pytest.raises(ValueError, match="prompts of one length"):
            engines_sharing_a_store(str(tmp_path), prompts)
    with pytest.raises(ValueError, match="repeats must be at least 1"):
        engines_sharing_a_store(str(tmp_path), [[1] * 64, [2] * 64], repeats=0)


def test_a_measurement_without_an_auth_key_drops_only_that_advice(caplog) -> None:
    """A profile through a remote tier runs without an auth_key on purpose: the connector's
    advice to deployments is not printed into a notebook, and every other warning still is."""
    import logging

    logger = logging.getLogger("kvlab.connector")
    with caplog.at_level(logging.WARNING, logger="kvlab.connector"), hit_costs.without_auth_key_advice():
        logger.warning("KVLabConnector: the redis tier takes chunks ...; set auth_key (\"file:/path\")")
        logger.warning("KVLabConnector: a load failed")
    logger.warning("KVLabConnector: the redis tier ...; set auth_key")
    assert [r.getMessage() for r in caplog.records] == ["KVLabConnector: a load failed",
                                                         "KVLabConnector: the redis tier ...; set auth_key"]


def test_lookups_are_timed_at_each_size_and_find_the_whole_prompt(tmp_path) -> None:
    rows = hit_costs.lookup_scaling(tmp_path, None, stored=(3, 30), repeats=2, fresh=1)
    assert [(r["tier"], r["stored_chunks"]) for r in rows] == [("disk", 3), ("disk", 30)]
    assert all(r["hit_tokens"] == 2048 and r["lookup_ms"] > 0 and r["first_lookup_kib"] > 0 for r in rows)
    assert len(list((tmp_path / "lookup-disk").glob("*.kvchunk"))) == 30 + 8, "the synthetic ones and the prompt's 8"


def test_lookup_memory_states_a_bound_from_both_limits(tmp_path) -> None:
    from kvlab.connector.scheduler import CHECKED_CHUNKS
    from kvlab.store.tiers.disk import INDEXED_CHUNKS

    row = hit_costs.lookup_memory(tmp_path, chunks=40)
    assert row["index_bytes_per_chunk"] > 16 * 32, "at least the 16 keys' characters"
    assert row["bound_mib"] == pytest.approx(row["index_bytes_per_chunk"] * (INDEXED_CHUNKS + CHECKED_CHUNKS) / 2**20)


def test_the_stream_bound_is_measured_per_size_and_the_percentile_interpolates() -> None:
    (row,) = scaling.with_stream_bound([{"kv_bytes": 1 << 20, "overhead_s": 0.01}], repeats=3)
    assert row["stream_s"] > 0 and row["bound_ratio"] == pytest.approx(0.01 / row["stream_s"])
    assert scaling._percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.99) == pytest.approx(4.96)


def test_a_servers_compute_threads_are_read_from_its_log_and_repeats_pool() -> None:
    """vLLM logs the cores its worker binds: with a connector on 2 cores and no pin, both."""
    log = ("INFO OpenMP thread binding info: \n\tVLLM_CPU_OMP_THREADS_BIND='auto'\n"
           "\tlocal_rank=0, core ids=[0, 1]\n\treserved_cpus=[]\n")
    assert scaling.compute_threads(log) == 2
    assert scaling.compute_threads(log.replace("[0, 1]", "[1]")) == 1
    assert scaling.compute_threads("no binding line") is None
    pooled = scaling._pooled([{"requests": 8, "wall_s": 2.0, "latencies": [0.1] * 8, "cached": [512] * 8},
                              {"requests": 8, "wall_s": 1.0, "latencies": [0.3] * 8, "cached": [512] * 8},
                              {"requests": 8, "wall_s": 4.0, "latencies": [0.2] * 8, "cached": [0] * 8}])
    assert pooled["throughput_samples_rps"] == [4.0, 8.0, 2.0] and pooled["throughput_rps"] == 4.0
    assert pooled["requests"] == 24 and pooled["repeats"] == 3 and pooled["ttft_p50_s"] == 0.2
    with pytest.raises(ValueError, match="repeats must be a positive integer"):
        scaling.concurrency_sweep("m", list(range(10_000)), repeats=0)


def test_vllm_serve_with_its_defaults_and_no_connector_takes_extra_options() -> None:
    from kvlab.runtime.models import model_path
    from kvlab.runtime.servers import VLLMServer

    server = VLLMServer(model_path("smollm2-135m-instruct"), "none", vllm_defaults=True,
                        args=("--no-enable-prefix-caching",), port=8000)
    command = server.command()
    assert "--kv-transfer-config" not in command and command[-1] == "--no-enable-prefix-caching"
