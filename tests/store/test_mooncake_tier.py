"""The mooncake tier against a real Mooncake Store (its master and a segment process on
loopback, kvlab.runtime.mooncake): chunks read back bitwise by another client, headers
checked without the payload, damage refused and dropped, a full store evicting instead of
failing, and a master or segment that dies absorbed as misses within seconds; a master killed
under load costs no more waiting than a Redis server killed under the same load, and a stalled
one one deadline."""

from __future__ import annotations

import os
import signal
import threading
import time
from functools import partial

import pytest
import torch

from kvlab.cache import ModelGeometry
from kvlab.harness.chunks import random_chunk, same_chunk
from kvlab.runtime import redis as redis_runtime
from kvlab.runtime.mooncake import MooncakeStore
from kvlab.runtime.servers import free_port
from kvlab.store import RETRY_FIRST_S, KVStore
from kvlab.store.tiers import MooncakeTier, RedisTier, StoreStats, Tier
from kvlab.store.tiers.mooncake import parse_mooncake_url
from kvlab.store.tiers.remote import CALL_TIMEOUT_S

GEOMETRY = ModelGeometry("mooncake-test", 4, 2, 64, torch.bfloat16, 16)  # 32 KiB per block
chunk = partial(random_chunk, GEOMETRY, blocks=4, salt="m")


def tier(url: str, namespace: str, stats: StoreStats | None = None) -> MooncakeTier:
    return MooncakeTier(f"{url}&namespace={namespace}", stats or StoreStats())


def test_another_client_reads_what_one_wrote_bitwise(mooncake_store, request) -> None:
    writer, reader = tier(mooncake_store.url, request.node.name), tier(mooncake_store.url, request.node.name)
    assert isinstance(writer, Tier)
    writer.check()
    stored = [chunk(tag) for tag in range(3)]
    assert all(writer.put(c) for c in stored)
    keys = [key for c in stored for key in c.block_keys]
    assert reader.locate_many(keys) == [(c.key, position) for c in stored for position in range(4)]
    assert reader.locate_many(["0" * 64]) == [None]
    headers = reader.describe_many([c.key for c in stored] + ["0" * 64])
    assert [h.block_keys for h in headers[:3]] == [c.block_keys for c in stored] and headers[3] is None
    assert all(same_chunk(reader.get(c.key), c) for c in stored)
    assert reader.get("0" * 64) is None and reader.stats.mooncake_reads == 3


def test_a_client_starts_and_stops_without_a_line_on_stderr(mooncake_store, request, capfd) -> None:
    """Mooncake's client logs some twenty glog lines on every start, straight to file
    descriptor 2 (a notebook showed each one, an "http=404 ... metadata not found" among them):
    the tier keeps them, and tells them only when the start failed."""
    import sys

    from kvlab.store.tiers.mooncake import captured_stderr

    client = tier(mooncake_store.url, request.node.name)
    client.check()
    client.close()
    assert capfd.readouterr().err == ""
    with captured_stderr() as lines:  # what it keeps and what it writes back
        os.write(2, b"I1207 05:21:18.175084  7954 client_metric.cpp:102] Client metrics enabled\nnot glog\n")
    sys.stderr.flush()
    assert lines == ["I1207 05:21:18.175084  7954 client_metric.cpp:102] Client metrics enabled", "not glog"]
    assert capfd.readouterr().err == "not glog\n"


def test_a_store_reads_it_through_its_lookup_order(mooncake_store, request) -> None:
    url = f"{mooncake_store.url}&namespace={request.node.name}"
    KVStore(tiers={"mooncake": {"url": url}}).put(chunk(7))
    other = KVStore(tiers={"mooncake": {"url": url}})
    fetched = other.fetch(chunk(7).key, tier="mooncake")
    assert fetched.chunk is not None and same_chunk(fetched.chunk, chunk(7))


