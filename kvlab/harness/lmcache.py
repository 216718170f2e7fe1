"""An engine run on a real ``lmcache server`` (kvlab.runtime.lmcache): the server checked
before the engine starts, and a failure while it is dead named as such."""

from __future__ import annotations

import subprocess
from dataclasses import replace
from typing import Any

from kvlab.harness.engine import EngineSpec, run_engine
from kvlab.runtime.lmcache import LMCacheError, LMCacheServer


def run_on_server(server: LMCacheServer, spec: EngineSpec, prompts: list[list[int]], timeout: float = 900,
               **engine_options: Any) -> dict:
    """kvlab.harness.engine.run_engine of ``spec`` (connector "lmcache") on ``server``: the server
    is checked before the engine starts, and a run that fails or outlasts ``timeout``
    seconds while the server is dead raises LMCacheError naming it. A server that dies
    mid-run while the engine finishes means recomputed prompts (right outputs, fewer
    hits): the result's ``lmcache_server_alive`` says whether it still answered at the end.
    """
    if spec.connector != "lmcache":
        raise ValueError(f"spec.connector must be 'lmcache', got {spec.connector!r}")
    server.ensure_alive()
    spec = replace(spec, extra={**spec.extra, **server.engine_extra(spec.model, spec.dtype, spec.block_size)})
    try:
        result = run_engine(spec, prompts, timeout=timeout, **engine_options)
    except subprocess.TimeoutExpired as error:
        state = "alive" if server.alive else "dead"
        raise LMCacheError(f"the engine did not finish within {timeout:.0f} s and was killed; the lmcache server "
                           f"on port {server.port} is {state}") from error
    except RuntimeError as error:
        if server.alive:
            raise
        raise LMCacheError(f"the engine failed and the lmcache server on port {server.port} is dead:\n"
                           f"{error}") from error
    result["lmcache_server_alive"] = server.alive
    return result
