"""The two layerwise hooks attention calls around itself, and which connector they drive.

vLLM's attention asks the active v1 KV connector to ``wait_for_layer_load(layer)`` before
attention and to ``save_kv_layer(layer, kv_cache, attn_metadata)`` after it. Its old
helpers assumed the attention metadata is a dict keyed by layer name; on Ascend it is one
object and each layer's KV is a ``(k_cache, v_cache)`` (MLA: ``(nope, rope)``) tuple. The
hooks here take either. vLLM is consulted only once something has imported it."""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvlab.hooks.trace import traced


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


_DRIVEN: contextvars.ContextVar[Any] = contextvars.ContextVar("kvlab_driven_connector", default=None)


@contextlib.contextmanager
def _driving(connector: Any) -> Iterator[None]:
    token = _DRIVEN.set(connector)
    try:
        yield
    finally:
        _DRIVEN.reset(token)


def driven_by_hooks(connector: Any) -> bool:
    """Whether ``connector`` is being called from one of the hooks right now: a connector
    that the hooks drive (vllm-ascend's way) can ignore the same calls made by vLLM's own
    attention wrapper, so that each layer is loaded and saved once."""
    return _DRIVEN.get() is connector


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


def wait_for_kv_layer_from_connector(layer_name: str) -> None:
    """Before a layer's attention: block until the connector has this layer's KV in place
    (on an accelerator the compute stream waits instead). A no-op without a connector."""
    active = current_connector()
    if active is None:
        return
    with traced(layer_name, "load_wait"), _driving(active.connector):
        active.connector.wait_for_layer_load(layer_name)


def maybe_save_kv_layer_to_connector(layer_name: str, kv_cache_layer: Any) -> None:
    """After a layer's attention: hand the connector this layer's KV (a tensor, a (k, v)
    tuple or an MLA pair, unchanged) and its attention metadata. A no-op without one."""
    active = current_connector()
    if active is None:
        return
    metadata = layer_metadata(active.attn_metadata, layer_name)
    with traced(layer_name, "save"), _driving(active.connector):
        active.connector.save_kv_layer(layer_name, kv_cache_layer, metadata)
