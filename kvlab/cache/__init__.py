"""The KV cache itself, with torch only: a model's KV geometry, the devices, the layout atlas
as data, vLLM's release history, allocation and adoption on any device, block ids and the
segment arithmetic of moving them."""

from kvlab.cache.allocation import (
    Allocation,
    KVCache,
    address_labels,
    adopt,
    allocate,
    allocate_chunk,
    allocations,
    axis_sizes,
    check_num_blocks,
    from_storage,
    layer_name,
)
from kvlab.cache.devices import (can_pin_memory, check_fits, device_here, memory_bytes, npu_available, resolve_device,
                                 synchronize)
from kvlab.cache.fits import check_compatible, compatible_layouts
from kvlab.cache.geometry import DTYPES, PRESETS, ModelGeometry, dtype_name, parse_dtype, preset, resolve_model
from kvlab.cache.layouts import (
    AXES,
    GENERATIONS,
    LAYOUTS,
    VLLM_V29_LAYOUTS,
    Generation,
    Holds,
    Kind,
    Layout,
    get_layout,
    register_layout,
    unregister_layout,
)
from kvlab.cache.segments import (
    MAX_RUNS,
    MAX_TABLE_BLOCKS,
    Segments,
    block_segments,
    check_block_ids,
    contiguous_block_ids,
    layout_table,
    scattered_block_ids,
    span_segments,
    sweep,
    token_segments,
    token_spans,
    transfer_cost,
)
from kvlab.cache.hybrid import HybridGeometry, KVGroup, allocate_hybrid
from kvlab.cache.identify import ambiguities
from kvlab.cache.quant import QUANTS, KVQuant
from kvlab.cache.vllm_history import vllm_history, vllm_layout

__all__ = [
    "register_layout", "unregister_layout",
    "DTYPES", "PRESETS", "LAYOUTS", "GENERATIONS", "Generation", "Holds", "Kind", "parse_dtype", "dtype_name", "ModelGeometry", "preset", "resolve_model", "npu_available", "resolve_device", "device_here",
    "can_pin_memory", "synchronize", "memory_bytes", "check_fits", "AXES", "Layout", "VLLM_V29_LAYOUTS",
    "get_layout", "check_compatible", "compatible_layouts", "vllm_layout", "vllm_history", "Allocation",
    "axis_sizes", "check_num_blocks", "allocations", "KVCache", "layer_name", "allocate", "from_storage", "adopt",
    "address_labels", "allocate_chunk", "MAX_RUNS", "MAX_TABLE_BLOCKS", "Segments", "check_block_ids",
    "scattered_block_ids", "contiguous_block_ids", "token_spans", "span_segments", "block_segments",
    "token_segments", "transfer_cost", "sweep", "layout_table", "QUANTS", "KVQuant", "HybridGeometry", "KVGroup",
    "allocate_hybrid", "ambiguities",
]
