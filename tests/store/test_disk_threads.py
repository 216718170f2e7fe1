"""The disk tier under the worker's three threads at once: two fetch threads reading, touching
and looking chunks up while the save thread writes, evicts and forgets them, as
KVLabConnector's worker drives one tier (kvlab.connector.worker). Nothing raises, every
chunk read back is the one written, the index names only chunks it holds, and no two uses
are stamped alike (eviction order follows use)."""

from __future__ import annotations

import random
import sys
import threading
import time
import traceback
import types
from functools import partial
from pathlib import Path

import pytest
import torch

from kvlab.cache import ModelGeometry
from kvlab.harness.chunks import random_chunk, same_chunk
from kvlab.store.tiers import StoreStats
from kvlab.store.tiers import disk as disk_module
from kvlab.store.tiers.disk import DiskTier

GEOMETRY = ModelGeometry("threads-test", 1, 1, 8, torch.float16, 4)
chunk = partial(random_chunk, GEOMETRY, blocks=4, salt="threads")
ROUNDS = 1000


class Yielding(dict):
    """The tier's block index, letting other threads run after every read and removal: where a
    lock does not keep them out, another thread changes the index in between."""

    def get(self, *args):  # noqa: ANN002, ANN201
        found = super().get(*args)
        time.sleep(0)
        return found

    def __delitem__(self, key) -> None:  # noqa: ANN001
        time.sleep(0)
        super().__delitem__(key)


@pytest.fixture
def busy_switching():
    """Threads switch every microsecond (CPython's default is 5 ms): a race a lock leaves
    open shows within a second instead of once a day."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def test_two_fetch_threads_and_a_save_thread_with_evictions(tmp_path: Path, monkeypatch, busy_switching) -> None:
    # a prompt stored in chunks of two and of four blocks: chunks share block keys, as two
    # engines of other chunk sizes over one folder make them
    chunks = [chunk(i, blocks=blocks) for i in range(12) for blocks in (2, 4)]
    tier = DiskTier(tmp_path, 6 * chunks[1].nbytes, StoreStats())  # room for six to twelve: most writes evict
    monkeypatch.setattr(disk_module, "INDEXED_CHUNKS", 4)  # the index forgets too
    monkeypatch.setattr(disk_module, "RECOUNT_S", 0.0)  # every write counts the folder
    stamps: list[int] = []
    utime = tier._folder.utime
    monkeypatch.setattr(tier._folder, "utime", lambda name, ns: stamps.append(ns[1]) or utime(name, ns))
    # one clock tick for the whole test: each use is stamped one nanosecond after the one before
    monkeypatch.setattr(disk_module, "time", types.SimpleNamespace(time_ns=lambda: 0, time=time.time,
                                                                   monotonic=time.monotonic))
    tier._index = Yielding()
    errors: list[BaseException] = []
    wrong: list[str] = []

    def guarded(work) -> None:  # noqa: ANN001
        try:
            work()
        except BaseException as error:  # noqa: BLE001 - what the test reports
            errors.append(error)

    def fetch(seed: int) -> None:
        pick = random.Random(seed)
        for _ in range(ROUNDS):
            c = pick.choice(chunks)
            tier.locate_many(c.block_keys)
            got = tier.get(c.key)
            if got is not None and not same_chunk(got, c):
                wrong.append(c.key)
            tier.touch(c.key)
            tier.identity(c.key)

    def save() -> None:
        pick = random.Random(2)
        for _ in range(ROUNDS // 2):
            tier.put(pick.choice(chunks))
            if pick.random() < 0.2:
                tier.discard(pick.choice(chunks).key)

    threads = [threading.Thread(target=guarded, args=(partial(fetch, seed),)) for seed in (0, 1)]
    threads.append(threading.Thread(target=guarded, args=(save,)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [f"{e!r} in {traceback.extract_tb(e.__traceback__)[-1].name}" for e in errors] == [] and wrong == []
    indexed = {entry[0] for entry in tier._index.values()}
    assert indexed <= set(tier._chunk_blocks), "the index names a chunk it forgot"
    assert len(stamps) == len(set(stamps)), "two uses were stamped alike"
