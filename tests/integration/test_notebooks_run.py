"""Every notebook runs headless in the quick profile (what CI runs), writing its figures and
showing each one it saves (in the executed notebook and its static HTML export), clean: no
error and no stderr output, its parameters cell once, showing the values it ran with, and its
headline filled in by its takeaways; and redraws them from the committed results alone
(``make figures``), byte for byte."""

import pytest
from conftest import committed_data

from nbconvert import HTMLExporter

from kvlab.plotting.report import ExecutedNotebook, read_executed
from kvlab.runtime.notebooks import DATA_PREFIX, SOLUTIONS, notebook_paths, run_notebooks

pytestmark = pytest.mark.slow  # starts engines, servers or notebook kernels


@pytest.mark.parametrize("path", notebook_paths(), ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path):
    import nbformat

    (executed,) = run_notebooks(profile="quick", only=[path.stem], out=tmp_path)
    notebook = nbformat.read(executed, as_version=4)
    assert ExecutedNotebook(executed, notebook).hygiene() == []
    if path.stem == SOLUTIONS:
        return  # it asserts its answers and draws nothing
    assert list((tmp_path / "figures").glob(f"{DATA_PREFIX[path.stem]}_*.png"))
    (parameters,) = [cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", [])]
    assert 'profile = "quick"' in parameters.source, "the cell shows the values the notebook ran with"
    shown = ExecutedNotebook(executed, notebook)
    assert not shown.missing_figures(), "a cell saves a figure it does not show"
    # a static export (nbconvert's HTML, as `jupyter nbconvert --to html` writes it) keeps every image
    html, _ = HTMLExporter(embed_images=True).from_notebook_node(notebook)
    assert html.count("<img") >= shown.images() > 0


@pytest.mark.parametrize("notebook, figures", [("02_transfer_timing", 9), ("03_connector_and_hooks", 5),
                                               ("04_cross_layer_in_the_engine", 5), ("05_deployment_and_costs", 4),
                                               ("06_accuracy", 2)])
def test_figures_redraw_from_committed_results(tmp_path, notebook, figures):
    """`make figures`: a measuring notebook measures nothing and draws every figure from data/results."""
    import shutil

    committed = sorted((committed_data() / "results").glob(f"{DATA_PREFIX[notebook]}_*.jsonl"))
    assert committed, f"the committed results of {notebook} are missing"
    (tmp_path / "results").mkdir()
    for path in committed:
        shutil.copy(path, tmp_path / "results")
    (executed,) = run_notebooks(profile="standard", only=[notebook], out=tmp_path, measure=False)  # as make figures
    assert not read_executed(executed.parent)[0].missing_figures()
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == sorted(p.name for p in committed)
    for fmt in ("png", "svg", "pdf"):  # PNG to read, SVG and PDF (fonts embedded) for papers
        assert len(list((tmp_path / "figures").glob(f"*.{fmt}"))) == figures, fmt
    # the committed figures are these bytes: make figures redraws them identically, on any machine
    changed = [p.name for p in sorted((tmp_path / "figures").iterdir())
               if p.read_bytes() != (committed_data() / "figures" / p.name).read_bytes()]
    assert not changed, f"make figures would change {changed}"


def test_figures_without_results_is_a_clear_error(tmp_path):
    from papermill.exceptions import PapermillExecutionError

    with pytest.raises(PapermillExecutionError, match="no 02_transfer-"):
        run_notebooks(profile="quick", only=["02_transfer_timing"], out=tmp_path, measure=False)
    # (the quick profile reads the engine results from the committed ones: the first missing is the timeline)
    with pytest.raises(PapermillExecutionError, match="no 03_timeline-"):
        run_notebooks(profile="quick", only=["03_connector_and_hooks"], out=tmp_path, measure=False)
