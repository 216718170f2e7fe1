"""Child processes that run one job each (an engine, an lm-eval run): a JSON job in, a JSON
result out, the same pinned threads for every process compared.

On a 2-core machine vLLM reserves a second core when a connector is configured and then
runs the model on a different number of threads, which changes speed and even bf16
outputs: every child gets ``pinned_env()``."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

from kvlab.runtime.forkserver import ForkServer, same_imports

# Same threads for every engine compared (see the module docstring).
PINNED_ENV = {
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
# GiB of KV cache per engine unless VLLM_CPU_KVCACHE_SPACE says otherwise: room for the
# experiments' batches (46k SmolLM2 fp32 tokens). vLLM allocates it at start-up, about 6 s
# more than 1 GiB on 2 cores, so the tests (tests/conftest.py) ask for 1.
KV_CACHE_GIB = "2"


def resident_mib() -> float:
    """This process's resident memory (VmRSS, Linux), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise OSError("no VmRSS line in /proc/self/status")


def pinned_env() -> dict[str, str]:
    """What every engine process gets: the pinned threads and the KV cache space."""
    return {**PINNED_ENV, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)}


@contextlib.contextmanager
def environment(variables: dict[str, str] | None) -> Iterator[None]:
    """``variables`` set in os.environ while inside (a process started there inherits them:
    a notebook's kernel, its engines), then put back as they were."""
    saved = {name: os.environ.get(name) for name in variables or {}}
    os.environ.update(variables or {})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_child(module: str, job: dict, what: str, timeout: float, env: dict[str, str] | None = None) -> dict:
    """Run ``python -m module job.json out.json`` with the pinned environment (plus
    ``env``) and return the JSON it wrote; a failure quotes the end of its output. Forked
    from this process's fork server where it can be (kvlab.runtime.forkserver), else started
    plainly: the same job either way."""
    base = {**os.environ, **pinned_env()}
    full = {**base, **(env or {})}
    with tempfile.TemporaryDirectory() as tmp:
        job_path, out_path, log = Path(tmp) / "job.json", Path(tmp) / "out.json", Path(tmp) / "output.log"
        job_path.write_text(json.dumps(job))
        args = [str(job_path), str(out_path)]
        server = _fork_server(base) if same_imports(base, full) else None  # no server for a job it cannot fork
        code = server.run(module, args, full, log, timeout) if server is not None else None
        if code is None:
            proc = subprocess.run([sys.executable, "-m", module, *args], env=full, capture_output=True, text=True,
                                  timeout=timeout)
            code, output = proc.returncode, proc.stderr or proc.stdout
        else:
            output = log.read_text(errors="replace")
        if code != 0 or not out_path.exists():
            tail = "\n".join(output.splitlines()[-25:])
            raise RuntimeError(f"{what} failed (exit {code}):\n{tail}")
        return json.loads(out_path.read_text())


_servers: list[ForkServer] = []  # this process's fork server, started at its first job it can fork


def _fork_server(base: dict[str, str]) -> ForkServer | None:
    """This process's fork server for jobs of environment ``base`` (a new one when the
    environment changed); None where forking is off (KVLAB_FORK_SERVER=0) or fails to start."""
    if os.environ.get("KVLAB_FORK_SERVER", "1") == "0":
        return None
    if _servers and not _servers[0].accepts(base):
        _servers.pop().close()
    if not _servers:
        try:
            _servers.append(ForkServer(base))
        except OSError:
            return None
        atexit.register(_servers[0].close)
    return _servers[0]
