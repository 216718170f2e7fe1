"""What the committed notebooks' sources promise a reader of their executed copies: no
list of saved paths printed above a figure, an opening that says what the notebook teaches,
takeaways whose numbers come from a kvlab helper, not from typed text, and no name that no
cell defines (a branch the quick profile never runs would fail only in `make run`)."""

import ast
import builtins

import nbformat
import pytest

from kvlab.runtime.notebooks import notebook_paths


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


@pytest.mark.parametrize("path", notebook_paths(), ids=lambda p: p.stem)
def test_opens_with_what_you_will_learn_and_ends_with_computed_takeaways(path):
    cells = nbformat.read(path, as_version=4).cells
    assert cells[1].cell_type == "markdown" and cells[1].source.startswith("**What you will learn**")
    heading = max(i for i, cell in enumerate(cells) if cell.source.startswith("## Takeaways"))
    assert heading >= len(cells) - 3  # at most a pointer to the next notebook after it
    call = cells[heading + 1]
    assert call.cell_type == "code" and "from kvlab.plotting.story import" in call.source
    assert "_takeaways(" in call.source.splitlines()[-1]
