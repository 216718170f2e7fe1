"""Tensor-parallel shards of the KV: with the model's ``H`` kv heads split over ``p`` ranks,
rank ``r`` holds heads ``r*H/p`` to ``(r+1)*H/p - 1`` (vLLM's split), and stores its
shard of each chunk under its own keys (kvlab.store.keys.shard_key). A rank of another
tensor-parallel size reads its heads out of the shards that hold them: one shard of a
TP=1 chunk sliced, or parts of several shards gathered."""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.transfer.plan import HeadSlice


@dataclass(frozen=True)
class ShardRead:
    """What one rank takes from one writer's shard of a chunk: the writer's rank and which
    of its heads go where in the reader's cache (None: a shard of the reader's own size,
    every head where it lies)."""

    shard: int
    heads: HeadSlice | None


def writer_sizes(total_heads: int | None, workers: int) -> list[int]:
    """The tensor-parallel sizes whose chunks a rank of ``workers`` can read: its own first,
    then every other size that splits the ``total_heads`` evenly, smallest first. Only its
    own where the heads are not split (None: an MLA latent, the same on every rank; or
    fewer heads than ranks, which vLLM replicates)."""
    if total_heads is None or total_heads % workers:
        return [workers]
    return [workers, *(p for p in range(1, total_heads + 1) if total_heads % p == 0 and p != workers)]


def shard_reads(total_heads: int, rank: int, workers: int, writers: int) -> list[ShardRead]:
    """The shards of a chunk stored by ``writers`` ranks that hold some of the heads rank
    ``rank`` of ``workers`` holds, in head order, each with the heads taken from it."""
    for size in (workers, writers):
        if size < 1 or total_heads % size:
            raise ValueError(f"{total_heads} kv heads do not split evenly over {size} ranks")
    if not 0 <= rank < workers:
        raise ValueError(f"rank {rank} is not one of {workers}")
    mine, theirs = total_heads // workers, total_heads // writers
    first, last = rank * mine, (rank + 1) * mine
    out = []
    for shard in range(first // theirs, (last - 1) // theirs + 1):
        start, end = max(first, shard * theirs), min(last, (shard + 1) * theirs)
        out.append(ShardRead(shard, HeadSlice(start - shard * theirs, start - first, end - start)))
    return out
