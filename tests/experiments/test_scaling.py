"""How the costs grow (kvlab.experiments.scaling and hit_costs): what each measurement
reports, on small sizes; the timings themselves are notebook 03's, not asserted here."""

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


def test_targets_say_met_only_within_each_bound() -> None:
    lengths = [{"path": "KVLab, memory", "prompt_tokens": 2048, "bound_ratio": 1.4},
               {"path": "KVLab, memory", "prompt_tokens": 8000, "bound_ratio": 1.6},
               {"path": "KVLab, disk", "prompt_tokens": 8000, "bound_ratio": 9.0}]
    lookups = [{"tier": "disk", "stored_chunks": 100_000, "prompt_tokens": 2048, "lookup_ms": 0.7},
               {"tier": "disk", "stored_chunks": 10, "prompt_tokens": 2048, "lookup_ms": 5.0}]
    serving = [{"server": "KVLabConnector", "concurrency": 16, "throughput_rps": 9.4},
               {"server": "vLLM prefix cache", "concurrency": 16, "throughput_rps": 10.0}]
    met = {row["target"].split(":")[0]: row["met"] for row in scaling.targets(lengths, lookups, {"ratio": 1.3}, serving)}
    assert met == {"hit from memory, 2048 tokens": True, "hit from memory, 8000 tokens": False,
                   "disk lookup, 2048 tokens, 100,000 chunks stored": True,
                   "Redis load / the server's own GET pace <= 1.2": False, "16 concurrent": False}


def test_vllm_serve_with_its_defaults_and_no_connector_takes_extra_options() -> None:
    from kvlab.runtime.models import model_path
    from kvlab.runtime.servers import VLLMServer

    server = VLLMServer(model_path("smollm2-135m-instruct"), "none", vllm_defaults=True,
                        args=("--no-enable-prefix-caching",), port=8000)
    command = server.command()
    assert "--kv-transfer-config" not in command and command[-1] == "--no-enable-prefix-caching"
