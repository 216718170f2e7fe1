"""kvlab.store: checked chunks, LRU in memory, a disk tier that outlives the process, and
damaged or foreign chunks treated as misses."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import pytest
import torch

from kvlab.cache import ModelGeometry, allocate
from kvlab.harness.chunks import random_chunk, same_bytes
from kvlab.store import Fetched, KVStore, Stored, block_hashes, shard_key, signature
from kvlab.store.tiers import disk as disk_module

GEOMETRY = ModelGeometry("store-test", 2, 2, 32, torch.bfloat16, 16)
chunk = partial(random_chunk, GEOMETRY, salt="seed")


def test_block_hashes_chain_the_prefix() -> None:
    tokens = list(range(64))
    a = block_hashes(tokens, 16, "m")
    assert len(a) == 4 and len(set(a)) == 4
    assert block_hashes(tokens[:40], 16, "m") == a[:2]  # a partial block has no hash
    changed = block_hashes([99] + tokens[1:], 16, "m")
    assert all(x != y for x, y in zip(a, changed))  # one early token changes every later hash
    assert block_hashes(tokens, 16, "other model") != a


def test_a_fetch_checks_the_blocks_it_was_asked_for() -> None:
    """The worker's read: a chunk holding another block where one was expected is a miss."""
    store = KVStore()
    c = chunk(1, blocks=3)
    assert store.put(c)
    assert store.get(c.key, c.signature, blocks=dict(enumerate(c.block_keys))) is c
    assert store.get(c.key, blocks={1: c.block_keys[1]}) is c
    found = store.fetch(c.key, blocks={0: c.block_keys[1]})
    assert found.chunk is None and found.missed == ("memory",) and not found.dropped
    assert store.get("0" * 32) is None and store.get("not a key") is None


def test_a_fetch_tries_the_named_tier_then_the_shared_ones(tmp_path: Path) -> None:
    store = KVStore(tiers={"shm": {"path": tmp_path / "shm"}, "disk": {"path": tmp_path / "disk"}})
    c = chunk(1)
    assert store.save(c) == Stored(True, ("shm", "disk"))
    found = store.fetch(c.key, c.signature, tier="disk")
    assert found == Fetched(found.chunk, "disk") and same_bytes(found.chunk, c) and store.stats.disk_reads == 1
    (tmp_path / "disk" / f"{c.key}.kvchunk").unlink()  # another process evicted it
    found = store.fetch(c.key, c.signature, tier="disk")
    assert found.tier == "shm" and found.missed == ("disk",) and same_bytes(found.chunk, c)
    store.evict([c.key])
    found = store.fetch(c.key, c.signature)  # memory first, then every shared tier
    assert found.tier == "shm" and found.missed == ("memory",)
    with pytest.raises(ValueError, match="no 'redis' tier"):
        store.fetch(c.key, tier="redis")


def test_a_worker_writes_and_reads_its_shard(tmp_path: Path) -> None:
    """Under tensor parallelism rank r writes its shard of each block under the shard's key;
    its memory tier holds the blocks' own keys."""
    c = chunk(1)
    store = KVStore(tiers={"disk": {"path": tmp_path}}, promote=False)
    assert store.save(c, shard=(1, 2)) == Stored(True, ("disk",)) and c.key in store
    shards = [shard_key(key, 1, 2) for key in c.block_keys]
    assert (tmp_path / f"{shards[-1]}.kvchunk").exists() and not (tmp_path / f"{c.key}.kvchunk").exists()
    blocks = dict(enumerate(c.block_keys))
    got = store.get(shards[-1], c.signature, tier="disk", blocks=blocks, shard=(1, 2))
    assert got is not None and got.block_keys == shards and same_bytes(got, c)
    assert store.get(shards[-1], tier="disk", blocks=blocks, shard=(0, 2)) is None, "another rank's shard"
    assert store.save(c, memory=False, shared=False) == Stored(False) and not Stored(False)
    with pytest.raises(ValueError, match="shard must be"):
        store.save(c, shard=(2, 2))


def test_evict_and_clear_leave_the_shared_tiers(tmp_path: Path) -> None:
    store = KVStore(tiers={"disk": {"path": tmp_path}})
    a, b = chunk(1), chunk(2)
    store.put(a), store.put(b)
    assert store.evict([a.key, "0" * 32]) == 1 and store.stats.evicted == 1 and a.key not in store
    store.clear()
    assert len(store) == 0 and store.bytes == 0
    assert store.get(a.key) is not None and store.get(b.key) is not None  # from disk


def test_lru_eviction_within_the_budget() -> None:
    size = chunk(0).nbytes
    store = KVStore(capacity_bytes=2 * size)
    a, b, c = chunk(1), chunk(2), chunk(3)
    store.put(a), store.put(b)
    store.get(a.key)  # a is now the most recently used
    store.put(c)
    assert a.key in store and c.key in store and b.key not in store
    assert store.stats.evicted == 1 and store.bytes == 2 * size


