"""Progress bars for kvlab's sweeps: tqdm's (a widget in JupyterLab, text in a shell), and
none while a notebook runs headless. A saved notebook keeps only a bar's first frame
("transfer sweep: 0%| 0/720"), which reads as a sweep that never finished, so
``run_notebooks`` turns them off in its kernels (``headless_progress``)."""

from __future__ import annotations

import contextlib
import os
from typing import Iterable, TypeVar

from kvlab.runtime.processes import environment

T = TypeVar("T")
HIDDEN = "KVLAB_PROGRESS_HIDDEN"  # set to 1 in a process (and its children) that nobody watches


def progress(items: Iterable[T], desc: str, **options) -> Iterable[T]:
    """``items`` behind a tqdm bar named ``desc`` (tqdm's ``options``: unit, leave), or bare
    where bars are hidden or tqdm is missing (a bare GPU machine)."""
    if os.environ.get(HIDDEN) == "1":
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, **options)


def headless_progress() -> contextlib.AbstractContextManager[None]:
    """Hide the bars of every process started inside (a notebook's kernel, its engines)."""
    return environment({HIDDEN: "1"})
