"""kvlab.store against other writers and a filesystem that fills for a while: a budget a
full disk lowered comes back; a folder another local user owns or can write is refused and
a new one is created 0700; with ``auth_key`` a chunk without a valid MAC is refused, even
one whose CRC is right."""

from __future__ import annotations

import errno
import json
import os
import struct
import time
import types
from functools import partial
from pathlib import Path

import pytest
import torch

from kvlab.cache import ModelGeometry
from kvlab.harness.chunks import random_chunk, same_bytes
from kvlab.store import RETRY_FIRST_S, Chunk, KVStore, RedisTier, StoreStats, tiers
from kvlab.store import chunk as chunk_format

GEOMETRY = ModelGeometry("trust-test", 2, 2, 32, torch.bfloat16, 16)
chunk = partial(random_chunk, GEOMETRY, salt="t")


KEY, OTHER_KEY = b"k" * 32, b"o" * 32


def hit(store: KVStore, c: Chunk, **options: object) -> Chunk | None:
    """``c`` as a worker fetches it (the production path): its signature and blocks."""
    return store.get(c.key, c.signature, blocks=dict(enumerate(c.block_keys)), **options)


def files(folder: Path) -> list[Path]:
    return list(folder.glob("*.kvchunk"))


def split(data: bytes) -> tuple[dict, bytes]:
    start = len(chunk_format._MAGIC) + 8
    (length,) = struct.unpack_from("<Q", data, len(chunk_format._MAGIC))
    return json.loads(data[start:start + length]), data[start + length:]


def join(header: dict, payload: bytes) -> bytes:
    head = json.dumps(header).encode()
    return chunk_format._MAGIC + struct.pack("<Q", len(head)) + head + payload


# ---- a budget a full disk lowered comes back ---------------------------------------------------
def test_a_budget_a_full_disk_lowered_comes_back(tmp_path: Path, monkeypatch) -> None:
    """ENOSPC lowers the limit to what the folder holds, for 1 s, then the budget is tried
    in full again; a new ENOSPC lowers it again, for twice as long while it stays full."""
    now = [1000.0]
    monkeypatch.setattr(tiers.backoff, "time", types.SimpleNamespace(monotonic=lambda: now[0], time=time.time))
    store = KVStore(capacity_bytes=chunk(0).nbytes, tiers={"disk": {"path": tmp_path, "bytes": 40 * chunk(0).nbytes}})
    disk, write, full = store.disk, store.disk._write, [0]

    def flaky(c: Chunk) -> None:
        if full[0]:
            full[0] -= 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write(c)

    monkeypatch.setattr(disk, "_write", flaky)
    assert store.put(chunk(0))
    full[0] = 1
    for tag in range(1, 4):  # the first write fails: the limit is one file until the back-off ends
        assert store.put(chunk(tag))
        assert len(files(tmp_path)) == 1
    assert disk.capacity_bytes < disk.budget_bytes == 40 * chunk(0).nbytes
    now[0] += RETRY_FIRST_S
    for tag in range(4, 9):
        assert store.put(chunk(tag))
    assert disk.capacity_bytes == disk.budget_bytes and len(files(tmp_path)) == 6, "space came back"
    assert store.stats.write_errors == 0 and store.stats.disk_skipped == 0

    full[0] = 1  # full again, after the space came back: lowered for 1 s
    assert store.put(chunk(9)) and disk.capacity_bytes < disk.budget_bytes
    now[0] += RETRY_FIRST_S
    full[0] = 1  # still full when the budget is tried again: lowered for twice as long
    assert store.put(chunk(10)) and disk.capacity_bytes < disk.budget_bytes
    now[0] += RETRY_FIRST_S
    assert store.put(chunk(11)) and disk.capacity_bytes < disk.budget_bytes and len(files(tmp_path)) == 6
    now[0] += RETRY_FIRST_S
    assert store.put(chunk(12)) and store.put(chunk(13)) and disk.capacity_bytes == disk.budget_bytes
    assert len(files(tmp_path)) == 8 and store.stats.write_errors == 0
    got = KVStore(tiers={"disk": {"path": tmp_path}}).get(chunk(13).key)
    assert got is not None and same_bytes(got, chunk(13))


