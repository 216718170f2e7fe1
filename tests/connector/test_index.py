"""kvlab.connector.index.MemoryIndex: the scheduler's books of the workers' memory tiers
(least recently used first, in the store's LRUBook): what is evicted, when, and what never is."""

from __future__ import annotations

import pytest

from kvlab.connector.index import MemoryIndex


def keys(tag: str, blocks: int = 2) -> tuple[str, ...]:
    return tuple(f"{tag}{i}" for i in range(blocks))


def stored(index: MemoryIndex, tag: str, nbytes: int = 10) -> tuple[str, ...]:
    """Reserve a chunk and have every worker report it stored."""
    block_keys = keys(tag)
    assert index.reserve(block_keys, nbytes) is not None
    index.acknowledge(block_keys[-1], index.workers)
    return block_keys


def test_least_recently_used_goes_first_at_capacity() -> None:
    index = MemoryIndex(30, workers=1)
    a, b, c = stored(index, "a"), stored(index, "b"), stored(index, "c")
    assert index.bytes == 30
    assert index.reserve(keys("d"), 10) == [a[-1]]  # the oldest
    assert a[-1] not in index and index.locate(a[0]) is None
    assert b[-1] in index and c[-1] in index and index.bytes == 30
    assert index.reserve(keys("e"), 21) is None, "d is pending: evicting b and c frees 20 bytes, not 21"
    index.acknowledge(keys("d")[-1], 1)
    assert index.reserve(keys("e"), 20) == [b[-1], c[-1]]


def test_touch_makes_a_chunk_the_last_to_go() -> None:
    index = MemoryIndex(30, workers=1)
    a, b, c = stored(index, "a"), stored(index, "b"), stored(index, "c")
    index.touch(a[-1])
    assert index.reserve(keys("d"), 10) == [b[-1]]
    index.touch(c[-1])
    assert index.reserve(keys("e"), 10) == [a[-1]]
    index.touch("not there")  # nothing happens


def test_a_chunk_larger_than_the_budget_or_already_there_is_not_reserved() -> None:
    index = MemoryIndex(30, workers=1)
    a = stored(index, "a")
    assert index.reserve(keys("big"), 31) is None and index.bytes == 10 and a[-1] in index
    assert index.reserve(a, 10) is None, "one reservation per chunk"


def test_locate_finds_each_block_and_forget_drops_them() -> None:
    index = MemoryIndex(100, workers=1)
    a = stored(index, "a")
    chunk_key, position, entry = index.locate(a[0])
    assert (chunk_key, position, entry.block_keys, entry.stored) == (a[-1], 0, a, True)
    assert index.locate(a[1])[:2] == (a[-1], 1)
    index.forget(a[-1])
    assert index.locate(a[0]) is None and a[-1] not in index and index.bytes == 0
    index.forget(a[-1])  # twice: nothing happens


def test_a_block_two_chunks_hold_stays_found_when_the_older_goes() -> None:
    index = MemoryIndex(100, workers=1)
    older = ("x", "a1")
    newer = ("x", "b1")
    index.reserve(older, 10), index.reserve(newer, 10)
    assert index.locate("x")[0] == "b1"
    index.forget("a1")
    assert index.locate("x")[:2] == ("b1", 0)


def test_a_pinned_or_pending_chunk_is_never_evicted() -> None:
    index = MemoryIndex(20, workers=2)
    a = keys("a")
    assert index.reserve(a, 10) == []
    index.acknowledge(a[-1], 1)
    assert index.locate(a[0])[2].stored is False and index.has_pending(), "one of two workers"
    index.acknowledge(a[-1], 1)
    assert not index.has_pending()
    b = stored(index, "b")
    index.pin(a[-1], 1)
    assert index.reserve(keys("c"), 10) == [b[-1]], "a is being loaded"
    assert index.reserve(keys("d"), 10) is None, "a pinned, c pending"
    index.pin(a[-1], -1)
    index.acknowledge(keys("c")[-1], 2)
    assert index.reserve(keys("d"), 10) == [a[-1]]


def test_clear_forgets_everything() -> None:
    index = MemoryIndex(100, workers=1)
    a = stored(index, "a")
    index.clear()
    assert a[-1] not in index and index.locate(a[0]) is None and index.bytes == 0 and not index.has_pending()


@pytest.mark.parametrize("capacity, workers, message", [(0, 1, "capacity_bytes"), (10, 0, "workers")])
def test_bad_settings(capacity: int, workers: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MemoryIndex(capacity, workers)
