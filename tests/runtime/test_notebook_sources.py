"""What the committed notebooks' sources promise a reader of their executed copies: no
list of saved paths printed above a figure, an opening that says what the notebook teaches and
links the glossary, a headline and takeaways whose numbers come from a kvlab helper, not from
typed text, exercises whose solutions assert their answers, and no name that no cell defines (a
branch the quick profile never runs would fail only in `make run`)."""

import ast
import builtins
import re

import nbformat
import pytest

from kvlab.runtime.notebooks import SOLUTIONS, notebook_paths


def _code_cells(path):
    return [cell.source for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "code"]


def _ends_with_bare_save_figure(source: str) -> bool:
    """IPython shows a cell's last expression (save_figure returns the saved paths) unless a ';' ends it."""
    body = ast.parse(source).body
    last = body[-1] if body else None
    return (isinstance(last, ast.Expr) and isinstance(last.value, ast.Call)
            and getattr(last.value.func, "id", None) == "save_figure" and not source.rstrip().endswith(";"))


@pytest.mark.parametrize("path", notebook_paths(), ids=lambda p: p.stem)
def test_no_cell_ends_with_a_bare_save_figure(path):
    assert not [source for source in _code_cells(path) if _ends_with_bare_save_figure(source)]


def undefined_names(sources: list[str]) -> set[str]:
    """Names some cell reads that no cell binds (assigned, imported, defined, a parameter), nor
    Python or IPython provides: what would raise NameError when that line runs."""
    bound, read = set(dir(builtins)) | {"display", "get_ipython"}, set()
    for tree in map(ast.parse, sources):
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound.add(node.name)
            elif isinstance(node, ast.arg):
                bound.add(node.arg)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ExceptHandler) and node.name:
                bound.add(node.name)
    return read - bound


@pytest.mark.parametrize("path", notebook_paths(), ids=lambda p: p.stem)
def test_no_cell_reads_a_name_no_cell_defines(path):
    assert undefined_names(_code_cells(path)) == set()


def test_the_check_sees_a_name_no_cell_defines():
    assert undefined_names(["run = 1", "if run:\n    x = 2\nelif not paper:\n    y = [z for z in range(x)]"]) == {"paper"}


def test_the_check_sees_a_bare_save_figure():
    assert _ends_with_bare_save_figure('fig = f()\nsave_figure(fig, "x", d)')
    assert not _ends_with_bare_save_figure('save_figure(fig, "x", d);')
    assert not _ends_with_bare_save_figure('_ = save_figure(fig, "x", d)')


COURSE = [path for path in notebook_paths() if path.stem != SOLUTIONS]
EXERCISE = re.compile(r"\*\*Exercise (\d\d\.\d)\.\*\*")
SOLUTION = re.compile(r"^### Exercise (\d\d\.\d)$", re.MULTILINE)


@pytest.mark.parametrize("path", COURSE, ids=lambda p: p.stem)
def test_opens_with_its_headline_and_ends_with_takeaways_and_exercises(path):
    """What you will learn, the glossary, the headline right after the imports (filled in by the
    takeaways: tests/integration/test_notebooks_run.py); then, last, the takeaways and the exercises."""
    cells = nbformat.read(path, as_version=4).cells
    assert cells[1].cell_type == "markdown" and cells[1].source.startswith("**What you will learn**")
    assert "(../docs/glossary.md)" in cells[0].source, "every notebook links the one glossary"
    assert cells[4].cell_type == "code" and "headline = Headline()" in cells[4].source
    heading = max(i for i, cell in enumerate(cells) if cell.source.startswith("## Takeaways"))
    assert heading >= len(cells) - 4  # then the exercises, and at most a pointer to the next notebook
    call = cells[heading + 1]
    assert call.cell_type == "code" and "from kvlab.plotting.story import" in call.source
    assert call.source.splitlines()[-1].startswith("headline.show(") and "_takeaways(" in call.source.splitlines()[-1]
    assert cells[heading + 2].source.startswith("## Exercises: predict, then run")


def missing_solutions(exercises: list[str], solutions: list[nbformat.NotebookNode]) -> list[str]:
    """The exercises (``NN.k``) with no ``### Exercise NN.k`` in the solutions, or none whose
    next code cell asserts its answer; and solutions of no exercise."""
    found: dict[str, bool] = {}
    for i, cell in enumerate(solutions):
        for name in SOLUTION.findall(cell.source) if cell.cell_type == "markdown" else ():
            after = next((c for c in solutions[i + 1:] if c.cell_type == "code"), None)
            found[name] = after is not None and any(isinstance(node, ast.Assert) for node in ast.walk(ast.parse(after.source)))
    return ([name for name in exercises if not found.get(name)]
            + [f"{name} (no such exercise)" for name in found if name not in exercises])


def test_every_notebook_has_two_or_three_exercises_each_with_an_asserted_solution():
    exercises = {path.stem: EXERCISE.findall("".join(c.source for c in nbformat.read(path, as_version=4).cells
                                                      if c.cell_type == "markdown")) for path in COURSE}
    assert all(2 <= len(names) <= 3 and all(n.startswith(stem[:2]) for n in names) for stem, names in exercises.items()), exercises
    (solutions,) = notebook_paths([SOLUTIONS])
    assert missing_solutions([n for names in exercises.values() for n in names],
                             nbformat.read(solutions, as_version=4).cells) == []


def test_the_check_sees_an_exercise_without_an_asserted_solution():
    from nbformat.v4 import new_code_cell, new_markdown_cell

    cells = [new_markdown_cell("### Exercise 01.1"), new_code_cell("x = 1\nassert x == 1"),
             new_markdown_cell("### Exercise 01.2"), new_code_cell("x = 2  # no assertion"),
             new_markdown_cell("### Exercise 09.9"), new_code_cell("assert True")]
    assert missing_solutions(["01.1", "01.2", "01.3"], cells) == ["01.2", "01.3", "09.9 (no such exercise)"]
