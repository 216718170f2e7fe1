"""Layerwise KV hooks: what attention calls around itself so a connector can load and save
one layer at a time, plus a tracer and a tiny attention stack to watch it happen.

vLLM's attention asks the active v1 KV connector to ``wait_for_layer_load(layer)`` before
attention and to ``save_kv_layer(layer, kv_cache, attn_metadata)`` after it. Its old
helpers assumed the attention metadata is a dict keyed by layer name; on Ascend it is one
object and each layer's KV is a ``(k_cache, v_cache)`` (MLA: ``(nope, rope)``) tuple.
The two hooks here take either, so the same connector code runs under vLLM, vllm-ascend,
or kvlab's own :class:`TinyAttentionStack` (with :class:`LayerwiseOffloader`) without vLLM.

This module needs torch only; vLLM is consulted only once something has imported it.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, NamedTuple, Sequence

import torch

from kvlab.devices import synchronize
from kvlab.geometry import ModelGeometry
from kvlab import layouts
from kvlab.layouts import KVCache, axis_sizes
from kvlab.transfer import LayerwiseLoad, Transfer, host_buffer

# --- which connector is active -----------------------------------------------------


@dataclass
class ActiveConnector:
    """A connector and the current forward pass's attention metadata (a dict keyed by
    layer name, or one object for every layer). As a context manager it makes them the
    ones the hooks use, taking precedence over a vLLM connector."""

    connector: Any
    attn_metadata: Any = None
    _token: contextvars.Token | None = field(default=None, init=False, repr=False)

    def __enter__(self) -> ActiveConnector:
        self._token = _ACTIVE_CONNECTOR.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _ACTIVE_CONNECTOR.reset(self._token)


_ACTIVE_CONNECTOR: contextvars.ContextVar[ActiveConnector | None] = contextvars.ContextVar(
    "kvlab_active_connector", default=None
)


def connector_active(connector: Any, attn_metadata: Any = None) -> ActiveConnector:
    """``with connector_active(connector, attn_metadata):`` hooks inside drive ``connector``."""
    return ActiveConnector(connector, attn_metadata)


def _vllm_connector() -> ActiveConnector | None:
    """vLLM's active v1 connector with its forward context's metadata, if there is one.

    A vLLM connector group exists only once vLLM is imported, so a process that never
    imported it pays nothing here (the hooks run once per layer)."""
    if "vllm" not in sys.modules:
        return None
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group, is_v1_kv_transfer_group
        from vllm.forward_context import get_forward_context, is_forward_context_available
    except ImportError:  # a vLLM too old or too new to have these: no connector we can drive
        return None
    if not (has_kv_transfer_group() and is_v1_kv_transfer_group() and is_forward_context_available()):
        return None
    return ActiveConnector(get_kv_transfer_group(), get_forward_context().attn_metadata)


def current_connector() -> ActiveConnector | None:
    """The connector the hooks would drive now: kvlab's active one, else vLLM's, else None.
    None too when there is no attention metadata (a dummy or profiling run) or the
    connector says it has no metadata for this step."""
    active = _ACTIVE_CONNECTOR.get() or _vllm_connector()
    if active is None or active.attn_metadata is None:
        return None
    has_metadata = getattr(active.connector, "has_connector_metadata", None)
    if has_metadata is not None and not has_metadata():
        return None
    return active


def layer_metadata(attn_metadata: Any, layer: str) -> Any:
    """This layer's attention metadata: its entry of a per-layer dict (vLLM), the first
    micro-batch's entry of a list of dicts (vLLM's speculative decoding and DBO), or the
    single object every layer shares (vllm-ascend)."""
    if isinstance(attn_metadata, list) and attn_metadata and isinstance(attn_metadata[0], dict):
        attn_metadata = attn_metadata[0]
    if not isinstance(attn_metadata, dict):
        return attn_metadata
    if layer not in attn_metadata:
        known = list(attn_metadata)
        raise KeyError(
            f"attention metadata has no entry for layer {layer!r}; it has {len(known)} layers"
            + (f", e.g. {known[0]!r}" if known else "")
        )
    return attn_metadata[layer]


# --- the hooks ---------------------------------------------------------------------


def wait_for_kv_layer_from_connector(layer_name: str) -> None:
    """Before a layer's attention: block until the connector has this layer's KV in place
    (on an accelerator the compute stream waits instead). A no-op without a connector."""
    active = current_connector()
    if active is None:
        return
    with traced(layer_name, "load_wait"):
        active.connector.wait_for_layer_load(layer_name)


def maybe_save_kv_layer_to_connector(layer_name: str, kv_cache_layer: Any) -> None:
    """After a layer's attention: hand the connector this layer's KV (a tensor, a (k, v)
    tuple or an MLA pair, unchanged) and its attention metadata. A no-op without one."""
    active = current_connector()
    if active is None:
        return
    metadata = layer_metadata(active.attn_metadata, layer_name)
    with traced(layer_name, "save"):
        active.connector.save_kv_layer(layer_name, kv_cache_layer, metadata)


# --- tracing -----------------------------------------------------------------------


class TraceEvent(NamedTuple):
    layer: str
    event: str  # "load_wait", "attention" or "save" (the save being issued)
    start: float  # seconds since the trace began
    end: float


@dataclass
class LayerTrace:
    """Per-layer timestamps of load waits, attention and save issues, while active.

    Times are host ``time.perf_counter`` seconds from the trace's start. On an accelerator
    the host runs ahead of the device; pass ``sync`` (a device) to synchronize it at every
    timestamp, so spans show device work at the cost of the overlap being measured.
    """

    sync: str | torch.device | None = None
    events: list[TraceEvent] = field(default_factory=list)
    _origin: float = field(default=0.0, init=False, repr=False)
    _token: contextvars.Token | None = field(default=None, init=False, repr=False)

    def _clock(self) -> float:
        if self.sync is not None:
            synchronize(torch.device(self.sync))
        return time.perf_counter()

    def now(self) -> float:
        """Seconds since the trace began."""
        return self._clock() - self._origin

    def __enter__(self) -> LayerTrace:
        self._origin = self._clock()
        self._token = _ACTIVE_TRACE.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _ACTIVE_TRACE.reset(self._token)

    def rows(self) -> list[dict]:
        """One dict per event (layer, event, start, end), in the order they began."""
        return [event._asdict() for event in sorted(self.events, key=lambda e: e.start)]


_ACTIVE_TRACE: contextvars.ContextVar[LayerTrace | None] = contextvars.ContextVar("kvlab_layer_trace", default=None)


@contextlib.contextmanager
def traced(layer: str, event: str) -> Iterator[None]:
    """Record the enclosed code as ``event`` of ``layer`` in the active trace, if any."""
    trace = _ACTIVE_TRACE.get()
    if trace is None:
        yield
        return
    start = trace.now()
    yield
    trace.events.append(TraceEvent(layer, event, start, trace.now()))


# --- a tiny attention stack over a kvlab cache ---------------------------------------


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
    for index, view in enumerate(views if isinstance(views, tuple) else (views,)):
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
        g, name, tokens = self.geometry, layouts.layer_name(i), x.shape[0]
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


# --- a torch-only layerwise connector ----------------------------------------------


@dataclass(frozen=True)
class OffloadPlan:
    """The connector metadata of one forward pass: cache blocks to load from the host
    buffer before their layer's attention, and cache blocks to save after it."""

    load_blocks: Sequence[int] = ()
    load_from: Sequence[int] | None = None  # buffer blocks; default 0, 1, ...
    save_blocks: Sequence[int] = ()
    save_to: Sequence[int] | None = None  # buffer blocks; default 0, 1, ...


