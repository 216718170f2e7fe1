"""The rendered report (data/report/index.html) built from the committed executed notebooks:
every notebook and heading in its contents, the profile and machine in its header, every
image embedded, no error output; and, in a headless browser, that it loads and draws so."""

import os
from pathlib import Path

import pytest
from bs4 import BeautifulSoup
from conftest import committed_data

from kvlab.plotting.report import ExecutedNotebook, read_executed, write_report

COMMITTED = committed_data() / "notebooks"
ERROR_OUTPUT = "[data-mime-type='application/vnd.jupyter.stderr']"  # nbconvert's mark on errors (and stderr)
pytestmark = pytest.mark.xdist_group("report")  # one worker builds the shared report


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_report(COMMITTED, tmp_path_factory.mktemp("report"))


def test_report_from_the_committed_notebooks(report):
    from kvlab.results import fingerprint

    notebooks = read_executed(COMMITTED)
    page = BeautifulSoup(report.read_text(), "html.parser")
    contents = page.select_one("nav.kvlab-contents")
    links = [a["href"] for a in contents.select("a")]
    for notebook in notebooks:
        assert notebook.errors() == [], f"{notebook.path.name} holds error output"
        assert f"#{notebook.path.stem}" in links
        assert page.find("section", id=notebook.path.stem) is not None
    assert len(links) > 2 * len(notebooks)  # the headings too
    assert all(page.find(id=href[1:]) is not None for href in links), "a contents link without its anchor"
    header = page.select_one("header.kvlab-report").get_text(" ")
    assert fingerprint()["hardware"] in header
    for notebook in notebooks:
        assert notebook.profile in header
    images = page.find_all("img")
    assert images and all(img["src"].startswith("data:image/") for img in images)
    # every figure a notebook saves is shown there, and every image the notebooks show is on the page
    assert [(n.path.name, n.missing_figures()) for n in notebooks] == [(n.path.name, []) for n in notebooks]
    assert len(images) == sum(n.images() for n in notebooks)
    assert not page.select(".kvlab-errors") and not page.select(ERROR_OUTPUT)
    assert not page.find_all("script", src=True), "the page loads nothing from outside"
    assert "widget-view" not in str(page)


def test_profile_from_the_papermill_parameters():
    import nbformat

    def profile(parameters: dict) -> str:
        node = nbformat.from_dict({"metadata": {"papermill": {"parameters": parameters}}, "cells": []})
        return ExecutedNotebook(Path("01.ipynb"), node).profile

    assert profile({"profile": "paper", "quick": False}) == "paper"
    assert profile({"quick": True}) == "quick"
    assert profile({"quick": False, "measure": True}) == "full"


def _executed(folder: Path, *cells) -> Path:
    """A one-notebook folder as papermill leaves it (quick profile)."""
    import nbformat

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# 01 · Small"), *cells])
    notebook.metadata["papermill"] = {"parameters": {"profile": "quick"}, "duration": 1.0}
    nbformat.write(notebook, folder / "01_small.ipynb")
    return folder


def test_an_error_is_named_at_the_top_and_not_shown(tmp_path):
    import nbformat

    cell = nbformat.v4.new_code_cell("1 / 0", execution_count=3, outputs=[nbformat.v4.new_output(
        "error", ename="ZeroDivisionError", evalue="division by zero", traceback=["Traceback: the frames"])])
    page = BeautifulSoup(write_report(_executed(tmp_path, cell), tmp_path / "report").read_text(), "html.parser")
    banner = page.select_one(".kvlab-errors").get_text(" ")
    assert "In [3]: ZeroDivisionError: division by zero" in banner
    assert not page.select(ERROR_OUTPUT) and "the frames" not in str(page)


def test_a_figure_saved_but_not_shown_is_named_at_the_top(tmp_path):
    import nbformat

    saved_only = nbformat.v4.new_code_cell('save_figure(fig, "x", figures_dir)', execution_count=3)
    shown = nbformat.v4.new_code_cell('save_figure(fig, "y", figures_dir)', execution_count=4, outputs=[
        nbformat.v4.new_output("display_data", data={"image/png": "iVBORw0KGgo=", "text/plain": "<Figure>"})])
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# t"), saved_only, shown]),
                   tmp_path / "01_t.ipynb")
    (notebook,) = read_executed(tmp_path)
    assert notebook.missing_figures() == ["In [3]: 0 of 1 figures shown"] and notebook.images() == 1
    page = BeautifulSoup(write_report(tmp_path, tmp_path / "out").read_text(), "html.parser")
    assert "1 cell(s) saved a figure they do not show" in page.select_one(".kvlab-errors").get_text()


