"""kvlab.store.tiers: the registry the store and the connector's config read, the one
back-off every shared tier pauses with, the memory tier as a Tier like the others, and the
Redis tier's paused writes counted as its own."""

from __future__ import annotations

import logging
import os
import socket
import types
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
import torch

from kvlab.cache import ModelGeometry
from kvlab.connector.config import ConnectorConfig
from kvlab.harness.chunks import random_chunk
from kvlab.store import KVStore
from kvlab.store.tiers import (
    RETRY_FIRST_S,
    RETRY_MAX_S,
    Backoff,
    DiskSettings,
    MemoryTier,
    RedisTier,
    StoreStats,
    Tier,
    TierSettings,
    backoff,
    register_tier,
    shared_tier_names,
    tier_names,
    unregister_tier,
)
from kvlab.store.tiers.settings import check_bytes

GEOMETRY = ModelGeometry("tiers-test", 2, 2, 32, torch.bfloat16, 16)
chunk = partial(random_chunk, GEOMETRY, salt="t")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(backoff, "time", types.SimpleNamespace(monotonic=fake.monotonic))
    return fake


# ---- the registry -------------------------------------------------------------------------------
def test_the_built_in_tiers_in_lookup_order() -> None:
    assert tier_names()[:4] == ("memory", "shm", "disk", "redis")
    assert "memory" not in shared_tier_names() and {"shm", "disk", "redis"} <= set(shared_tier_names())


class ListTier:
    """A shared tier of a test's own: chunks in a dict."""

    name, shared = "listed", True

    def __init__(self, stats: StoreStats) -> None:
        self.stats, self.chunks = stats, {}

    def locate(self, block_key):  # noqa: ANN001, ANN201
        return None

    def locate_many(self, block_keys):  # noqa: ANN001, ANN201
        return [None] * len(block_keys)

    def get(self, chunk_key):  # noqa: ANN001, ANN201
        return self.chunks.get(chunk_key)

    def describe_many(self, chunk_keys):  # noqa: ANN001, ANN201
        return [self.chunks.get(key) for key in chunk_keys]

    def put(self, c):  # noqa: ANN001, ANN201
        self.chunks[c.key] = c
        return True

    def discard(self, chunk_key):  # noqa: ANN001, ANN201
        self.chunks.pop(chunk_key, None)

    def touch(self, chunk_key):  # noqa: ANN001, ANN201
        pass

    def identity(self, chunk_key):  # noqa: ANN001, ANN201
        return id(self.chunks.get(chunk_key)) if chunk_key in self.chunks else None

    def check(self):  # noqa: ANN201
        pass


@dataclass(frozen=True)
class ListSettings(TierSettings):
    """The test tier's one setting, checked as a tier checks its own."""

    most: int = 10

    FLAT_KEYS = {"listed_most": "most"}

    def __post_init__(self) -> None:
        check_bytes("most", self.most)


def test_a_registered_tier_opens_only_where_named_with_its_settings() -> None:
    opened = []
    register_tier("listed", lambda settings, store: opened.append(settings) or ListTier(store.stats),
                  settings=ListSettings)
    try:
        assert KVStore().shared == () and opened == [], "registered, but named by no store"
        store = KVStore(tiers={"listed": {"most": 3}})
        assert [t.name for t in store.shared] == ["listed"] and isinstance(store.tier("listed"), Tier)
        assert opened == [ListSettings(3)] and store.tiers == {"listed": ListSettings(3)}
        c = chunk(1)
        assert store.save(c).shared == ("listed",)
        store.evict([c.key])
        assert store.fetch(c.key, c.signature).tier == "listed"
        config = ConnectorConfig.parse({"tiers": ["memory", "listed"], "listed": {"most": 5}})
        assert config.shared_tiers == ("listed",) and config.store_options()["tiers"] == {"listed": ListSettings(5)}
        assert ConnectorConfig.parse({"tiers": ["listed"], "listed_most": 7}).tier_settings["listed"].most == 7
        with pytest.raises(ValueError, match="^the listed tier: most must be a positive integer"):
            KVStore(tiers={"listed": {"most": 0}})
        with pytest.raises(ValueError, match="KVLabConnector: listed is a setting of the listed tier, which tiers"):
            ConnectorConfig.parse({"listed": {"most": 5}})
    finally:
        unregister_tier("listed")
    assert "listed" not in tier_names()
    with pytest.raises(ValueError, match="tiers must name each of"):
        ConnectorConfig.parse({"tiers": ["memory", "listed"]})


def test_the_built_in_tiers_open_with_their_settings(tmp_path: Path) -> None:
    store = KVStore(tiers={"disk": {"path": tmp_path / "disk", "bytes": 1 << 20}, "shm": {"path": str(tmp_path / "shm")}})
    assert store.shared_names == ("shm", "disk") and store.disk.budget_bytes == 1 << 20
    assert store.tier("shm").path == tmp_path / "shm" and store.tier("shm").budget_bytes == 4 << 30
    assert store.tiers["disk"] == DiskSettings(str(tmp_path / "disk"), 1 << 20)


