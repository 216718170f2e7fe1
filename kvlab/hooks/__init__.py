"""Layerwise KV hooks: what attention calls around itself so a connector can load and save
one layer at a time (the helpers vllm-ascend re-implemented, tolerant of one metadata
object and of tuple KV caches), a tracer, and a tiny attention stack with a torch-only
layerwise connector to watch it happen on a CPU, GPU or NPU without vLLM.

Needs torch only; vLLM is consulted only once something has imported it."""

from kvlab.hooks.calls import (
    ActiveConnector,
    connector_active,
    current_connector,
    driven_by_hooks,
    layer_metadata,
    maybe_save_kv_layer_to_connector,
    wait_for_kv_layer_from_connector,
)
from kvlab.hooks.offloader import LayerwiseOffloader, OffloadPlan
from kvlab.hooks.stack import TinyAttentionMetadata, TinyAttentionStack, layer_parts
from kvlab.hooks.trace import LayerTrace, TraceEvent, traced

__all__ = [
    "ActiveConnector", "connector_active", "current_connector", "driven_by_hooks", "layer_metadata",
    "wait_for_kv_layer_from_connector", "maybe_save_kv_layer_to_connector", "TraceEvent", "LayerTrace", "traced",
    "TinyAttentionMetadata", "layer_parts", "TinyAttentionStack", "OffloadPlan", "LayerwiseOffloader",
]
