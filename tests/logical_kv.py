"""KV read back bitwise whatever its layout: every head vector of a cache located through
``address_labels`` (kvlab.cache), not through the transfer module's own views, so a wrong
stride in a copy cannot hide itself. Shared by the transfer, connector and device tests."""

import functools

import torch

from kvlab.cache import address_labels, allocations


def random_bits(cache, seed=0):
    """Fill every byte of the cache's backing tensors at random (in place); returns the cache."""
    generator = torch.Generator().manual_seed(seed)
    for tensor in cache.storage:  # in place: no freed temporary holds these bytes for empty() to reuse
        tensor.view(-1).view(torch.uint8).random_(0, 256, generator=generator)
    return cache


@functools.cache
def _byte_map(layout, geometry, num_blocks):
    """For each (backing tensor, part): its head vectors of that part (row numbers), the
    ``kv_bytes`` rows they belong in, and the part's byte offset and width there."""
    g = geometry
    labels = address_labels(layout, g, num_blocks)
    flat = ((labels["layer"] * num_blocks + labels["block"]) * g.block_size + labels["token"]) * g.num_kv_heads
    flat += labels["head"]
    out, start = [], 0
    for index, alloc in enumerate(allocations(layout, g, num_blocks)):
        count = alloc.numel // alloc.sizes[-1]
        parts = labels["part"][start:start + count]
        for part in parts.unique().tolist():
            rows = (parts == part).nonzero().flatten()
            out.append((index, rows, flat[start:start + count][rows], sum(g.parts[:part]) * g.itemsize,
                        alloc.sizes[-1] * g.itemsize))
        start += count
    assert start == len(flat)
    return out


def kv_bytes(cache):
    """The cache as bytes ``[layer, block, token, head, content]``, each head's parts side by
    side (K then V, or latent then rope), whatever the layout: comparable across layouts."""
    g = cache.geometry
    out = torch.zeros(g.num_layers * cache.num_blocks * g.block_size * g.num_kv_heads, g.content_size * g.itemsize,
                      dtype=torch.uint8)
    for index, rows, where, offset, width in _byte_map(cache.layout.name, g, cache.num_blocks):
        vectors = cache.storage[index].reshape(-1).view(torch.uint8).view(-1, width)
        out[:, offset:offset + width].index_copy_(0, where, vectors.index_select(0, rows))
    return out.view(g.num_layers, cache.num_blocks, g.block_size, g.num_kv_heads, -1)


def assert_same_blocks(a, a_blocks, b, b_blocks, layers=None):
    """Block ``a_blocks[i]`` of ``a`` holds bitwise what block ``b_blocks[i]`` of ``b`` holds,
    in every layer (or ``layers``) and part."""
    a_bytes, b_bytes = kv_bytes(a), kv_bytes(b)
    g = a.geometry
    item = g.itemsize
    a_blocks, b_blocks = list(a_blocks), list(b_blocks)
    assert len(a_blocks) == len(b_blocks)
    for x, y in zip(a_blocks, b_blocks):
        for layer in range(g.num_layers) if layers is None else layers:
            for part, name in enumerate(g.part_names):
                lo, hi = sum(g.parts[:part]) * item, sum(g.parts[:part + 1]) * item
                assert torch.equal(a_bytes[layer, x, ..., lo:hi], b_bytes[layer, y, ..., lo:hi]), (
                    f"{a.layout.name} block {x} vs {b.layout.name} block {y}: layer {layer} {name} differs"
                )


def assert_other_blocks(cache, moved, before=None, layers=None):
    """Blocks outside ``moved`` (and, with ``layers``, other layers of moved blocks) hold
    ``before`` (a ``kv_bytes`` snapshot), or zeros."""
    now = kv_bytes(cache)
    expected = torch.zeros_like(now) if before is None else before
    keep = torch.ones(now.shape[:2], dtype=torch.bool)
    for layer in range(cache.geometry.num_layers) if layers is None else layers:
        keep[layer, list(moved)] = False
    bad = (now != expected).flatten(2).any(-1) & keep
    assert not bad.any(), f"{cache.layout.name}: (layer, block) {bad.nonzero().tolist()[:8]} changed"
