"""One self-contained HTML page from the executed notebooks (data/notebooks -> data/report/
index.html), what `make run` and `make figures` leave for a reader: a contents list, the
profile and machine the notebooks ran with, and every figure embedded as a data URI so the
page still works when moved or served from GitHub Pages.

Code inputs are folded into a <details> element: the page is read for its prose, tables and
figures, and the code (the notebooks' calls into kvlab) stays one click away. Papermill's
injected-parameters cell (of copies made before kvlab wrote the parameters into the notebook's
own cell), stderr streams and widget outputs (tqdm bars, which need a live kernel and whose
text fallback is the bar's first frame) are left out. Error and stderr outputs are never
shown: a banner at the top names them (the tests allow neither).

Every image is a figure with a caption and alt text: those its notebook recorded with it
(kvlab.plotting.saving.save_figure shows each figure it saves so); a banner names an image
without them. A wide table scrolls sideways within the page instead of being cut off."""

from __future__ import annotations

import copy
import datetime
import sys
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any

import nbformat

REPORT_NAME = "index.html"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
IMAGE = "image/png"
LEFT_OUT_TAGS = {"injected-parameters", "papermill-error-cell-tag"}
EXTERNAL_SCRIPT_TYPES = {"text/x-mathjax-config"}  # configures the CDN MathJax left out below
STYLE = """
.kvlab-report { max-width: 1100px; margin: 0 auto; padding: 24px 16px 0; font-family: var(--jp-content-font-family); }
.kvlab-report dl { display: grid; grid-template-columns: max-content 1fr; gap: 4px 16px; }
.kvlab-report dt { font-weight: 600; }
.kvlab-report dd { margin: 0; }
.kvlab-errors { border: 3px solid #c62828; background: #ffebee; color: #b71c1c; padding: 12px 16px; margin: 16px 0; }
.kvlab-errors h2 { margin-top: 0; color: #b71c1c; }
.kvlab-contents ul { list-style: none; padding-left: 20px; }
.kvlab-contents li.kvlab-h3 { padding-left: 20px; }
.kvlab-contents .kvlab-run { color: var(--jp-content-font-color2); font-size: 90%; }
.kvlab-notebook { border-top: 2px solid var(--jp-border-color1); margin-top: 32px; }
/* a wide table scrolls within its output, with a scrollbar always shown (an overlay scrollbar,
   as macOS draws by default, leaves a table looking cut off at the page's edge) */
.kvlab-notebook .jp-OutputArea-output { overflow-x: auto; }
.kvlab-notebook .jp-OutputArea-output::-webkit-scrollbar { height: 10px; }
.kvlab-notebook .jp-OutputArea-output::-webkit-scrollbar-thumb { background: #b0b0b0; border-radius: 5px; }
.kvlab-notebook .jp-OutputArea-output::-webkit-scrollbar-track { background: #eeeeee; }
.kvlab-notebook .jp-OutputArea-output img { max-width: 100%; height: auto; }
.kvlab-notebook figure.kvlab-figure { margin: 0; }
.kvlab-notebook figure.kvlab-figure figcaption { font-size: 90%; color: var(--jp-content-font-color2); margin: 4px 0 8px; }
details.kvlab-code > summary { cursor: pointer; color: var(--jp-content-font-color2); margin-left: 64px;
  font: var(--jp-code-font-size) var(--jp-code-font-family); }
"""