# ---- folders other local users can write ----------------------------------------------------
@pytest.mark.parametrize("tier", ["disk", "shm"])
def test_a_folder_others_can_write_is_refused(tmp_path: Path, tier: str) -> None:
    for mode in (0o777, 0o1777, 0o770, 0o702):
        folder = tmp_path / f"open-{mode:o}"
        folder.mkdir()
        folder.chmod(mode)
        with pytest.raises(ValueError, match=rf"{tier}_path {folder} is owned by uid {os.geteuid()} with mode "
                                             rf"{mode:04o}.*cannot write.*chmod go-w"):
            KVStore(tiers={tier: {"path": folder}})
    mine = tmp_path / "mine"
    mine.mkdir()
    mine.chmod(0o755)  # this user's, others may read: accepted as it is
    c = chunk(1)
    assert KVStore(capacity_bytes=1, tiers={tier: {"path": mine}}).put(c) and len(files(mine)) == 1
    assert mine.stat().st_mode & 0o7777 == 0o755


def test_a_folder_of_another_user_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o700)
    try:
        os.chown(folder, 65534, 65534)
    except PermissionError:
        pytest.skip("chown needs root")
    with pytest.raises(ValueError, match=rf"disk_path {folder} is owned by uid 65534 with mode 0700"):
        KVStore(tiers={"disk": {"path": folder}})


def test_a_pre_created_open_shared_memory_folder_is_refused() -> None:
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm here")
    folder = Path("/dev/shm") / f"kvlab-trust-test-{os.getpid()}"
    folder.mkdir()
    try:
        folder.chmod(0o777)  # as another user would leave it for the victim's default store_name
        with pytest.raises(ValueError, match="shm_path .* mode 0777"):
            KVStore(tiers={"shm": {"path": folder}})
        assert not files(folder)
    finally:
        folder.rmdir()


@pytest.mark.parametrize("tier", ["disk", "shm"])
def test_missing_folders_are_created_private_whatever_the_umask(tmp_path: Path, tier: str) -> None:
    previous = os.umask(0o002)
    try:
        store = KVStore(tiers={tier: {"path": tmp_path / "a" / "b" / "kv"}})
    finally:
        os.umask(previous)
    for folder in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "kv"):
        assert folder.stat().st_mode & 0o7777 == 0o700, folder
    assert store.put(chunk(1)) and len(files(tmp_path / "a" / "b" / "kv")) == 1


# ---- auth_key: keyed MACs -------------------------------------------------------------------
@pytest.mark.parametrize("tier", ["disk", "shm"])
def test_a_keyed_store_reads_its_own_chunks_back_bitwise(tmp_path: Path, tier: str) -> None:
    c = chunk(1)
    assert KVStore(tiers={tier: {"path": tmp_path}}, auth_key=KEY).put(c)
    header, _ = split(files(tmp_path)[0].read_bytes())
    assert len(header["mac"]) == 64 and int(header["mac"], 16) >= 0
    keyed = KVStore(tiers={tier: {"path": tmp_path}}, auth_key=KEY)
    got = hit(keyed, c)
    assert got is not None and same_bytes(got, c) and keyed.stats.forged == 0 and keyed.stats.corrupt == 0
    unkeyed = KVStore(tiers={tier: {"path": tmp_path}})  # without a key the mac is ignored
    got = unkeyed.get(c.key)
    assert got is not None and same_bytes(got, c)
    KVStore(tiers={tier: {"path": tmp_path}}).put(chunk(2))  # and the unkeyed format is unchanged
    assert "mac" not in split((tmp_path / f"{chunk(2).key}.kvchunk").read_bytes())[0]


def forge(path: Path, how: str) -> None:
    """Rewrite a keyed chunk's file as a writer without the key could: other bytes with a
    valid CRC, and no mac, a mac of another key, the genuine mac, or a header changed."""
    genuine = path.read_bytes()
    header, payload = split(genuine)
    c = chunk(1, fill=99)
    assert c.key == header["block_keys"][-1]
    if how == "no mac":
        data = chunk_format.encode_header(c) + b"".join(chunk_format.payload(c))
    elif how == "another key":
        data = chunk_format.encode_header(c, OTHER_KEY) + b"".join(chunk_format.payload(c))
    elif how == "the genuine mac":
        forged, forged_payload = split(chunk_format.encode_header(c) + b"".join(chunk_format.payload(c)))
        data = join({**forged, "mac": header["mac"]}, forged_payload)
    else:  # the genuine payload, another signature, the genuine mac
        data = join({**header, "signature": "another model"}, payload)
    path.write_bytes(data)


