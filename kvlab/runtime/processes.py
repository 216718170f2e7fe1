"""Child processes that run one job each (an engine, an lm-eval run): a JSON job in, a JSON
result out, the same pinned threads for every process compared.

On a 2-core machine vLLM reserves a second core when a connector is configured and then
runs the model on a different number of threads, which changes speed and even bf16
outputs: every child gets ``PINNED_ENV``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# Same threads for every engine compared (see the class docstring).
PINNED_ENV = {
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def run_child(module: str, job: dict, what: str, timeout: float, env: dict[str, str] | None = None) -> dict:
    """Run ``python -m module job.json out.json`` with the pinned environment (plus
    ``env``) and return the JSON it wrote; a failure quotes the end of its output."""
    with tempfile.TemporaryDirectory() as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_path.write_text(json.dumps(job))
        proc = subprocess.run([sys.executable, "-m", module, str(job_path), str(out_path)],
                              env={**os.environ, **PINNED_ENV, **(env or {})}, capture_output=True, text=True,
                              timeout=timeout)
        if proc.returncode != 0 or not out_path.exists():
            tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-25:])
            raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{tail}")
        return json.loads(out_path.read_text())


def failure_line(error: Exception) -> str:
    """The last line a failed child printed (run_child quotes its output's end): for a
    failed engine, the exception vLLM raised, without its worker's rank prefix."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return (lines[-1].removeprefix("[rank0]:").strip() if lines else type(error).__name__)[:300]
