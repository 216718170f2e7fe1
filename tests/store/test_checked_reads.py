"""Checked reads: a file tier's chunk read straight into the paged cache (kvlab.store.chunk.
read_payload, over kvlab.transfer.file_reads), its CRC32C computed as the bytes arrive. The
same bytes land where the buffered load puts them, in every layout; a damaged file is
caught and left to the next tier or to vLLM; the CRC is google_crc32c's."""

from __future__ import annotations

import os
import random
from pathlib import Path

import google_crc32c
import pytest
import torch

from kvlab.cache import ModelGeometry, allocate
from kvlab.cache.layouts import LAYOUTS, Holds
from kvlab.harness.chunks import random_chunk, same_bytes
from kvlab.store import KVStore
from kvlab.store.chunk import Placement, checksum, parse_header, read_payload
from kvlab.transfer import file_reads
from kvlab.transfer.engine import Transfer

checked_reads = pytest.mark.skipif(file_reads.unavailable() is not None, reason=str(file_reads.unavailable()))

KV = ModelGeometry("reads-kv", 3, 2, 32, torch.bfloat16, 4)
MLA = ModelGeometry("reads-mla", 3, 1, 12, torch.float32, 4, kv_lora_rank=8, qk_rope_head_dim=4)
NVFP4 = ModelGeometry("reads-nvfp4", 3, 2, 32, "uint8", 4, quant="nvfp4")
STORED = sorted(name for name, layout in LAYOUTS.items() if not layout.is_chunk_format)


def geometry_for(layout: str) -> ModelGeometry:
    spec = LAYOUTS[layout]
    if spec.scales == "regions":
        return NVFP4
    return MLA if spec.requires == Holds.MLA else KV


@checked_reads
def test_the_crc_is_google_crc32c_s_over_runs_of_any_length_and_alignment() -> None:
    """Lengths around the three-lane split (256 bytes a lane, 8 KiB at most) and odd starts."""
    data = torch.randint(0, 256, (200_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    rng = random.Random(2)
    for _ in range(200):
        runs = [(rng.randrange(0, 100_000), rng.choice([0, 1, 7, 8, 767, 768, 769, 24_575, 24_576, 24_600,
                                                        rng.randrange(0, 100_000)])) for _ in range(rng.randrange(4))]
        expected = 0
        for start, length in runs:
            expected = google_crc32c.extend(expected, data[start:start + length].numpy())
        addresses = torch.tensor([data.data_ptr() + start for start, _ in runs], dtype=torch.int64)
        lengths = torch.tensor([length for _, length in runs], dtype=torch.int64)
        assert file_reads.crc32c(addresses, lengths) == expected, runs
    assert checksum([data[:1000], data[5:77_777]]) == google_crc32c.extend(
        google_crc32c.value(data[:1000].numpy()), data[5:77_777].numpy())


def same_storage(a, b) -> bool:  # noqa: ANN001 - two KVCaches
    """Bitwise (random bits hold NaNs, which torch.equal calls unequal)."""
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a.storage, b.storage))


def stored_file(tmp_path: Path, layout: str, blocks: int = 5) -> tuple:
    """A chunk of ``blocks`` random blocks written by a disk tier, with its checked header."""
    geometry = geometry_for(layout)
    chunk = random_chunk(geometry, 1, blocks, layout=layout)
    store = KVStore(tiers={"disk": {"path": tmp_path}})
    store.save(chunk, memory=False)
    path = tmp_path / f"{chunk.key}.kvchunk"
    with path.open("rb") as f:
        header = parse_header(f, chunk.key, path.stat().st_size)
    return chunk, header, path


@checked_reads
@pytest.mark.parametrize("layout", STORED)
@pytest.mark.parametrize("positions", [[0, 1, 2, 3, 4], [1, 2], [4], [3, 0]])
def test_a_read_puts_the_bytes_where_the_buffered_load_does(tmp_path: Path, layout: str, positions: list[int]) -> None:
    """Every stored layout, whole chunks and parts of them, in and out of order: the cache
    afterwards is bitwise the one a Transfer from the chunk makes, and the CRC is the chunk's
    (positions not loaded are still read and summed)."""
    chunk, header, path = stored_file(tmp_path, layout)
    block_ids = [9 - 2 * i for i in range(len(positions))]
    expected = allocate(layout, chunk.buffer.geometry, 10)
    Transfer(chunk.buffer, positions, expected, block_ids).run()
    cache = allocate(layout, chunk.buffer.geometry, 10)
    with path.open("rb") as f:
        crc = read_payload(f.fileno(), header, Placement(cache, positions, block_ids))
    assert crc == chunk.crc
    assert same_storage(cache, expected)


@checked_reads
def test_the_runs_read_unchecked_land_as_a_checked_read_s_and_sum_nothing(tmp_path: Path) -> None:
    """What a profile times as the reads alone (payload_runs, read_runs unchecked) puts the
    same bytes where read_payload does; it gives no CRC, so nothing can take it as checked."""
    from kvlab.store.chunk import payload_runs

    chunk, header, path = stored_file(tmp_path, "CPU_LBHNC")
    caches = [allocate("CPU_LBHNC", chunk.buffer.geometry, 10) for _ in range(2)]
    placements = [Placement(cache, [3, 0, 4], [9, 1, 5]) for cache in caches]
    with path.open("rb") as f:
        assert read_payload(f.fileno(), header, placements[0]) == chunk.crc
        assert file_reads.read_runs(f.fileno(), header.payload_start, *payload_runs(header, placements[1]),
                                    checked=False) is None
    assert same_storage(*caches)