def test_a_chunk_larger_than_the_store_is_dropped_not_an_error() -> None:
    store = KVStore(capacity_bytes=100)
    assert store.put(chunk(1)) is False
    assert store.stats.dropped == 1 and len(store) == 0


def test_corrupt_memory_chunk_is_a_miss_when_verifying() -> None:
    store = KVStore(verify="always")
    c = chunk(1)
    store.put(c)
    c.buffer.storage[0].view(-1)[5] += 1
    assert store.get(c.key) is None and store.stats.corrupt == 1 and len(store) == 0
    trusting = KVStore(verify="disk")
    d = chunk(2)
    trusting.put(d)
    assert trusting.get(d.key) is d


def test_signature_mismatch_is_a_miss() -> None:
    store = KVStore(verify="always")
    c = chunk(1)
    store.put(c)
    other = signature(allocate("LBHNC", GEOMETRY.with_(name="retrained"), 2))
    assert store.get(c.key, expect=other) is None and store.stats.mismatched == 1
    assert store.get(c.key, expect=c.signature) is c


def test_a_signature_names_what_decides_the_kv_not_the_layout() -> None:
    """Caches of any two plain layouts of one model share chunks (a load converts); another
    model, dtype, block size or MLA shape, or a quantized cache of another layout, does not."""
    mla = ModelGeometry.mla("m", 2, 64, 32, dtype="bfloat16", block_size=16)
    int8 = ModelGeometry("int8", 2, 2, 32, dtype="int8", quant="int8_per_token_head", block_size=16)

    def of(layout, geometry):
        return signature(allocate(layout, geometry, 2, "meta"))

    assert len({of(layout, GEOMETRY) for layout in ("LBHNC", "BLHNC", "CPU_LBHNC", "ascend_kv_tuple")}) == 1
    assert of("mla_v0.29", mla) == of("ascend_mla_tuple", mla) != of("mla_v0.29", mla.with_(qk_rope_head_dim=16,
                                                                                        head_size=80))
    assert len({of("LBHNC", g) for g in (GEOMETRY, GEOMETRY.with_(dtype=torch.float32),
                                          GEOMETRY.with_(block_size=32), GEOMETRY.with_(name="other"))}) == 4
    assert of("LBHNC", int8) != of("BLHNC", int8)


def test_disk_tier_survives_a_new_store(tmp_path: Path) -> None:
    c = chunk(1, layout="BLHNC")
    KVStore(tiers={"disk": {"path": tmp_path}}).put(c)
    fresh = KVStore(tiers={"disk": {"path": tmp_path}})  # another process would see the same
    assert len(fresh) == 0
    got = fresh.get(c.key)
    assert got is not None and same_bytes(got, c) and got.buffer.layout.name == "BLHNC"
    assert got.block_keys == c.block_keys and fresh.stats.disk_reads == 1
    assert fresh.tier("disk").locate(c.block_keys[-1]) == (c.key, 1)


@pytest.mark.parametrize("damage", ["flip", "truncate", "header", "empty"])
def test_damaged_file_is_a_miss_and_removed(tmp_path: Path, damage: str) -> None:
    c = chunk(1)
    KVStore(tiers={"disk": {"path": tmp_path}}).put(c)
    path = next(tmp_path.glob("*.kvchunk"))
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-10] ^= 0xFF
    elif damage == "truncate":
        data = data[:-100]
    elif damage == "header":
        data[20:40] = b"x" * 20
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    fresh = KVStore(tiers={"disk": {"path": tmp_path}})
    assert fresh.get(c.key) is None
    assert fresh.stats.corrupt == 1 and not path.exists()
    assert fresh.get(c.key, blocks=dict(enumerate(c.block_keys))) is None


def test_stray_files_are_ignored(tmp_path: Path) -> None:
    """A fresh store on a folder holding strays reads its own chunk from disk (not memory),
    answers a stray's name as a miss and leaves the strays alone."""
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "junk.kvchunk").write_bytes(b"not a chunk")
    c = chunk(1)
    KVStore(tiers={"disk": {"path": tmp_path}}).put(c)
    reader = KVStore(tiers={"disk": {"path": tmp_path}})
    assert reader.get(c.key, tier="disk") is not None and same_bytes(reader.get(c.key, tier="disk"), c)
    assert reader.get("junk", tier="disk") is None
    assert (tmp_path / "notes.txt").read_text() == "hello"


def test_disk_budget_removes_oldest_files(tmp_path: Path) -> None:
    """Over its budget the disk tier removes the oldest chunks, and only those."""
    size = chunk(0).nbytes
    store = KVStore(tiers={"disk": {"path": tmp_path, "bytes": 2 * size + 4096}})
    for tag in range(4):
        store.put(chunk(tag))
    reader = KVStore(tiers={"disk": {"path": tmp_path}})  # nothing in memory: the disk answers
    kept = [tag for tag in range(4) if reader.get(chunk(tag).key, tier="disk") is not None]
    assert kept == [2, 3] and len(list(tmp_path.glob("*.kvchunk"))) == 2