class LayerwiseOffloader:
    """A minimal layerwise connector between a kvlab cache and a host buffer, with the
    worker-side method names of vLLM's v1 connectors, so the hooks drive it as vLLM would
    drive one. Every copy goes through kvlab.transfer: loads as a
    :class:`~kvlab.transfer.LayerwiseLoad`, saves as one-layer :class:`~kvlab.transfer.Transfer`\\ s.
    """

    def __init__(self, cache: KVCache, num_buffer_blocks: int, method: str = "gather") -> None:
        self.cache = cache
        self.buffer = host_buffer(cache, num_buffer_blocks)
        self.method = method
        self._layer_index = {layouts.layer_name(i): i for i in range(cache.geometry.num_layers)}
        self._plan: OffloadPlan | None = None
        self._load: LayerwiseLoad | None = None
        self._saves: list[Transfer] = []

    def bind_connector_metadata(self, plan: OffloadPlan) -> None:
        self._plan = plan

    def has_connector_metadata(self) -> bool:
        return self._plan is not None

    def clear_connector_metadata(self) -> None:
        self._plan = None

    def start_load_kv(self) -> None:
        """Issue every layer's load, in layer order, without waiting for any."""
        plan = self._plan
        if plan is not None and plan.load_blocks:
            self._load = LayerwiseLoad(self.buffer, self.cache, plan.load_blocks, plan.load_from, self.method).start()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._load is not None:
            self._load.wait(self._layer_index[layer_name])

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        """Issue the copy of this layer's planned blocks to the buffer (asynchronous on an
        accelerator, where it waits for the attention that wrote them)."""
        plan = self._plan
        if plan is not None and plan.save_blocks:
            transfer = Transfer(self.cache, plan.save_blocks, self.buffer, plan.save_to, self.method,
                                layers=[self._layer_index[layer_name]], blocking=False)
            self._saves.append(transfer.run())

    def wait_for_save(self) -> None:
        """Block until every issued save and load is done (the end of a forward pass)."""
        for transfer in self._saves:
            transfer.wait()
        self._saves.clear()
        if self._load is not None:
            self._load.finish()
            self._load = None

    @contextlib.contextmanager
    def step(self, plan: OffloadPlan) -> Iterator[LayerwiseOffloader]:
        """One forward pass under ``plan``: bind it and start loading; afterwards wait for
        the copies and unbind it."""
        self.bind_connector_metadata(plan)
        try:
            self.start_load_kv()
            yield self
        finally:
            self.wait_for_save()
            self.clear_connector_metadata()
