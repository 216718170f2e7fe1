"""Run the notebooks headless with papermill: the main job, and the tests' quick mode."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Sequence

NOTEBOOKS_DIR = Path(__file__).resolve().parents[2] / "notebooks"


def notebook_paths(only: Sequence[str] | None = None) -> list[Path]:
    paths = sorted(NOTEBOOKS_DIR.glob("[0-9]*.ipynb"))
    if only:
        known = {p.stem: p for p in paths}
        missing = [name for name in only if name.removesuffix(".ipynb") not in known]
        if missing:
            raise ValueError(f"no notebook {missing}; choose from {sorted(known)}")
        paths = [known[name.removesuffix(".ipynb")] for name in only]
    return paths


def run_notebooks(quick: bool = False, only: Sequence[str] | None = None, out: str | Path = "data",
                  measure: bool = True) -> list[Path]:
    """Execute each notebook, writing figures under out/figures, results under out/results
    and the executed notebook under out/notebooks. With ``measure`` off, notebooks that
    time things only redraw their figures from the results already in out/results."""
    import papermill

    out = Path(out).resolve()
    executed = []
    paths = notebook_paths(only)
    began = time.perf_counter()
    for number, path in enumerate(paths, 1):
        target = out / "notebooks" / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        last = last_duration(target, quick=quick, measure=measure)
        estimate = f"; it took {last / 60:.1f} min last time here" if last is not None else ""
        print(f"kvlab: notebook {number}/{len(paths)} {path.stem} ({'quick' if quick else 'full'}"
              f"{'' if measure else ', from the committed results'}{estimate})", file=sys.stderr, flush=True)
        started = time.perf_counter()
        papermill.execute_notebook(
            str(path),
            str(target),
            parameters={
                "quick": quick,
                "figures_dir": os.path.relpath(out / "figures", path.parent),
                "results_dir": os.path.relpath(out / "results", path.parent),
                "interactive": False,
                "measure": measure,
            },
            cwd=str(path.parent),
            kernel_name="python3",
            progress_bar=True,
        )
        executed.append(target)
        print(f"kvlab: {path.stem} done in {(time.perf_counter() - started) / 60:.1f} min "
              f"({(time.perf_counter() - began) / 60:.1f} min so far)", file=sys.stderr, flush=True)
    return executed


def last_duration(executed: Path, quick: bool, measure: bool) -> float | None:
    """Seconds the last run of an executed notebook took, when it ran the same way (quick
    or full, measuring or redrawing); None when there is no such run."""
    try:
        meta = json.loads(executed.read_text())["metadata"]["papermill"]
        parameters = meta["parameters"]
        same = parameters.get("quick") == quick and parameters.get("measure", True) == measure
        return float(meta["duration"]) if same and meta.get("duration") else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
