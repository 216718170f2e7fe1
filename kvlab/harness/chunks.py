"""Sealed chunks of random bytes for the store's tests, and how two chunks are compared:
every tier is tested on the same kind of chunk."""

from __future__ import annotations

import torch

from kvlab.cache.allocation import allocate
from kvlab.cache.geometry import ModelGeometry
from kvlab.store.chunk import Chunk
from kvlab.store.keys import block_hashes, signature


def random_chunk(geometry: ModelGeometry, tag: int, blocks: int = 2, *, layout: str = "LBHNC", salt: str = "kvlab",
                 fill: int | None = None) -> Chunk:
    """``blocks`` blocks of random bytes (seeded by ``fill``, or ``tag``) under the keys of
    tokens ``tag * 1000`` on: another ``fill`` under the same keys is a forger's chunk."""
    buffer = allocate(layout, geometry, blocks)
    generator = torch.Generator().manual_seed(tag if fill is None else fill)
    for tensor in buffer.storage:
        tensor.view(-1).view(torch.int16).random_(generator=generator)
    tokens = list(range(tag * 1000, tag * 1000 + blocks * geometry.block_size))
    return Chunk(block_hashes(tokens, geometry.block_size, salt), buffer, signature(buffer)).seal()


def same_bytes(a: Chunk, b: Chunk) -> bool:
    """Tensor by tensor, the same bytes (a shard's chunk has other keys)."""
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8))
               for x, y in zip(a.buffer.storage, b.buffer.storage))


def same_chunk(a: Chunk, b: Chunk) -> bool:
    """The same block keys and the same bytes: what a tier read back must be."""
    return a.block_keys == b.block_keys and same_bytes(a, b)