@dataclass(frozen=True)
class ExecutedNotebook:
    """An executed notebook and what papermill recorded about its run."""
    path: Path
    node: nbformat.NotebookNode

    @property
    def papermill(self) -> dict[str, Any]:
        return self.node.metadata.get("papermill", {})

    @property
    def parameters(self) -> dict[str, Any]:
        return self.papermill.get("parameters", {})

    @property
    def profile(self) -> str:
        """The ``profile`` parameter when the notebook has one, else quick or full."""
        return self.parameters.get("profile") or ("quick" if self.parameters.get("quick") else "full")

    @property
    def measured(self) -> bool:
        return self.parameters.get("measure", True)

    @property
    def started(self) -> datetime.datetime | None:
        return _timestamp(self.papermill.get("start_time"))

    @property
    def ended(self) -> datetime.datetime | None:
        return _timestamp(self.papermill.get("end_time"))

    @property
    def duration_s(self) -> float | None:
        return self.papermill.get("duration")

    @property
    def title(self) -> str:
        for cell in self.node.cells:
            for line in cell.source.splitlines() if cell.cell_type == "markdown" else ():
                if line.startswith("# "):
                    return line[2:].strip()
        return self.path.stem

    def missing_figures(self) -> list[str]:
        """``In [n]: k of m figures shown`` for every cell that saves more figures
        (``save_figure(``) than it shows as images: a figure a reader never sees."""
        missing = []
        for cell in self.node.cells:
            saved = cell.source.count("save_figure(") if cell.cell_type == "code" else 0
            shown = sum(IMAGE in output.get("data", {}) for output in cell.get("outputs", []))
            if shown < saved:
                missing.append(f"In [{cell.get('execution_count')}]: {shown} of {saved} figures shown")
        return missing

    def images(self) -> int:
        """How many images the notebook's outputs hold."""
        return len(self.image_outputs())

    def image_outputs(self) -> list[tuple[int | None, dict[str, Any]]]:
        """Every image output the page shows, in order, as (its cell's execution count, its
        image's metadata)."""
        return [(cell.get("execution_count"), output.get("metadata", {}).get(IMAGE, {}))
                for cell in _readable(self.node).cells for output in cell.get("outputs", [])
                if IMAGE in output.get("data", {})]

    def undescribed_images(self) -> list[str]:
        """``In [n]: an image without alt text`` for every image recorded without a description."""
        return [f"In [{count}]: an image without alt text" for count, described in self.image_outputs()
                if not described.get("alt")]

    def stderr(self) -> list[str]:
        """``In [n]: first line`` for every stderr stream the notebook holds: a log line or a
        warning that the run should have captured (the tests allow none)."""
        return [f"In [{cell.get('execution_count')}]: {output.text.strip().splitlines()[0][:200] if output.text.strip() else ''}"
                for cell in self.node.cells for output in cell.get("outputs", [])
                if output.output_type == "stream" and output.name == "stderr"]

    def hygiene(self) -> list[str]:
        """What a clean executed notebook holds none of: an error, a stderr stream, a second
        parameters cell (papermill's injected one), a headline still waiting for its takeaways."""
        from kvlab.plotting.story import Headline

        tagged = [cell for cell in self.node.cells
                  if {"parameters", "injected-parameters"} & set(cell.metadata.get("tags", []))]
        waiting = [cell for cell in self.node.cells for output in cell.get("outputs", [])
                   if Headline.WAITING in str(output.get("data", {}).get("text/markdown", ""))]
        return (self.errors() + [f"stderr {line}" for line in self.stderr()]
                + ([f"{len(tagged)} parameters cells"] if len(tagged) > 1 else [])
                + ["a headline never filled in"] * len(waiting))

    def errors(self) -> list[str]:
        """``In [n]: EName: message`` for every error output the notebook holds."""
        return [f"In [{cell.get('execution_count')}]: {output.get('ename')}: {output.get('evalue')}"
                for cell in self.node.cells for output in cell.get("outputs", [])
                if output.output_type == "error"]


def read_executed(notebooks_dir: str | Path) -> list[ExecutedNotebook]:
    """The executed notebooks (``[0-9]*.ipynb``) in ``notebooks_dir``, in order."""
    notebooks_dir = Path(notebooks_dir)
    paths = sorted(notebooks_dir.glob("[0-9]*.ipynb"))
    if not paths:
        raise FileNotFoundError(f"no executed notebooks in {notebooks_dir}: run `make run` or `make figures` first")
    executed = []
    for path in paths:
        try:
            executed.append(ExecutedNotebook(path, nbformat.read(path, as_version=4)))
        except (ValueError, nbformat.ValidationError) as error:
            raise ValueError(f"{path} is not a notebook: {error}") from None
    return executed


