"""kvlab: how an LLM's KV cache is laid out in memory and what moving it costs.

The subpackages, in dependency order (each imports only those before it):

- ``kvlab.cache``: geometry, devices, the layout atlas, allocation, segments (torch only)
- ``kvlab.transfer``: the copy engine and one module per copy method (torch only)
- ``kvlab.store``: chunks, keys, tiers behind one protocol (torch only)
- ``kvlab.hooks`` (torch only) and ``kvlab.connector`` (vLLM; its worker side torch only): layerwise hooks, KVLabConnector
- ``kvlab.runtime``: child processes, servers, model folders
- ``kvlab.harness``: the experiments' harness: engines run through phases, the connector driven without an engine
- ``kvlab.experiments`` and ``kvlab.results``: what the notebooks measure, and its files
- ``kvlab.plotting``: one module of figures per notebook

The names below load their module on first use, so ``import kvlab`` stays cheap and pulls
in neither vLLM nor LMCache.
"""

from __future__ import annotations

from kvlab._lazy import lazy_names
from kvlab.runtime.vllm_cpu import quiet_cpu_triton_notice

__version__ = "0.1.0"
quiet_cpu_triton_notice()

_EXPORTS = {
    "kvlab.cache": ("ModelGeometry", "preset", "resolve_model", "LAYOUTS", "Layout", "get_layout", "compatible_layouts",
                    "vllm_layout", "KVCache", "allocate", "adopt", "from_storage", "transfer_cost", "block_segments"),
    "kvlab.transfer": ("Transfer", "LayerwiseLoad", "host_buffer", "chunk_buffer", "copy_plan", "METHODS", "PEERS",
                       "CopyMethod", "register", "method_status"),
    "kvlab.store": ("KVStore", "Chunk", "block_hashes"),
    "kvlab.hooks": ("TinyAttentionStack", "LayerwiseOffloader", "LayerTrace", "connector_active"),
    "kvlab.results": ("Profile", "measured", "load_results", "results_for", "record_run"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_WHERE)


__getattr__, __dir__ = lazy_names("kvlab", _WHERE, globals())