@pytest.mark.parametrize("how", ["no mac", "another key", "the genuine mac", "a header changed"])
@pytest.mark.parametrize("tier", ["disk", "shm"])
def test_a_chunk_rewritten_without_the_key_is_refused(tmp_path: Path, tier: str, how: str) -> None:
    c = chunk(1)
    KVStore(tiers={tier: {"path": tmp_path}}, auth_key=KEY).put(c)
    path = files(tmp_path)[0]
    forge(path, how)
    assert KVStore(tiers={tier: {"path": tmp_path}}).get(c.key) is not None, "its CRC is valid: only a key tells"
    keyed = KVStore(tiers={tier: {"path": tmp_path}}, auth_key=KEY)
    assert hit(keyed, c) is None and keyed.get(c.key) is None
    assert keyed.stats.forged == 1 and keyed.stats.corrupt == 1 and not path.exists()


def test_a_redis_value_rewritten_without_the_key_is_refused(redis_server) -> None:
    stats = StoreStats()
    tier = RedisTier(redis_server.url, stats, auth_key=KEY)
    c = chunk(1)
    assert tier.put(c)
    got = tier.get(c.key)
    assert got is not None and same_bytes(got, c)
    forged = chunk(1, fill=99)
    tier.client.set(tier.PREFIX + "c:" + c.key, chunk_format.encode_header(forged, OTHER_KEY)
                    + b"".join(chunk_format.payload(forged)))
    assert tier.get(c.key) is None and stats.forged == 1 and stats.corrupt == 1
    assert not tier.client.exists(tier.PREFIX + "c:" + c.key)


@pytest.mark.parametrize("change", [{"mac": 5}, {"mac": None}, {"mac": "ab"}, {"mac": "A" * 64}, {"mac": "0" * 65},
                                    {"another field": 1}])
def test_a_mac_of_the_wrong_type_or_another_field_is_a_bad_header(tmp_path: Path, change: dict) -> None:
    c = chunk(1)
    KVStore(tiers={"disk": {"path": tmp_path}}, auth_key=KEY).put(c)
    path = files(tmp_path)[0]
    header, payload = split(path.read_bytes())
    path.write_bytes(join({**header, **change}, payload))
    store = KVStore(tiers={"disk": {"path": tmp_path}})
    assert store.get(c.key) is None and store.stats.bad_headers == 1 and store.stats.corrupt == 1


@pytest.mark.parametrize("key", [b"short", "a string of 32 characters or so.."])
def test_auth_key_must_be_bytes_of_some_length(key: object) -> None:
    with pytest.raises(ValueError, match="auth_key must be at least 16 bytes"):
        KVStore(auth_key=key)


def test_a_keyed_shared_memory_tier_reads_a_private_copy(tmp_path: Path) -> None:
    """A mapped file shows whatever is written to it later: after the MAC check a writer
    without the key could change the bytes before they are loaded. With a key the bytes
    are read into memory instead."""
    c = chunk(1)
    KVStore(tiers={"shm": {"path": tmp_path}}, auth_key=KEY).put(c)
    got = KVStore(tiers={"shm": {"path": tmp_path}}, auth_key=KEY).get(c.key)
    assert got is not None and same_bytes(got, c)
    path = files(tmp_path)[0]
    with open(path, "r+b") as f:  # in place, as a writer without the key could
        f.seek(-4096, os.SEEK_END)
        f.write(bytes(4096))
    assert same_bytes(got, c)


def test_chunk_files_are_this_users_alone(tmp_path) -> None:
    """Other local users can neither write nor read the stored KV (a prompt can be read back
    from its KV), whatever the umask."""
    old = os.umask(0o002)
    try:
        KVStore(tiers={"disk": {"path": tmp_path / "kv"}}).put(chunk(1))
    finally:
        os.umask(old)
    (path,) = (tmp_path / "kv").glob("*.kvchunk")
    assert path.stat().st_mode & 0o777 == 0o600
