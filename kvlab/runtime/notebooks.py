"""Run the notebooks headless with papermill: the main job, and the tests' quick mode."""

from __future__ import annotations

import os
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
    for path in notebook_paths(only):
        target = out / "notebooks" / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
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
    return executed