def test_kvlab_report_rebuilds_it(tmp_path, capsys):
    import nbformat

    from kvlab.cli import main

    cell = nbformat.v4.new_code_cell("print(42)", execution_count=1,
                                     outputs=[nbformat.v4.new_output("stream", name="stdout", text="42\n")])
    assert main(["report", "--notebooks-dir", str(_executed(tmp_path, cell)), "--out", str(tmp_path / "out")]) == 0
    assert f"report written to {tmp_path / 'out' / 'index.html'}" in capsys.readouterr().err
    assert main(["report", "--notebooks-dir", str(tmp_path / "none")]) == 2
    assert "no executed notebooks" in capsys.readouterr().err


def test_make_run_and_make_figures_end_with_the_report(tmp_path, monkeypatch):
    """`kvlab notebooks` (make run, make figures) writes the report after the notebooks;
    papermill is stood in for by a copy of the committed executed notebook (no kernel starts)."""
    import shutil

    import papermill

    from kvlab.cli import main

    monkeypatch.setattr(papermill, "execute_notebook",
                        lambda source, target, **_: shutil.copy(COMMITTED / Path(source).name, target))
    assert main(["notebooks", "--profile", "quick", "--only", "07_extend_kvlab", "--out", str(tmp_path),
                 "--from-results"]) == 0
    page = BeautifulSoup((tmp_path / "report" / "index.html").read_text(), "html.parser")
    assert [s["id"] for s in page.find_all("section")] == ["07_extend_kvlab"]


def test_the_committed_executed_notebooks_are_clean():
    """What `make run` or `make figures` last committed (data/notebooks/: every section,
    engines included, in the standard profile): no error, no stderr, one parameters cell, each
    headline filled in; one copy per notebook."""
    from kvlab.runtime.notebooks import notebook_paths

    notebooks = read_executed(COMMITTED)
    assert [n.path.stem for n in notebooks] == [path.stem for path in notebook_paths()]
    assert {n.path.name: n.hygiene() for n in notebooks} == {n.path.name: [] for n in notebooks}


def test_hygiene_sees_what_a_run_should_not_leave(tmp_path):
    from nbformat.v4 import new_code_cell, new_output

    from kvlab.plotting.story import Headline

    stderr = new_code_cell("tier = MooncakeTier(url)", execution_count=4, outputs=[
        new_output("stream", name="stderr", text="I1207 05:21:18.175084  7954 client_metric.cpp:102] metrics\n")])
    given = new_code_cell("profile = 'standard'", metadata={"tags": ["parameters"]})
    injected = new_code_cell("profile = 'quick'", metadata={"tags": ["injected-parameters"]})
    waiting = new_code_cell("headline = Headline()", outputs=[
        new_output("display_data", data={"text/markdown": Headline.WAITING})])
    (notebook,) = read_executed(_executed(tmp_path, given, injected, stderr, waiting))
    assert notebook.hygiene() == ["stderr In [4]: I1207 05:21:18.175084  7954 client_metric.cpp:102] metrics",
                                  "2 parameters cells", "a headline never filled in"]
    banner = BeautifulSoup(write_report(tmp_path, tmp_path / "out").read_text(), "html.parser").get_text(" ")
    assert "1 stderr output(s)" in banner and "client_metric.cpp" in banner


def test_no_notebooks_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no executed notebooks"):
        write_report(tmp_path, tmp_path / "report")


