"""kvlab.store under faults (no engine): write errors, a full and a read-only disk (real
tmpfs mounts where the machine allows them), fuzzed and planted headers, swapped files,
budgets, leftovers of killed writers, eviction by use, and two processes on one folder.
Whatever happens, a store call never raises for a tier's fault and never returns bytes
other than those stored. The same faults through a real engine: test_faults_engine.py."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import struct
import subprocess
import time
import types
from functools import partial
from pathlib import Path

import pytest
import torch

from kvlab.cache import ModelGeometry
from kvlab.store import RETRY_FIRST_S, Chunk, KVStore, block_hashes, folder_fingerprint
from kvlab.store.tiers import backoff
from kvlab.store import chunk as chunk_format
from kvlab.harness.chunks import random_chunk, same_bytes

GEOMETRY = ModelGeometry("fault-test", 2, 2, 32, torch.bfloat16, 16)
chunk = partial(random_chunk, GEOMETRY, salt="s")


def hit(store: KVStore, c: Chunk, **options: object) -> Chunk | None:
    """``c`` as a worker fetches it (the production path): its signature and blocks."""
    return store.get(c.key, c.signature, blocks=dict(enumerate(c.block_keys)), **options)


def file_of(folder: Path, c: Chunk) -> Path:
    return folder / f"{c.key}.kvchunk"


def mount(path: Path, *options: str) -> None:
    path.mkdir(exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); the injected-error tests cover this")


@pytest.fixture
def tmpfs(tmp_path: Path):
    """A small real filesystem: ENOSPC and EROFS from the kernel, not from a mock."""
    path = tmp_path / "tmpfs"
    mount(path, "size=1m", "mode=0700")  # a store refuses a folder others can write (tmpfs: 1777)
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


# ---- write errors ---------------------------------------------------------------------------
@pytest.mark.parametrize("code", [errno.EROFS, errno.EIO, errno.EACCES])
def test_a_failing_disk_is_logged_once_counted_paused_and_retried(tmp_path, monkeypatch, caplog, code) -> None:
    store = KVStore(tiers={"disk": {"path": tmp_path}})

    def fail(chunk):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(store.disk, "_write", fail)
    with caplog.at_level("WARNING", logger="kvlab.store"):
        for tag in range(5):
            assert store.put(chunk(tag)) is True  # the memory tier still took it
    assert store.stats.write_errors == 1 and store.stats.disk_skipped == 4  # paused after the first
    assert caplog.text.count("cannot write") == 1
    assert all(store.get(chunk(tag).key) is not None for tag in range(5))
    monkeypatch.undo()
    later = time.monotonic() + RETRY_FIRST_S  # the back-off has passed
    monkeypatch.setattr(backoff, "time", types.SimpleNamespace(monotonic=lambda: later))
    assert store.put(chunk(9)) and file_of(tmp_path, chunk(9)).exists()


def test_a_full_tmpfs_evicts_instead_of_failing(tmpfs: Path) -> None:
    big = [chunk(tag, blocks=32) for tag in range(8)]  # 256 KiB each: the 1 MiB filesystem holds three
    store = KVStore(tiers={"disk": {"path": tmpfs, "bytes": 100 * big[0].nbytes}})  # a budget larger than the disk
    for c in big:
        assert store.put(c)
    files = list(tmpfs.glob("*.kvchunk"))
    assert 0 < len(files) < 8 and store.stats.evicted > 0
    assert not list(tmpfs.glob("*.tmp")), "no partial file left behind"
    assert store.stats.write_errors == 0, "a full disk made room; it did not fail"
    got = KVStore(tiers={"disk": {"path": tmpfs}}).get(big[-1].key)
    assert got is not None and same_bytes(got, big[-1]), "the newest chunk is on disk"


def test_a_full_shared_memory_tier_evicts_and_another_store_reads_it(tmpfs: Path) -> None:
    """The shared-memory tier is the disk tier's files in a memory-backed folder: full, it
    evicts; another process's store reads (maps) a chunk's file, bytes intact."""
    big = [chunk(tag, blocks=32) for tag in range(8)]
    store = KVStore(capacity_bytes=big[0].nbytes, tiers={"shm": {"path": tmpfs, "bytes": 100 * big[0].nbytes}})
    for c in big:
        assert store.put(c)
    assert 0 < len(list(tmpfs.glob("*.kvchunk"))) < 8 and store.stats.evicted > 0
    assert store.stats.write_errors == 0, "a full tier made room; it did not fail"
    other = KVStore(tiers={"shm": {"path": tmpfs}})
    got = other.tier("shm").get(big[-1].key)
    assert got is not None and same_bytes(got, big[-1]) and other.stats.shm_reads == 1


def test_a_read_only_folder_with_a_corrupt_chunk(tmpfs: Path) -> None:
    good, bad = chunk(1), chunk(2)
    KVStore(tiers={"disk": {"path": tmpfs}}).put(good), KVStore(tiers={"disk": {"path": tmpfs}}).put(bad)
    data = bytearray(file_of(tmpfs, bad).read_bytes())
    data[-3] ^= 0x01
    file_of(tmpfs, bad).write_bytes(bytes(data))
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    store = KVStore(tiers={"disk": {"path": tmpfs}})
    assert hit(store, bad) is None  # a miss; its file cannot be removed
    assert store.stats.corrupt == 1 and store.stats.delete_errors == 1
    assert store.disk.locate_many(bad.block_keys) == [None, None] and store.stats.disk_reads == 1, "not offered again"
    got = store.get(good.key)
    assert got is not None and same_bytes(got, good)
    assert store.put(chunk(3)) and store.stats.write_errors == 1  # kept in memory, not on disk
    assert store.get(chunk(3).key) is not None


# ---- damaged, planted and swapped files ---------------------------------------------------
def header_span(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    start = len(chunk_format._MAGIC) + 8
    (length,) = struct.unpack_from("<Q", data, len(chunk_format._MAGIC))
    return start, start + length


def test_single_bit_flips_in_a_header_are_never_fatal(tmp_path: Path) -> None:
    """Every bit of the header flipped in turn (thousands of files): the store starts,
    and a lookup either misses or returns exactly the stored bytes."""
    original = chunk(1)
    KVStore(tiers={"disk": {"path": tmp_path}}).put(original)
    path = file_of(tmp_path, original)
    clean = path.read_bytes()
    _, end = header_span(path)
    outcomes = {"hit": 0, "miss": 0}
    for bit in range(0, 8 * end, 3):
        data = bytearray(clean)
        data[bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(bytes(data))
        store = KVStore(tiers={"disk": {"path": tmp_path}})
        got = hit(store, original)
        if got:
            assert same_bytes(got, original)
            outcomes["hit"] += 1
        else:
            outcomes["miss"] += 1
    assert outcomes["miss"] > 0.9 * sum(outcomes.values())


def test_a_chunk_of_the_last_format_is_refused_with_one_line_saying_so(tmp_path: Path, caplog) -> None:
    """A KVLAB-CHUNK-1 file (its signature also named the writer's layout) is a miss, dropped
    and recomputed, with a log line that names both formats; never read as today's."""
    original = chunk(1)
    KVStore(tiers={"disk": {"path": tmp_path}}).put(original)
    path = file_of(tmp_path, original)
    path.write_bytes(path.read_bytes().replace(b"KVLAB-CHUNK-2\n", b"KVLAB-CHUNK-1\n", 1))
    store = KVStore(tiers={"disk": {"path": tmp_path}})
    with caplog.at_level("WARNING"):
        assert hit(store, original) is None
    assert not path.exists() and "a chunk of format KVLAB-CHUNK-1, not this kvlab's KVLAB-CHUNK-2" in caplog.text


def write_raw(path: Path, header: object, payload: bytes = b"") -> None:
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(chunk_format._MAGIC + struct.pack("<Q", len(head)) + head + payload)


HAND_MADE = {
    "a list": [1, 2, 3],
    "null": None,
    "a string": "block_keys",
    "keys not a list": {"block_keys": "abc"},
    "keys of the wrong type": {"block_keys": [1, 2]},
    "deep nesting": b"[" * 100_000 + b"]" * 100_000,
    "huge numbers": {"block_keys": ["0" * 32], "signature": "s", "crc": 1, "layout": "LBHNC", "num_blocks": 1,
                     "geometry": {"name": "x", "num_layers": 10 ** 9, "num_kv_heads": 10 ** 9, "head_size": 64,
                                  "dtype": "bfloat16", "block_size": 16, "kv_lora_rank": None,
                                  "qk_rope_head_dim": None}, "tensors": []},
    "not utf-8": b"\xff\xfe{}",
    "a length past the end": None,  # written specially below
}


@pytest.mark.parametrize("case", list(HAND_MADE))
def test_hand_made_headers_are_skipped_and_counted(tmp_path: Path, case: str) -> None:
    path = tmp_path / f"{'0' * 32}.kvchunk"
    if case == "a length past the end":
        path.write_bytes(chunk_format._MAGIC + struct.pack("<Q", 2 ** 63) + b"{}")
    else:
        write_raw(path, HAND_MADE[case])
    store = KVStore(tiers={"disk": {"path": tmp_path}})  # starts
    assert store.disk.locate("0" * 32) is None and store.get("0" * 32) is None
    assert store.stats.bad_headers + store.stats.corrupt >= 1
    c = chunk(1)
    assert store.put(c) and store.get(c.key) is c  # and works


def test_a_planted_key_never_deletes_outside_the_folder(tmp_path: Path) -> None:
    folder, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    elsewhere.mkdir()
    precious = elsewhere / "precious.kvchunk"
    precious.write_text("keep me")
    c = chunk(1)
    KVStore(tiers={"disk": {"path": folder}}).put(c)
    path = file_of(folder, c)
    start, end = header_span(path)
    data = path.read_bytes()
    header = json.loads(data[start:end])
    header["block_keys"][0] = "../elsewhere/precious"
    write_raw(path, header, data[end:])
    store = KVStore(tiers={"disk": {"path": folder}})
    hit(store, c), store.get(c.key), store.discard(c.key)
    with pytest.raises(ValueError, match="not a chunk key"):
        store.disk.discard("../elsewhere/precious")
    assert precious.read_text() == "keep me"


def test_swapped_files_are_misses_and_the_budget_holds(tmp_path: Path) -> None:
    a, b = chunk(1), chunk(2)
    writer = KVStore(tiers={"disk": {"path": tmp_path}})
    writer.put(a), writer.put(b)
    pa, pb = file_of(tmp_path, a), file_of(tmp_path, b)
    data_a, data_b = pa.read_bytes(), pb.read_bytes()
    pa.write_bytes(data_b), pb.write_bytes(data_a)
    budget = 3 * a.nbytes
    store = KVStore(capacity_bytes=budget, tiers={"disk": {"path": tmp_path}})
    for _ in range(5):
        assert hit(store, a) is None and hit(store, b) is None
        assert store.get(a.key) is None and store.get(b.key) is None
    assert store.bytes == 0
    for tag in range(3, 9):  # new chunks are still kept, within the budget
        assert store.put(chunk(tag))
        assert store.bytes <= budget
    assert hit(store, chunk(8))


def test_chunks_read_from_disk_respect_the_memory_budget(tmp_path: Path) -> None:
    chunks = [chunk(tag) for tag in range(6)]
    writer = KVStore(tiers={"disk": {"path": tmp_path}})
    for c in chunks:
        writer.put(c)
    store = KVStore(capacity_bytes=2 * chunks[0].nbytes, tiers={"disk": {"path": tmp_path}})
    for c in chunks:
        got = store.get(c.key)
        assert got is not None and same_bytes(got, c)
        assert store.bytes <= 2 * chunks[0].nbytes
    assert len(store) == 2


# ---- disk housekeeping ----------------------------------------------------------------------
def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_leftovers_of_killed_writers_are_removed_and_counted(tmp_path: Path) -> None:
    host = KVStore(tiers={"disk": {"path": tmp_path}}).disk._host
    dead_new = tmp_path / f"{'a' * 32}.{host}-{dead_pid()}.tmp"
    dead_old = tmp_path / f"{'b' * 32}.tmp{dead_pid()}"
    live = tmp_path / f"{'c' * 32}.{host}-{os.getpid()}.tmp"
    for path in (dead_new, dead_old, live):
        path.write_bytes(b"x" * 1000)
    store = KVStore(tiers={"disk": {"path": tmp_path, "bytes": chunk(0).nbytes + 8000}})
    assert not dead_new.exists() and not dead_old.exists() and live.exists()
    assert store.stats.stale_tmp_removed == 2
    assert sum(size for _, size, _ in store.disk._files()) == 1000, "a live writer's file counts toward the budget"


def test_a_chunk_larger_than_the_disk_budget_is_not_written(tmp_path: Path) -> None:
    store = KVStore(tiers={"disk": {"path": tmp_path, "bytes": 1000}})
    assert store.put(chunk(1))  # in memory
    assert not list(tmp_path.glob("*.kvchunk")) and store.stats.disk_skipped == 1


def test_disk_eviction_follows_use_not_write_time(tmp_path: Path) -> None:
    a, b, c, d = (chunk(tag) for tag in range(4))
    size = file_of_size(tmp_path, a)
    store = KVStore(capacity_bytes=a.nbytes, tiers={"disk": {"path": tmp_path, "bytes": 3 * size}})
    for x in (a, b, c):
        store.put(x)
        age(tmp_path, x)
    for _ in range(3):
        assert hit(store, a, tier="disk")  # a is read from disk: it is the newest there now
    store.put(d)
    assert file_of(tmp_path, a).exists() and not file_of(tmp_path, b).exists()


def test_a_prompts_head_outlives_its_tail(tmp_path: Path) -> None:
    """A worker fetches a load's chunks from the last to the first, so they are marked used in
    that order and a prompt's head outlives its tail, as vLLM frees its own blocks."""
    head, tail, other = chunk(1), chunk(2), chunk(3)
    size = file_of_size(tmp_path, head)
    store = KVStore(capacity_bytes=head.nbytes, tiers={"disk": {"path": tmp_path, "bytes": 2 * size}})
    store.put(tail), store.put(head)
    assert hit(store, tail, tier="disk") and hit(store, head, tier="disk")
    store.put(other)
    assert file_of(tmp_path, head).exists() and not file_of(tmp_path, tail).exists()


def file_of_size(folder: Path, c: Chunk) -> int:
    probe = KVStore(tiers={"disk": {"path": folder / "probe"}})
    probe.put(c)
    return file_of(folder / "probe", c).stat().st_size


def age(folder: Path, c: Chunk, seconds: float = 1.0) -> None:
    """Make files written in one test look written in order (mtime resolution)."""
    for path in folder.glob("*.kvchunk"):
        stat = path.stat()
        os.utime(path, (stat.st_atime - seconds, stat.st_mtime - seconds))


# ---- two processes on one folder --------------------------------------------------------------
def _hammer(folder: str, worker: int, puts: int, queue) -> None:
    errors, wrong, hits = 0, 0, 0
    # Memory holds one chunk, so the previous put is read back from the shared folder: hits do
    # not depend on how the two processes happen to interleave (a chunk the other one wrote may
    # or may not be there).
    store = KVStore(capacity_bytes=chunk(0).nbytes, tiers={"disk": {"path": folder, "bytes": 12 * chunk(0).nbytes}})
    for i in range(puts):
        tag = (i * 7 + worker) % 40
        try:
            store.put(chunk(tag))
            for other in (chunk((tag + 3) % 40), chunk(((i - 1) * 7 + worker) % 40)):
                got = hit(store, other)
                if got:
                    hits += 1
                    wrong += not same_bytes(got, other)
        except Exception:  # noqa: BLE001 - counting is the point
            errors += 1
    queue.put((errors, wrong, hits, store.stats.write_errors))


def test_two_processes_share_one_folder(tmp_path: Path) -> None:
    """Atomic writes and tolerant trimming: 2 x 600 puts and lookups at once, racing to
    evict each other's files, without an error or a wrong hit."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    procs = [context.Process(target=_hammer, args=(str(tmp_path), w, 600, queue)) for w in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert [r[0] for r in results] == [0, 0], "no call raised"
    assert [r[1] for r in results] == [0, 0], "no lookup returned other bytes"
    assert all(r[2] > 0 for r in results), "each process read chunks back from the folder"
    assert [r[3] for r in results] == [0, 0]


def test_a_chunk_another_process_wrote_is_found(tmp_path: Path) -> None:
    reader = KVStore(tiers={"disk": {"path": tmp_path}})
    c = chunk(1)
    assert hit(reader, c) is None and reader.tier("disk").locate(c.key) is None
    KVStore(tiers={"disk": {"path": tmp_path}}).put(c)  # another process
    assert reader.tier("disk").locate_many(c.block_keys) == [(c.key, 0), (c.key, 1)]  # the scheduler's lookup
    got = hit(reader, c)  # the worker's read
    assert got is not None and same_bytes(got, c)


# ---- keys ----------------------------------------------------------------------------------------
def test_fingerprint_follows_the_weights_not_the_path(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    weights = model / "model.safetensors"
    weights.write_bytes(bytes(300_000))
    before = folder_fingerprint(model)
    assert folder_fingerprint(model) == before
    data = bytearray(weights.read_bytes())
    data[10] = 1  # the same size, one value changed
    stat = weights.stat()
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even with its old time
    assert folder_fingerprint(model) != before
    assert folder_fingerprint(tmp_path / "no-such-folder") == ""


def test_extra_keys_change_every_hash_from_their_block_on() -> None:
    tokens = list(range(64))
    plain = block_hashes(tokens, 16, "m")
    salted = block_hashes(tokens, 16, "m", [b"salt", None, None, None])
    assert all(x != y for x, y in zip(plain, salted))
    late = block_hashes(tokens, 16, "m", [None, None, b"image", None])
    assert late[:2] == plain[:2] and all(x != y for x, y in zip(late[2:], plain[2:]))
    assert block_hashes(tokens, 16, "m", [None] * 4) == plain