def write_report(notebooks_dir: str | Path = "data/notebooks", out_dir: str | Path = "data/report",
                 results_dir: str | Path | None = None) -> Path:
    """Render the executed notebooks into ``out_dir/index.html``, say where on stderr as the
    runner's progress lines do, and return its path. The header names the machine building
    it (where `make run`/`make figures` just ran the notebooks) and the machines whose
    committed results the figures show (``results_dir``, by default the ``results`` folder
    beside ``notebooks_dir``)."""
    from bs4 import BeautifulSoup

    notebooks = read_executed(notebooks_dir)
    results_dir = Path(notebooks_dir).parent / "results" if results_dir is None else Path(results_dir)
    rendered = [_render(notebook) for notebook in notebooks]
    for notebook, (soup, _) in zip(notebooks, rendered):
        _describe_images(soup, notebook)
    page = rendered[0][0]  # the lab template's head and styles, once
    for script in page.head.find_all("script"):
        if script.get("src") or script.get("type") in EXTERNAL_SCRIPT_TYPES:
            script.decompose()  # require.js and MathJax from a CDN: nothing here needs them
    page.head.title.string = "kvlab notebooks: report"
    style = page.new_tag("style")
    style.string = STYLE
    page.head.append(style)
    main = page.new_tag("main")
    for notebook, (soup, _) in zip(notebooks, rendered):
        section = soup.body.main.extract()
        section.name = "section"
        section.attrs = {"id": notebook.path.stem, "class": "kvlab-notebook"}
        main.append(section)
    page.body.append(BeautifulSoup(_header(notebooks, results_dir, [h for _, h in rendered]), "html.parser"))
    page.body.append(main)
    out = Path(out_dir) / REPORT_NAME
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(str(page), encoding="utf-8")
    print(f"kvlab: report written to {out} ({out.stat().st_size / 2**20:.1f} MiB)", file=sys.stderr, flush=True)
    return out


def _render(notebook: ExecutedNotebook) -> tuple[Any, list[tuple[int, str, str]]]:
    """The notebook through nbconvert's lab template, with code inputs folded, and its
    headings as ``(level, text, anchor)`` with anchors unique across the report."""
    from bs4 import BeautifulSoup
    from nbconvert import HTMLExporter

    from kvlab.results import slug

    exporter = HTMLExporter(template_name="lab", embed_images=True)
    body, _ = exporter.from_notebook_node(_readable(notebook.node),
                                          resources={"metadata": {"path": str(notebook.path.parent)}})
    soup = BeautifulSoup(body, "html.parser")
    for wrapper in soup.select(".jp-CodeCell > .jp-Cell-inputWrapper"):
        details = wrapper.wrap(soup.new_tag("details", attrs={"class": "kvlab-code"}))
        summary = soup.new_tag("summary")
        summary.string = "code"
        details.insert(0, summary)
    headings, used = [], set()
    for heading in soup.body.find_all(["h1", "h2", "h3"]):
        for link in heading.find_all("a", class_="anchor-link"):
            link.decompose()
        text = heading.get_text(" ", strip=True)
        anchor = f"{notebook.path.stem}-{slug(text)}"
        while anchor in used:
            anchor += "-"
        used.add(anchor)
        heading["id"] = anchor
        headings.append((int(heading.name[1]), text, anchor))
    return soup, headings


def _describe_images(soup: Any, notebook: ExecutedNotebook) -> None:
    """Give each image of ``soup`` (the rendered ``notebook``) the alt text its output
    recorded, and a caption under it (the recorded caption, else the alt text): a <figure>."""
    images = [img for img in soup.select(".jp-RenderedImage img")]
    outputs = notebook.image_outputs()
    if len(images) != len(outputs):
        raise ValueError(f"{notebook.path.name}: {len(outputs)} image outputs rendered as {len(images)} images")
    for img, (count, described) in zip(images, outputs):
        alt = described.get("alt") or f"a figure without a description (In [{count}])"
        img["alt"] = alt
        figure = img.wrap(soup.new_tag("figure", attrs={"class": "kvlab-figure"}))
        caption = soup.new_tag("figcaption")
        caption.string = described.get("caption") or alt
        figure.append(caption)


