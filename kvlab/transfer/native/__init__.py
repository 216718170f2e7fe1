"""kvlab's C helpers (the ``.c`` files beside this one), each compiled on first use with the
machine's C compiler and cached under ``~/.cache/kvlab`` by the hash of its source: no
build step at install, and a machine without a compiler still runs kvlab (each caller
has a way without them)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvlab"


@functools.cache
def library(name: str, purpose: str) -> ctypes.CDLL | str:
    """``name``.c compiled and loaded, or why not (no C compiler, a failed build), in words
    that name its ``purpose``."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not compiler:
        return f"no C compiler on PATH to build kvlab's {purpose} (install gcc, or set CC)"
    path = HERE / f"{name}.c"
    source = path.read_bytes()
    built = _cache_dir() / f"{name}-{hashlib.sha256(source).hexdigest()[:12]}.so"
    if not built.exists():
        built.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=built.parent) as scratch:  # then renamed: processes may race
            out = Path(scratch) / built.name
            try:
                done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-pthread", str(path), "-o", str(out)],
                                      capture_output=True, text=True)
            except OSError as error:
                return f"building kvlab's {purpose} with {compiler} failed: {error}"
            if done.returncode:
                return f"building kvlab's {purpose} with {compiler} failed: {done.stderr.strip()[-300:]}"
            os.replace(out, built)
    return ctypes.CDLL(str(built))