@pytest.mark.slow
def test_report_in_a_browser(report, tmp_path):
    from browser import browser_missing, headless_chromium

    if browser_missing():
        pytest.skip(browser_missing())
    problems = []
    with headless_chromium() as browser:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("pageerror", lambda error: problems.append(f"script error: {error}"))
        page.on("request", lambda request: None if request.url.startswith(("file:", "data:"))
                else problems.append(f"fetched {request.url}"))
        assert page.goto(report.as_uri(), wait_until="load").ok
        images = page.evaluate("""async () => Promise.all(Array.from(document.images).map(
            async img => { await img.decode().catch(() => null); return img.naturalWidth; }))""")
        unresolved = page.evaluate("""() => Array.from(document.querySelectorAll('nav.kvlab-contents a'))
            .map(a => a.getAttribute('href')).filter(h => !document.getElementById(h.slice(1)))""")
        errors = page.locator(f".kvlab-errors, {ERROR_OUTPUT}").count()
        screenshot = page.screenshot(path=tmp_path / "report.png", full_page=True)
    if os.environ.get("KVLAB_SCREENSHOTS"):
        folder = Path(os.environ["KVLAB_SCREENSHOTS"])
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "report.png").write_bytes(screenshot)
    assert images and all(width > 0 for width in images), f"images not drawn: {images}"
    assert unresolved == []
    assert errors == 0
    assert problems == []


def test_every_image_of_the_committed_report_has_a_caption_and_alt_text(report):
    """Each figure a notebook saves is shown with the caption and alt text save_figure gave
    it, never nbconvert's "No description has been provided for this image"."""
    page = BeautifulSoup(report.read_text(), "html.parser")
    images = page.select(".jp-RenderedImage img")
    assert images
    for img in images:
        assert img.get("alt") and "No description" not in img["alt"] and "without a description" not in img["alt"]
        caption = img.find_parent("figure").find("figcaption")
        assert caption is not None and caption.get_text(strip=True)


def _image_cell(metadata: dict, count: int = 2):
    import nbformat

    return nbformat.v4.new_code_cell('save_figure(fig, "x", figures_dir);', execution_count=count, outputs=[
        nbformat.v4.new_output("display_data", data={"image/png": "iVBORw0KGgo=", "text/plain": "<Figure>"},
                               metadata=metadata)])


def test_an_image_is_a_figure_with_its_recorded_caption_and_alt_text(tmp_path):
    described = _image_cell({"image/png": {"alt": "Figure x: dots against time.", "caption": "Time, measured."}})
    page = BeautifulSoup(write_report(_executed(tmp_path, described), tmp_path / "out").read_text(), "html.parser")
    (img,) = page.select(".jp-RenderedImage img")
    assert img["alt"] == "Figure x: dots against time."
    assert img.find_parent("figure").figcaption.get_text() == "Time, measured."
    assert not page.select(".kvlab-errors")


def test_an_image_without_a_description_is_named_at_the_top(tmp_path):
    page = BeautifulSoup(write_report(_executed(tmp_path, _image_cell({}, 7)), tmp_path / "out").read_text(),
                         "html.parser")
    assert "1 image(s) without a description" in page.select_one(".kvlab-errors").get_text()
    assert "In [7]" in page.select_one(".jp-RenderedImage img")["alt"]


@pytest.mark.slow
def test_a_wide_table_scrolls_instead_of_being_cut_off(tmp_path):
    """A table wider than the page scrolls within its output, behind a scrollbar a reader
    sees: with overlay scrollbars (macOS's default), one hidden until used left the table
    looking cut off at the page's edge."""
    import nbformat

    from browser import browser_missing, headless_chromium

    if browser_missing():
        pytest.skip(browser_missing())
    columns = "".join(f"<th>a long column name {i}</th>" for i in range(40))
    wide = nbformat.v4.new_code_cell("table", execution_count=1, outputs=[nbformat.v4.new_output(
        "execute_result", execution_count=1, data={"text/html": f"<table class='dataframe'><tr>{columns}</tr></table>",
                                                   "text/plain": "table"})])
    report = write_report(_executed(tmp_path, wide), tmp_path / "out")
    with headless_chromium(overlay_scrollbars=True) as browser:
        page = browser.new_page(viewport={"width": 900, "height": 700})
        assert page.goto(report.as_uri(), wait_until="load").ok
        box = page.evaluate("""() => { const table = document.querySelector('table.dataframe');
            const box = table.closest('.jp-OutputArea-output');
            const shown = box.offsetHeight - box.clientHeight;  // room a drawn scrollbar takes
            box.scrollLeft = box.scrollWidth;
            return {scrollbar: shown, wider: box.scrollWidth > box.clientWidth,
                    table_right: table.getBoundingClientRect().right, box_right: box.getBoundingClientRect().right,
                    page: document.documentElement.clientWidth}; }""")
    assert box["wider"] and box["scrollbar"] > 0, box
    assert box["table_right"] <= box["box_right"] + 1 and box["box_right"] <= box["page"] + 1, box
