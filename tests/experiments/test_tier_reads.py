"""kvlab.experiments.tier_reads: a file-tier hit timed part by part, both ways it can be read."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import ModelGeometry
from kvlab.experiments import tier_reads
from kvlab.experiments.tier_reads import ONE_THREAD_STREAM, RUNS_ALONE, tier_read_profile
from kvlab.store.tiers.disk import DiskTier
from kvlab.transfer import file_reads

GEOMETRY = ModelGeometry("tier-reads-test", 2, 2, 16, torch.float16, 16)


def test_every_part_of_each_tier_is_timed_and_the_buffered_total_adds_up(tmp_path, monkeypatch) -> None:
    """Every part, on one thread as a vLLM CPU worker copies (torch's count put back after),
    beside the STREAM copy on one thread and on the machine's threads."""
    threads_seen = []
    real_checksum = tier_reads.checksum
    monkeypatch.setattr(tier_reads, "checksum", lambda *a: threads_seen.append(torch.get_num_threads()) or
                        real_checksum(*a))
    threads = torch.get_num_threads()
    rows = tier_read_profile(GEOMETRY, tmp_path / "disk", tokens=512, repeats=2, shm_root=tmp_path / "shm")
    assert set(threads_seen) == {1} and torch.get_num_threads() == threads
    parts = {(r["tier"], r["path"], r["part"]): r for r in rows}
    for tier in ("shm", "disk"):
        assert {(tier, "buffered", p) for p in ("open and check the headers", "read and checksum",
                                                 "copy into the cache", "in all")} <= set(parts)
        whole = parts[(tier, "buffered", "in all")]["samples_ms"]
        read, copy = (parts[(tier, "buffered", p)]["samples_ms"] for p in ("read and checksum", "copy into the cache"))
        assert whole == pytest.approx([a + b for a, b in zip(read, copy)])
        assert ((tier, "into the cache", "read and checksum") in parts) == (file_reads.unavailable() is None)
        assert ((tier, RUNS_ALONE, "in all") in parts) == (file_reads.unavailable() is None)
    assert {("memory", "reference", "STREAM copy of the bytes"), ("memory", "reference", ONE_THREAD_STREAM),
            ("memory", "buffered", "copy into the cache"), ("shm", "the kernel's read alone", "in all")} <= set(parts)
    assert all(r["ms"] > 0 and len(r["samples_ms"]) == 2 and r["chunks"] == 2 for r in rows)
    assert {r["kv_bytes"] for r in rows} == {512 * GEOMETRY.token_bytes}
    assert not any((tmp_path / "shm").iterdir()), "the tiers' folders are removed"


@pytest.mark.skipif(file_reads.unavailable() is not None, reason=str(file_reads.unavailable()))
def test_a_read_that_fails_is_a_failed_run_not_a_row(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(DiskTier, "read_into", lambda self, key, into, accept: None)
    with pytest.raises(RuntimeError, match="did not read a chunk it holds into the cache"):
        tier_read_profile(GEOMETRY, tmp_path, tokens=256, repeats=1, shm_root=tmp_path)