def test_a_damaged_chunk_is_refused_and_dropped(mooncake_store, request) -> None:
    stats = StoreStats()
    writer, reader = tier(mooncake_store.url, request.node.name), tier(mooncake_store.url, request.node.name, stats)
    good = chunk(1)
    writer.put(good)
    name = f"{request.node.name}/c/{good.key}"
    value = bytearray(writer.client.get(name))
    value[-5] ^= 0x40
    assert writer.client.upsert(name, bytes(value)) == 0
    assert reader.get(good.key) is None and stats.corrupt == 1
    assert writer.client.is_exist(name) == 0, "dropped"
    assert reader.describe_many([good.key]) == [None], "its header went with it"


def test_a_full_store_evicts_the_oldest_and_never_fails_a_write(own_mooncake_store) -> None:
    """32 MiB of segment, 60 chunks of 1 MiB: the master evicts the least recently used,
    so the newest chunks are there, the oldest are not, and no write raised."""
    big = ModelGeometry("mooncake-big", 8, 4, 64, torch.bfloat16, 16)  # 128 KiB per block
    stats = StoreStats()
    writer = tier(own_mooncake_store.url, "full", stats)
    stored = 0
    for tag in range(60):
        stored += writer.put(random_chunk(big, tag, 8))
        time.sleep(0.02)  # past the 200 ms lease of older objects, now and then
    assert stored + stats.mooncake_full == 60 and stats.write_errors == 0
    assert own_mooncake_store.keys() < 60 * 10, "evicted"
    assert own_mooncake_store.master.metrics()["master_allocated_bytes"] <= 32 << 20
    assert writer.get(random_chunk(big, 0, 8).key) is None, "the oldest went"
    time.sleep(0.5)
    last = random_chunk(big, 60, 8)
    assert writer.put(last) and same_chunk(writer.get(last.key), last), "room again after eviction"


def test_the_master_down_at_start_up_is_a_clear_error_at_once() -> None:
    url = f"mooncake://127.0.0.1:{free_port()}?metadata_port={free_port()}"
    began = time.monotonic()
    with pytest.raises(ValueError, match="cannot reach the Mooncake master"):
        KVStore(tiers={"mooncake": {"url": url}}).check_shared()
    assert time.monotonic() - began < 10


@pytest.mark.parametrize("fault", ["master", "segment"])
def test_a_master_or_segment_that_dies_is_a_quick_miss(own_mooncake_store, fault: str) -> None:
    stats = StoreStats()
    one = tier(own_mooncake_store.url, "faults", stats)
    stored = chunk(3)
    assert one.put(stored) and same_chunk(one.get(stored.key), stored)
    (own_mooncake_store.kill_master if fault == "master" else own_mooncake_store.kill_segment)()
    began = time.monotonic()
    deadline = began + 10
    while time.monotonic() < deadline and one.get(stored.key) is not None:
        time.sleep(0.2)
    assert one.get(stored.key) is None and time.monotonic() - began < 10
    assert one.locate_many(stored.block_keys) in ([None] * 4, [(stored.key, i) for i in range(4)])
    assert not one.put(chunk(4)), "a write is skipped, not raised"
    assert stats.read_errors + stats.write_errors + stats.mooncake_full + stats.mooncake_skipped >= 1


def under_load(tier: Tier, kill, seconds: float = 7.0, kill_at: float = 1.5) -> dict[str, float]:
    """Two threads on ``tier`` as a connector's scheduler and worker use it, step after step (a
    lookup of a prompt's blocks and their headers; a chunk read and one written), with ``kill()``
    at ``kill_at`` s: the longest step after the kill, and the slower thread's steps per second
    from the end of the first back-off window (and one deadline) on, as a share of its own
    before the kill."""
    stored = [chunk(tag) for tag in range(8)]
    assert all(tier.put(c) for c in stored)
    began = time.monotonic()

    def lookup(i: int) -> None:
        tier.locate_many(stored[i % 8].block_keys)
        tier.describe_many([stored[i % 8].key])

    def load_and_save(i: int) -> None:
        tier.get(stored[i % 8].key)
        tier.put(chunk(100 + i))

    def run(step, steps: list[tuple[float, float]]) -> None:
        for i in range(10**6):
            if time.monotonic() - began > seconds:
                return
            start = time.monotonic()
            step(i)
            steps.append((start - began, time.monotonic() - start))
            time.sleep(0.01)

    steps: dict[str, list[tuple[float, float]]] = {"lookups": [], "loads and saves": []}
    threads = [threading.Thread(target=run, args=(step, steps[name]))
               for name, step in zip(steps, (lookup, load_and_save))]
    for thread in threads:
        thread.start()
    time.sleep(kill_at)
    kill()
    for thread in threads:
        thread.join()
    recovered = kill_at + RETRY_FIRST_S + CALL_TIMEOUT_S
    pace = [sum(start >= recovered for start, _ in own) / (seconds - recovered)
            / (sum(start < kill_at for start, _ in own) / kill_at) for own in steps.values()]
    return {"longest_wait_s": max(wait for own in steps.values() for start, wait in own if start + wait >= kill_at),
            "pace_after": min(pace)}