@pytest.mark.parametrize("kwargs, message", [
    ({"capacity_bytes": 0}, "capacity_bytes must be a positive"),
    ({"tiers": {"disk": {"path": "/tmp/kvlab-store-test", "bytes": -1}}}, "the disk tier: bytes must be a positive"),
    ({"tiers": {"memory": {}}}, "tiers names the shared tiers to open"),
    ({"tiers": {"s3": {}}}, "tiers names the shared tiers to open"),
    ({"tiers": ["disk"]}, "tiers must map tier names to their settings"),
    ({"verify": "sometimes"}, "verify must be"),
])
def test_bad_settings(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVStore(**kwargs)


def test_disk_path_that_is_a_file(tmp_path: Path) -> None:
    path = tmp_path / "not-a-folder"
    path.write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        KVStore(tiers={"disk": {"path": path}})


# ---- the disk tier at scale: start-up reads no chunk, a lookup never lists the folder, its
# index is bounded (a cache: the files are the truth), writes list the folder only when the
# budget needs it, and a scheduler reads headers, never payloads (costs: notebook 05).


@pytest.fixture
def listings(monkeypatch) -> list[str]:
    """Every listing of a folder the disk tier makes, by path."""
    calls: list[str] = []
    real = os.scandir

    def counted(path):  # noqa: ANN001, ANN202
        calls.append(str(path))
        return real(path)

    monkeypatch.setattr(disk_module.os, "scandir", counted)
    return calls


def test_start_up_reads_no_chunk(tmp_path: Path) -> None:
    """Files with bad headers are found when a lookup names them, not at start-up."""
    KVStore(tiers={"disk": {"path": tmp_path}}).put(chunk(1))
    (tmp_path / f"{'a' * 32}.kvchunk").write_bytes(b"not a chunk")
    store = KVStore(tiers={"disk": {"path": tmp_path}})
    assert store.stats.bad_headers == 0, "nothing read at start-up"
    assert store.disk.locate_many(["a" * 32]) == [None] and store.stats.bad_headers == 1
    assert not (tmp_path / f"{'a' * 32}.kvchunk").exists(), "a bad file is dropped once found"


def test_a_lookup_finds_another_process_s_chunk_by_its_name_without_listing(tmp_path: Path, listings) -> None:
    c = chunk(2, blocks=3)
    store = KVStore(tiers={"disk": {"path": tmp_path}})
    KVStore(tiers={"disk": {"path": tmp_path}}).put(c)  # another process
    listings.clear()
    assert store.disk.locate_many(c.block_keys) == [(c.key, 0), (c.key, 1), (c.key, 2)]
    assert store.disk.locate_many([chunk(3).key]) == [None]
    assert listings == [], "no lookup lists the folder, hit or miss"


def test_the_index_is_bounded_and_what_it_forgot_is_found_again(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(disk_module, "INDEXED_CHUNKS", 3)
    store = KVStore(tiers={"disk": {"path": tmp_path}}, capacity_bytes=1 << 20)
    chunks = [chunk(10 + i) for i in range(6)]
    for c in chunks:
        store.put(c)
    assert len(store.disk._chunk_blocks) == 3 and len(store.disk._index) == 6, "3 chunks of 2 blocks"
    assert store.disk.locate_many(chunks[0].block_keys) == [(chunks[0].key, 0), (chunks[0].key, 1)]
    assert len(store.disk._chunk_blocks) == 3


def test_writes_list_the_folder_only_when_the_budget_needs_it(tmp_path: Path, listings) -> None:
    c = chunk(20)
    size = len(disk_module.encode_header(c)) + c.nbytes
    store = KVStore(tiers={"disk": {"path": tmp_path, "bytes": 5 * size}})
    listings.clear()
    for i in range(4):
        store.put(chunk(30 + i))
    assert len(listings) == 1, "counted once, then the tier adds what it writes"
    for i in range(4):
        store.put(chunk(40 + i))
    assert len(list(tmp_path.glob("*.kvchunk"))) <= 5, "the budget still holds"


def test_headers_are_read_without_payloads(tmp_path: Path, monkeypatch) -> None:
    c = chunk(50)
    store = KVStore(tiers={"disk": {"path": tmp_path}})
    store.put(c)
    monkeypatch.setattr(disk_module.DiskTier, "_payload", lambda *args: pytest.fail("a payload was read"))
    (header,) = store.describe("disk", [c.key])
    assert header.block_keys == c.block_keys and header.signature == c.signature
    assert store.describe("disk", [chunk(51).key, "../x"]) == [None, None]
