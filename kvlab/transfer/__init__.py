"""Moving KV blocks between a paged cache and a buffer: one engine, a copy method per module.

Every method moves the same bytes; they differ in how many operations they issue:
``segments`` (one copy per contiguous run), ``memcpy`` (every run in one call to kvlab's C
batch copy, host memory, on the CPU's threads), ``gather`` (batched indexed copies),
``compiled`` (one torch.compile kernel), ``triton`` (kvlab's Triton kernel), ``dma`` (one
cudaMemcpyBatchAsync call for the copy engines), and the peers ``lmcache`` and ``vllm``
(those projects' own copy functions, where they import).
Each lives in ``kvlab/transfer/methods/`` and registers itself (kvlab.transfer.registry);
a new method is one new module there. Needs torch only.
"""

import kvlab.transfer.methods  # noqa: F401  (registers every copy method)
from kvlab.transfer.common import copy_stream
from kvlab.transfer.engine import Transfer, chunk_buffer, host_buffer, load, offload, run_all
from kvlab.transfer.layerwise import LayerwiseLoad
from kvlab.transfer.plan import CopyPlan, HeadSlice, copy_plan, part_views
from kvlab.transfer.registry import (
    ALL_METHODS,
    METHODS,
    PEERS,
    CopyMethod,
    available_methods,
    get_method,
    method_colours,
    method_status,
    register,
    unregister,
)

__all__ = [
    "ALL_METHODS", "METHODS", "PEERS", "CopyMethod", "CopyPlan", "HeadSlice", "LayerwiseLoad", "Transfer", "available_methods", "chunk_buffer",
    "copy_plan", "copy_stream", "get_method", "host_buffer", "load", "method_colours", "method_status", "offload",
    "part_views", "register", "run_all", "unregister",
]
