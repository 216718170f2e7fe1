"""A tiny pure-torch attention stack that writes its K/V into any kvlab layout, attends over
the cached prefix and calls the layerwise hooks around every layer, as vLLM's and
vllm-ascend's attention do: layerwise loading runs and is traced without vLLM."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kvlab.cache.allocation import KVCache, axis_sizes, layer_name, view_parts
from kvlab.cache.geometry import ModelGeometry
from kvlab.hooks.calls import connector_active, maybe_save_kv_layer_to_connector, wait_for_kv_layer_from_connector
from kvlab.hooks.trace import traced


@dataclass(frozen=True)
class TinyAttentionMetadata:
    """What the stack's attention needs for one forward pass of one sequence; handed to
    ``save_kv_layer`` as vLLM hands its backend's metadata."""

    block_ids: tuple[int, ...]  # the sequence's block table
    start: int  # position of the first new token (tokens before it are in the cache)
    num_tokens: int


def layer_parts(cache: KVCache, layer: str) -> list[torch.Tensor]:
    """A layer's K and V (MLA: latent and rope) as [block, token, head, element] views of
    ``cache.layers[layer]``, the very views a connector receives, for any paged layout."""
    layout, geometry = cache.layout, cache.geometry
    if layout.is_chunk_format:
        raise ValueError(f"{layout.name} is an LMCache chunk format, not a paged cache attention can use")
    views = cache.layers[layer]
    parts: list[torch.Tensor] = []
    for index, view in enumerate(view_parts(views)):
        sizes = axis_sizes(layout, geometry, cache.num_blocks, index if layout.is_tuple else None)
        axes = layout.view_order  # the view's axes, ungrouped; S (the part) present unless split
        split = view.view([sizes[a] for a in axes]).permute([axes.index(a) for a in "SBNHD" if a in axes])
        parts += split.unbind(0) if "S" in axes else [split]
    if len(parts) == 1:  # MLA's latent and rope packed in one vector
        parts = list(parts[0].split(geometry.parts, dim=-1))
    return parts


class TinyAttentionStack(torch.nn.Module):
    """Attention layers only (no MLP, norm or positional encoding), with fixed random
    weights, reading and writing a kvlab paged cache through its layer views.

    Each layer projects the new tokens, waits for its KV from the connector, writes the
    new K/V into the cache, attends causally over every cached token of the sequence (so
    a prefix loaded from elsewhere is really read) and then offers the layer's KV to the
    connector. MLA geometries cache a latent and a rope part; attention then uses
    [latent | rope] as the key and the latent as the value.
    """

    def __init__(self, geometry: ModelGeometry, num_heads: int | None = None, hidden: int | None = None,
                 seed: int = 0) -> None:
        super().__init__()
        if geometry.itemsize < 2:
            raise ValueError(f"the tiny stack computes in the cache dtype, and {geometry.dtype} has no matmuls")
        self.geometry = geometry
        self.num_heads = num_heads or 2 * geometry.num_kv_heads
        if self.num_heads % geometry.num_kv_heads:
            raise ValueError(f"{self.num_heads} query heads do not share {geometry.num_kv_heads} kv heads evenly")
        self.hidden = hidden or self.num_heads * geometry.head_size
        key_size = sum(geometry.parts) if geometry.is_mla else geometry.head_size
        value_size = geometry.parts[0] if geometry.is_mla else geometry.head_size
        generator = torch.Generator().manual_seed(seed)

        def weight(fan_in: int, fan_out: int) -> torch.Tensor:
            w = torch.randn(geometry.num_layers, fan_in, fan_out, generator=generator) / fan_in**0.5
            return w.to(geometry.dtype)

        kv = geometry.num_kv_heads
        self.register_buffer("w_query", weight(self.hidden, self.num_heads * key_size))
        self.register_buffer("w_part0", weight(self.hidden, kv * geometry.parts[0]))
        self.register_buffer("w_part1", weight(self.hidden, kv * geometry.parts[1]))
        self.register_buffer("w_out", weight(self.num_heads * value_size, self.hidden))

    @torch.no_grad()
    def forward(self, x: torch.Tensor, cache: KVCache, block_ids: Sequence[int], start: int = 0,
                connector: Any = None) -> torch.Tensor:
        """Run new tokens ``x`` [tokens, hidden] at positions ``start``... of the sequence
        whose blocks are ``block_ids``; positions before ``start`` must be in the cache.
        With a ``connector``, it is active (with :class:`TinyAttentionMetadata`) meanwhile."""
        g = self.geometry
        if (cache.geometry.num_layers, cache.geometry.num_kv_heads, cache.geometry.parts, cache.geometry.dtype) != (
                g.num_layers, g.num_kv_heads, g.parts, g.dtype):
            raise ValueError(f"cache holds {cache.geometry.describe()}, the stack was built for {g.describe()}")
        block_size = cache.geometry.block_size
        total = start + x.shape[0]
        if total > len(block_ids) * block_size:
            raise ValueError(f"{total} tokens need {-(-total // block_size)} blocks, got {len(block_ids)}")
        device = cache.storage[0].device
        self.to(device)
        x = x.to(device, g.dtype)
        positions = torch.arange(start, total, device=device)
        table = torch.as_tensor(list(block_ids), dtype=torch.int64, device=device)
        slots = (table[positions // block_size], positions % block_size)
        visible = torch.arange(total, device=device)[None, :] <= positions[:, None]  # causal: [new, all]
        metadata = TinyAttentionMetadata(tuple(block_ids), start, x.shape[0])
        with connector_active(connector, metadata) if connector is not None else contextlib.nullcontext():
            for i in range(g.num_layers):
                x = x + self._layer(i, x, cache, table, slots, visible)
        return x

    def _layer(self, i: int, x: torch.Tensor, cache: KVCache, table: torch.Tensor,
               slots: tuple[torch.Tensor, torch.Tensor], visible: torch.Tensor) -> torch.Tensor:
        g, name, tokens = self.geometry, layer_name(i), x.shape[0]
        query = (x @ self.w_query[i]).view(tokens, self.num_heads, -1)
        new = [(x @ w[i]).view(tokens, g.num_kv_heads, -1) for w in (self.w_part0, self.w_part1)]
        wait_for_kv_layer_from_connector(name)  # before the write: a loaded block may hold this step's slots
        with traced(name, "attention"):
            parts = layer_parts(cache, name)
            for part, values in zip(parts, new):
                part[slots] = values
            cached = [part[table].flatten(0, 1)[: visible.shape[1]] for part in parts]  # [all tokens, kv heads, D]
            key, value = (torch.cat(cached, -1), cached[0]) if g.is_mla else cached
            group = self.num_heads // g.num_kv_heads
            key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
            scores = torch.einsum("thd,shd->hts", query, key).float() * query.shape[-1] ** -0.5
            weights = scores.masked_fill(~visible, float("-inf")).softmax(-1).to(g.dtype)
            out = torch.einsum("hts,shd->thd", weights, value)
        maybe_save_kv_layer_to_connector(name, cache.layers[name])
        return out.flatten(1) @ self.w_out[i]