@checked_reads
@pytest.mark.parametrize("tier", ["disk", "shm"])
def test_a_store_delivers_into_the_cache_and_a_damaged_file_falls_through(tmp_path: Path, tier: str) -> None:
    """The named tier reads into the cache; a flipped byte in its file fails the CRC, the
    file is dropped, and the next tier's read overwrites the blocks with the chunk."""
    chunk = random_chunk(KV, 1, 4, layout="CPU_LBHNC")
    store = KVStore(tiers={"shm": {"path": tmp_path / "shm"}, "disk": {"path": tmp_path / "disk"}})
    store.save(chunk, memory=False)
    expected = allocate("CPU_LBHNC", KV, 8)
    Transfer(chunk.buffer, [0, 1, 2, 3], expected, [7, 6, 5, 4]).run()
    into = Placement(allocate("CPU_LBHNC", KV, 8), [0, 1, 2, 3], [7, 6, 5, 4])
    found = store.fetch(chunk.key, chunk.signature, tier=tier, blocks=dict(enumerate(chunk.block_keys)), into=into)
    assert found.delivered and found.chunk is None and found.tier == tier
    assert same_storage(into.cache, expected)

    path = tmp_path / tier / f"{chunk.key}.kvchunk"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    path.write_bytes(bytes(data))
    into = Placement(allocate("CPU_LBHNC", KV, 8), [0, 1, 2, 3], [7, 6, 5, 4])
    found = store.fetch(chunk.key, chunk.signature, tier=tier, into=into)
    other = "disk" if tier == "shm" else "shm"
    assert found.delivered and found.tier == other and found.missed == (tier,)
    assert store.stats.corrupt == 1 and not path.exists()
    assert same_storage(into.cache, expected)


@checked_reads
def test_a_refused_header_leaves_the_cache_untouched(tmp_path: Path) -> None:
    """Another model's chunk, or one without the expected block, is a miss before a byte of
    its payload is read."""
    chunk = random_chunk(KV, 1, 2, layout="CPU_LBHNC")
    store = KVStore(tiers={"disk": {"path": tmp_path}})
    store.save(chunk, memory=False)
    into = Placement(allocate("CPU_LBHNC", KV, 4), [0, 1], [1, 2])
    assert not store.fetch(chunk.key, "another model", tier="disk", into=into).delivered
    assert not store.fetch(chunk.key, tier="disk", blocks={0: chunk.block_keys[1]}, into=into).delivered
    assert store.stats.mismatched == 1 and store.stats.corrupt == 0
    assert not any(t.any() for t in into.cache.storage)


def test_without_checked_reads_a_store_reads_into_a_buffer(tmp_path: Path, monkeypatch) -> None:
    """A machine where the C helper cannot build (or has no hardware CRC): the chunk comes
    back to be copied, as before; with an auth_key too (its MAC is checked over a buffer)."""
    chunk = random_chunk(KV, 1, 2, layout="CPU_LBHNC")
    store = KVStore(tiers={"disk": {"path": tmp_path / "a"}})
    store.save(chunk, memory=False)
    into = Placement(allocate("CPU_LBHNC", KV, 4), [0, 1], [1, 2])
    monkeypatch.setattr(file_reads, "unavailable", lambda: "no C compiler")
    found = store.fetch(chunk.key, chunk.signature, tier="disk", into=into)
    assert not found.delivered and found.chunk is not None and not any(t.any() for t in into.cache.storage)
    monkeypatch.undo()
    keyed = KVStore(tiers={"disk": {"path": tmp_path / "b"}}, auth_key=os.urandom(32))
    keyed.save(chunk, memory=False)
    found = keyed.fetch(chunk.key, chunk.signature, tier="disk", into=into)
    assert not found.delivered and found.chunk is not None


@checked_reads
def test_a_file_shorter_than_its_runs_is_an_error_not_a_short_read(tmp_path: Path) -> None:
    chunk, header, path = stored_file(tmp_path, "CPU_LBHNC", blocks=2)
    path.write_bytes(path.read_bytes()[:-50])  # cut after its header was checked
    cache = allocate("CPU_LBHNC", KV, 4)
    with path.open("rb") as f, pytest.raises(OSError, match="ended before its payload"):
        read_payload(f.fileno(), header, Placement(cache, [0, 1], [0, 1]))


@pytest.mark.parametrize("layout", STORED)
def test_every_stored_layout_comes_back_from_a_file(tmp_path: Path, layout: str) -> None:
    """Through the buffered read too: a chunk file's header names each tensor as its layout
    allocates it (cross-layer flash-attn and MLA layouts view theirs with axes merged, and
    their files were once refused as damaged)."""
    chunk = random_chunk(geometry_for(layout), 1, 3, layout=layout)
    KVStore(tiers={"disk": {"path": tmp_path}}).save(chunk, memory=False)
    found = KVStore(tiers={"disk": {"path": tmp_path}}).fetch(chunk.key, tier="disk")
    assert found.chunk is not None and same_bytes(found.chunk, chunk)


@pytest.mark.parametrize("positions, block_ids, message", [
    ([0, 1], [3], "each position into a block of its own"),
    ([0, 1], [3, 3], "each position into a block of its own"),
    ([0], [9], "outside the cache's 4 blocks"),
])
def test_a_placement_that_cannot_be_right_is_refused(positions, block_ids, message) -> None:
    with pytest.raises(ValueError, match=message):
        Placement(allocate("CPU_LBHNC", KV, 4), positions, block_ids)