@pytest.mark.parametrize("name, factory, options, error, message", [
    ("Disk", lambda s, store: None, {}, ValueError, "lower-case"),
    ("", lambda s, store: None, {}, ValueError, "lower-case"),
    ("disk", lambda s, store: None, {}, ValueError, "registered already"),
    ("mine", "not callable", {}, TypeError, "must be callable"),
    ("mine", lambda s, store: None, {"settings": dict}, TypeError, "must be a TierSettings dataclass"),
    ("mine", lambda s, store: None, {"settings": DiskSettings}, ValueError, r"flat key\(s\) \['disk_bytes'"),
])
def test_bad_registrations(name: str, factory: object, options: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        register_tier(name, factory, **options)
    with pytest.raises(ValueError, match="no tier 'nothing'"):
        unregister_tier("nothing")


# ---- the back-off ---------------------------------------------------------------------------------
def test_the_back_off_doubles_up_to_the_max_and_a_success_resets_it(clock: Clock) -> None:
    b = Backoff()
    assert not b.paused
    assert b.fail() == RETRY_FIRST_S and b.paused
    clock.now += RETRY_FIRST_S
    assert not b.paused
    pauses = [b.fail() for _ in range(12)]
    assert pauses[:3] == [2 * RETRY_FIRST_S, 4 * RETRY_FIRST_S, 8 * RETRY_FIRST_S] and pauses[-1] == RETRY_MAX_S
    b.succeed()
    assert not b.paused and b.fail() == RETRY_FIRST_S


def test_each_kind_of_fault_is_logged_once(caplog) -> None:
    b = Backoff()
    with caplog.at_level(logging.WARNING, logger="kvlab.store"):
        for _ in range(3):
            b.log_once("read", "cannot read %s", "x")
            b.log_once("write", "cannot write")
    assert caplog.text.count("cannot read x") == 1 and caplog.text.count("cannot write") == 1


# ---- the memory tier is a Tier --------------------------------------------------------------------
def test_the_memory_tier_follows_the_protocol() -> None:
    tier = MemoryTier(3 * chunk(0).nbytes, StoreStats())
    assert isinstance(tier, Tier) and not tier.shared
    a, b = chunk(1), chunk(2)
    assert tier.put(a) and tier.put(b)
    assert tier.locate_many([a.block_keys[0], "nothing", b.block_keys[1]]) == [(a.key, 0), None, (b.key, 1)]
    before = tier.identity(a.key)
    assert before is not None and tier.identity("0" * 32) is None
    tier.touch(a.key)
    assert [c.key for c in tier.chunks()] == [b.key, a.key]
    tier.put(chunk(1))  # the same key, another chunk
    assert tier.identity(a.key) != before
    tier.check()


# ---- Redis: paused writes have their own counter ----------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_redis_paused_writes_are_redis_skipped_not_disk_skipped(clock: Clock, caplog) -> None:
    stats = StoreStats()
    tier = RedisTier(f"redis://127.0.0.1:{free_port()}/0", stats, timeout_s=0.5)  # nobody listens there
    with caplog.at_level(logging.WARNING, logger="kvlab.store"):
        assert not tier.put(chunk(1))
        assert not tier.put(chunk(2)) and not tier.put(chunk(3))
    assert (stats.write_errors, stats.redis_skipped, stats.disk_skipped) == (1, 2, 0)
    assert caplog.text.count("failed a write") == 1
    clock.now += RETRY_FIRST_S  # the pause is over: tried (and failed) again, paused twice as long
    assert not tier.put(chunk(4)) and stats.write_errors == 2
    clock.now += RETRY_FIRST_S
    assert not tier.put(chunk(5)) and stats.redis_skipped == 3


def test_every_built_in_tier_is_a_tier(tmp_path: Path) -> None:
    store = KVStore(tiers={"shm": {"path": tmp_path / "shm"}, "disk": {"path": tmp_path / "disk"}})
    assert all(isinstance(tier, Tier) for tier in (store.tier("memory"), *store.shared))
    assert isinstance(RedisTier(f"redis://127.0.0.1:{free_port()}/0", StoreStats()), Tier)


def test_a_store_without_the_built_in_memory_tier_is_refused() -> None:
    register_tier("memory", lambda settings, store: ListTier(store.stats), shared=False, replace=True)
    try:
        with pytest.raises(ValueError, match="exactly one tier of its process's own"):
            KVStore()
    finally:
        from kvlab.store.tiers.memory import open_memory

        register_tier("memory", open_memory, shared=False, replace=True)
    assert KVStore().tier("memory") is not None


def test_the_bulk_reader_reads_values_whole_and_names_what_it_cannot_read(redis_server) -> None:
    """kvlab's GET (a value read straight into memory of its own): the bytes redis-py reads,
    None for a missing key, an OSError naming an error reply, and a new connection after one."""
    from kvlab.store.tiers.resp import BulkReader

    client = redis_server.client()
    value = os.urandom(3 << 20) + b"\r\n$-1\r\n"  # a value that holds what replies are made of
    client.set("v", value)
    client.rpush("a list", "x")
    reader = BulkReader(client.connection_pool.connection_kwargs, timeout_s=5)
    assert bytes(reader.get("v")) == value and reader.get("missing") is None
    with pytest.raises(OSError, match="WRONGTYPE"):
        reader.get("a list")
    assert bytes(reader.get("v")) == value, "a fresh connection after the error"
    reader.close()


def test_what_is_the_stores_fault() -> None:
    """What the connector's strict mode still recomputes: an OSError, a failed check, a
    store's fault, an error raised from one, and the errors a tier names as its client's."""
    import redis

    from kvlab.store import FailedCheck, ForgedChunk, StoreFault, is_store_fault

    assert all(is_store_fault(e) for e in (OSError(28, "full"), FailedCheck("crc"), ForgedChunk("mac"), StoreFault()))
    assert not is_store_fault(TypeError("a bug")) and not is_store_fault(ValueError("a bug"))
    try:
        try:
            raise ConnectionError("reset")
        except ConnectionError as cause:
            raise RuntimeError("layerwise load failed") from cause
    except RuntimeError as wrapped:
        assert is_store_fault(wrapped)
    store = KVStore(tiers={"redis": {"url": f"redis://127.0.0.1:{free_port()}/0"}})
    assert is_store_fault(redis.ResponseError("LOADING"), store.faults) and not is_store_fault(redis.ResponseError())
