"""Run the notebooks headless with papermill: the main job (the standard or paper profile)
and the tests (the quick profile)."""

from __future__ import annotations

import ast
import json
import os
import sys
import time
from pathlib import Path
from typing import Sequence

import nbformat

from kvlab.runtime.processes import environment
from kvlab.runtime.progress import headless_progress

NOTEBOOKS_DIR = Path(__file__).resolve().parents[2] / "notebooks"
# How much a notebook measures: quick (the tests: no vLLM engine), standard (`make run`:
# minutes), paper (every sweep in full: over an hour on 2 cores).
PROFILES = ("quick", "standard", "paper")
# Minutes each notebook took measuring on a 2-core Intel Xeon: the estimate make run prints
# before a notebook has run here (after that, its own last time). None yet for the notebooks
# made when issue 44 split notebook 03 (2.3 min standard, 21 paper, all three together).
REFERENCE_MINUTES = {
    "standard": {"01_kv_layouts": 0.6, "02_transfer_timing": 1.6, "06_accuracy": 2.6, "07_extend_kvlab": 0.3},
    "paper": {"01_kv_layouts": 0.5, "02_transfer_timing": 4, "06_accuracy": 44, "07_extend_kvlab": 0.7},
}
# The notebooks are numbered as a course; their results and figures keep the stems papers cite
# (data/results/03_ttft-*.jsonl, data/figures/04_accuracy.png): each notebook's stem prefix.
DATA_PREFIX = {"01_kv_layouts": "01", "02_transfer_timing": "02", "03_connector_and_hooks": "03",
               "04_cross_layer_in_the_engine": "03", "05_deployment_and_costs": "03", "06_accuracy": "04",
               "07_extend_kvlab": "05"}
SOLUTIONS = "08_solutions"  # the exercises' solutions, each asserted: it measures nothing and saves no figure


def check_profile(profile: str) -> str:
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; choose from {list(PROFILES)}")
    return profile


def notebook_paths(only: Sequence[str] | None = None) -> list[Path]:
    paths = sorted(NOTEBOOKS_DIR.glob("[0-9]*.ipynb"))
    if only:
        known = {p.stem: p for p in paths}
        missing = [name for name in only if name.removesuffix(".ipynb") not in known]
        if missing:
            raise ValueError(f"no notebook {missing}; choose from {sorted(known)}")
        paths = [known[name.removesuffix(".ipynb")] for name in only]
    return paths


def run_notebooks(profile: str = "standard", only: Sequence[str] | None = None, out: str | Path = "data",
                  measure: bool = True, solutions_env: dict[str, str] | None = None) -> list[Path]:
    """Execute each notebook, writing figures under out/figures, results under out/results
    and the executed notebook under out/notebooks. ``profile`` (kvlab.results.PROFILES) says
    how much is measured: quick (the tests), standard (minutes; the slowest engine sweeps
    are drawn from the committed paper results), paper (everything). With ``measure`` off,
    notebooks that time things only redraw their figures from the results in out/results.
    ``solutions_env``: environment variables the solutions notebook runs with (the CLI points
    it at data/results as git holds it: kvlab.results.committed_as_in_git). The CLI (make run,
    make figures) then writes the report (kvlab.plotting.report)."""
    import papermill

    check_profile(profile)  # each notebook records it (use_profile) in its own kernel

    out = Path(out).resolve()
    executed = []
    paths = notebook_paths(only)
    began = time.perf_counter()
    for number, path in enumerate(paths, 1):
        target = out / "notebooks" / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        last = last_duration(target, profile=profile, measure=measure)
        reference = REFERENCE_MINUTES.get(profile, {}).get(path.stem) if measure else None
        estimate = (f"; it took {last / 60:.1f} min last time here" if last is not None else
                    f"; about {reference} min on a 2-core Intel Xeon" if reference is not None else "")
        print(f"kvlab: notebook {number}/{len(paths)} {path.stem} ({profile} profile"
              f"{'' if measure else ', from the committed results'}{estimate})", file=sys.stderr, flush=True)
        started = time.perf_counter()
        parameters = declared_only(path, {
            "profile": profile,
            "figures_dir": os.path.relpath(out / "figures", path.parent),
            "results_dir": os.path.relpath(out / "results", path.parent),
            "interactive": False,
            "measure": measure,
        })
        nbformat.write(parameterized(path, parameters), target)
        with headless_progress(), environment(solutions_env if path.stem == SOLUTIONS else None):
            papermill.execute_notebook(str(target), str(target), cwd=str(path.parent), kernel_name="python3",
                                       progress_bar=True)
        executed_copy = nbformat.read(target, as_version=4)
        executed_copy.metadata["papermill"]["input_path"] = str(path)
        nbformat.write(executed_copy, target)
        executed.append(target)
        print(f"kvlab: {path.stem} done in {(time.perf_counter() - started) / 60:.1f} min "
              f"({(time.perf_counter() - began) / 60:.1f} min so far)", file=sys.stderr, flush=True)
    return executed


def parameterized(path: Path, parameters: dict) -> nbformat.NotebookNode:
    """The notebook at ``path`` with ``parameters`` written into its parameters cell in place
    of their defaults (each line's comment kept) and recorded as papermill records them: the
    executed copy shows the one cell it ran with (papermill would add a second after it)."""
    import papermill

    notebook = nbformat.read(path, as_version=4)
    notebook.metadata["papermill"] = {"parameters": parameters, "default_parameters": {},
                                      "environment_variables": {}, "version": papermill.__version__}
    cells = [cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", ())]
    if not cells and not parameters:  # a notebook that takes none (the solutions)
        return notebook
    if len(cells) != 1:
        raise ValueError(f"{path.name} has {len(cells)} cells tagged 'parameters', not one")
    lines, written = cells[0].source.split("\n"), set()
    for node in ast.parse(cells[0].source).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id in parameters and node.value.lineno == node.value.end_lineno):
            line, value = lines[node.lineno - 1], parameters[node.targets[0].id]
            literal = json.dumps(value) if isinstance(value, str) else repr(value)
            lines[node.lineno - 1] = line[:node.value.col_offset] + literal + line[node.value.end_col_offset:]
            written.add(node.targets[0].id)
    if written != set(parameters):
        raise ValueError(f"{path.name}'s parameters cell sets {sorted(set(parameters) - written)} other than as "
                         "one line each (name = value)")
    cells[0].source = "\n".join(lines)
    return notebook


def declared_only(path: Path, parameters: dict) -> dict:
    """The parameters ``path`` declares in its parameters cell (a notebook that times nothing
    has no ``measure``): papermill warns about any other."""
    import papermill

    declared = papermill.inspect_notebook(str(path))
    return {name: value for name, value in parameters.items() if name in declared}


def last_duration(executed: Path, profile: str, measure: bool) -> float | None:
    """Seconds the last run of an executed notebook took, when it ran the same way (the
    same profile, measuring or redrawing); None when there is no such run."""
    try:
        meta = json.loads(executed.read_text())["metadata"]["papermill"]
        parameters = meta["parameters"]
        same = parameters.get("profile") == profile and parameters.get("measure", True) == measure
        return float(meta["duration"]) if same and meta.get("duration") else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