def test_a_master_killed_under_load_costs_no_more_than_a_dead_redis(own_mooncake_store, redis_server) -> None:
    """Mooncake's client blocks 4-9 s in each call to a dead master (a lookup when the back-off
    ended stalled the engine for 30 s of 45): each call now has a deadline, and a master that
    died is told at once. No step waits more than twice what it does when Redis dies (a wait
    under a second counted as one: this shared machine's load alone stalls a thread that long),
    and each thread runs at least at half its pace again once the first back-off window is over."""
    redis = under_load(RedisTier(redis_server.url, StoreStats()), lambda: redis_runtime.shut_down(redis_server.url))
    mooncake = under_load(MooncakeTier(own_mooncake_store.url, StoreStats()), own_mooncake_store.kill_master)
    assert redis["pace_after"] >= 0.5 and mooncake["pace_after"] >= 0.5, (redis, mooncake)
    assert mooncake["longest_wait_s"] <= 2 * max(redis["longest_wait_s"], 1.0), (redis, mooncake)


def test_a_stalled_master_costs_one_deadline(own_mooncake_store) -> None:
    """A master that stops answering but keeps its connections (SIGSTOP: a hung or overloaded
    host) held each call for a minute; now the first call waits one deadline, and while it
    still waits on the client every later call fails at once: misses, never a blocked step."""
    stats = StoreStats()
    one = tier(own_mooncake_store.url, "stalled", stats)
    stored = chunk(5)
    assert one.put(stored)
    master = own_mooncake_store.master.process.pid
    os.killpg(master, signal.SIGSTOP)
    try:
        waits, began = [], time.monotonic()
        while time.monotonic() - began < 3 * CALL_TIMEOUT_S:
            start = time.monotonic()
            assert one.locate_many(stored.block_keys) == [None] * 4
            waits.append(time.monotonic() - start)
            time.sleep(0.01)
    finally:
        os.killpg(master, signal.SIGCONT)
    blocked = [wait for wait in waits if wait > CALL_TIMEOUT_S / 2]
    assert max(waits) <= 1.5 * CALL_TIMEOUT_S and len(blocked) <= 3, blocked  # 3: the back-off windows begun in 6 s
    assert stats.read_errors >= 1


@pytest.mark.parametrize("url, message", [
    ("redis://127.0.0.1:1", "must start with mooncake://"),
    ("mooncake://127.0.0.1:50051", "metadata_port"),
    ("mooncake://127.0.0.1?metadata_port=8080", "mooncake://host:port"),
    ("mooncake://127.0.0.1:50051?metadata_port=8080&segment=1", "mooncake://host:port"),
    ("mooncake://127.0.0.1:50051?metadata_port=8080&namespace=a/b", "namespace"),
])
def test_bad_urls_are_named(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_mooncake_url(url)


def test_the_store_needs_a_positive_segment_size() -> None:
    with pytest.raises(ValueError, match="segment_mb"):
        MooncakeStore(segment_mb=0)
    with pytest.raises(ValueError, match="lease_ms must be a positive integer"):
        MooncakeStore(lease_ms=-1)