def _readable(node: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A copy without what cannot or should not render statically (see the module doc)."""
    node = copy.deepcopy(node)
    node.metadata.pop("widgets", None)
    node.cells = [cell for cell in node.cells if not LEFT_OUT_TAGS & set(cell.metadata.get("tags", []))]
    for cell in node.cells:
        if "outputs" in cell:
            cell.outputs = [output for output in cell.outputs if output.output_type != "error"
                            and not (output.output_type == "stream" and output.name == "stderr")
                            and WIDGET_VIEW not in output.get("data", {})]
    return node


def _banner(found: list, heading: str, note: str) -> str:
    """An alert above the report listing each (notebook, what) in ``found``; "" when none."""
    if not found:
        return ""
    items = "".join(f"<li><a href='#{n.path.stem}'>{escape(n.path.name)}</a> {escape(what)}</li>" for n, what in found)
    return (f"<div class='kvlab-errors' role='alert'><h2>{len(found)} {heading}</h2><p>{note}</p>"
            f"<ul>{items}</ul></div>")


def _header(notebooks: list[ExecutedNotebook], results_dir: Path,
            headings: list[list[tuple[int, str, str]]]) -> str:
    from kvlab.results import fingerprint, load_results

    errors = [(n, error) for n in notebooks for error in n.errors()]
    missing = [(n, cell) for n in notebooks for cell in n.missing_figures()]
    undescribed = [(n, cell) for n in notebooks for cell in n.undescribed_images()]
    stderr = [(n, line) for n in notebooks for line in n.stderr()]
    banner = "".join(_banner(found, heading, note) for found, heading, note in (
        (errors, "error output(s): this run failed", "The errors are left out of the page below; read them in the "
         "executed notebooks."),
        (missing, "cell(s) saved a figure they do not show", "Those figures are in data/figures but not on this page."),
        (undescribed, "image(s) without a description", "A figure saved with kvlab.plotting.save_figure is shown with "
         "its caption and alt text."),
        (stderr, "stderr output(s)", "Log lines and warnings a cell let through, left out of the page below.")))
    profiles = sorted({n.profile for n in notebooks})
    starts = [n.started for n in notebooks if n.started]
    ends = [n.ended for n in notebooks if n.ended]
    when = f"{_date(min(starts))} to {_date(max(ends))}" if starts and ends else "unknown"
    total = sum(n.duration_s or 0 for n in notebooks)
    machine = fingerprint()
    results = sorted(results_dir.glob("*.jsonl")) if results_dir.is_dir() else []
    rows = [
        ("Notebooks ran with", escape(" / ".join(profiles)) + " profile" + (
            " (differs between notebooks: see the contents)" if len(profiles) > 1 else "")),
        ("Run", f"{when}; the notebooks took {_duration(total)} in all"),
        ("Built on", escape(_describe(machine)) + " (where <code>make run</code> or <code>make figures</code> ran the "
                                                  "notebooks, or <code>kvlab report</code> rebuilt this page)"),
        ("Figures measured on", _measured_on(load_results(results)) or "no committed results"),
    ]
    contents = "".join(_contents_entry(n, h) for n, h in zip(notebooks, headings))
    return (f"<header class='kvlab-report'><h1>kvlab notebooks</h1>{banner}"
            f"<dl>{''.join(f'<dt>{k}</dt><dd>{v}</dd>' for k, v in rows)}</dl></header>"
            f"<nav class='kvlab-report kvlab-contents'><h2>Contents</h2><ul>{contents}</ul></nav>")


def _measured_on(rows: list[dict[str, Any]]) -> str:
    """Each machine the results come from, with each profile it ran and the experiments
    measured so: what every figure's footer says, gathered in one place."""
    experiments: dict[str, dict[str, set[str]]] = {}
    for row in rows:
        if row.get("hardware"):
            stem = row["source"].split("-", 1)[0]
            experiments.setdefault(row["hardware"], {}).setdefault(row["profile"], set()).add(stem)
    return "<br>".join(
        f"<b>{escape(hardware)}</b>: " + "; ".join(f"{escape(profile)} profile ({', '.join(sorted(stems))})"
                                                 for profile, stems in sorted(profiles.items()))
        for hardware, profiles in sorted(experiments.items()))


def _contents_entry(notebook: ExecutedNotebook, headings: list[tuple[int, str, str]]) -> str:
    run = (f"{notebook.profile}, {'measured' if notebook.measured else 'redrawn from committed results'}, "
           f"{_date(notebook.started) if notebook.started else 'date unknown'}, "
           f"{_duration(notebook.duration_s) if notebook.duration_s is not None else 'duration unknown'}")
    sub = "".join(f"<li class='kvlab-h{level}'><a href='#{anchor}'>{escape(text)}</a></li>"
                  for level, text, anchor in headings if level > 1)
    return (f"<li><a href='#{notebook.path.stem}'>{escape(notebook.title)}</a> "
            f"<span class='kvlab-run'>({escape(run)})</span><ul>{sub}</ul></li>")


def _describe(machine: dict[str, Any]) -> str:
    from kvlab.plotting.common import human_bytes

    memory = f", {human_bytes(machine['memory_bytes'])} memory" if machine.get("memory_bytes") else ""
    versions = ", ".join(f"{name} {machine[name]}" for name in ("python", "torch", "vllm", "lmcache") if machine.get(name))
    commit = f", commit {machine['git_commit'][:12]}" if machine.get("git_commit") else ""
    return f"{machine['hardware']}{memory}; {versions}{commit}"


def _timestamp(text: str | None) -> datetime.datetime | None:
    try:
        return datetime.datetime.fromisoformat(text) if text else None
    except ValueError:
        return None


def _date(moment: datetime.datetime) -> str:
    return moment.astimezone(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"

