"""docs/results.md is rendered from the committed results, never typed: the committed page is
what the rows render, a changed row changes the page, and no measured number stands in the
README, docs/results.md or a notebook's markdown outside a rendered region."""

import difflib
import json
import re
import shutil
from pathlib import Path

import pytest

from kvlab.cli import main
from kvlab.plotting.story.documents import (CLOSING, OPENING, REGIONS, RESULTS_DOC, STALE, RenderError, region,
                                            render, rendered_regions)
from kvlab.results import committed_results_dir, results_for

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))

# A number with a unit of time or throughput, a ratio or a share: how a measurement reads (a
# confidence level, "a 95% bootstrap interval", is a setting, not a measurement).
MEASURED = re.compile(r"(?<![\w.])[-−]?\d[\d,]*(?:\.\d+)?(?:\s?(?:ms|µs|us|s|GB/s|MB/s|GiB/s|MiB/s|req/s|"
                      r"requests/s|tok/s|tokens/s)\b|[x×](?!\w)|\s?%(?!\s*(?:bootstrap|confidence)))")
SOURCE = re.compile(r"#\d+|arXiv|doi\.org|https?://")  # a quotation naming where its numbers come from


def typed_numbers(markdown: str) -> list[str]:
    """The measured-looking numbers of ``markdown`` outside rendered regions, fenced code and
    blockquotes that name their source, each with its line."""
    found: list[str] = []
    quote: list[tuple[int, str]] = []
    in_region = in_fence = False

    def check(lines: list[tuple[int, str]]) -> None:
        found.extend(f"line {number}: {match.group()!r} in {text.strip()[:100]!r}"
                     for number, text in lines for match in MEASURED.finditer(text))

    for number, line in enumerate(markdown.split("\n"), 1):
        stripped = line.strip()
        if stripped.startswith(">") and not (in_region or in_fence):
            quote.append((number, line))
            continue
        if quote and not SOURCE.search(" ".join(text for _, text in quote)):
            check(quote)
        quote = []
        if stripped.startswith("```"):
            in_fence = not in_fence
        elif OPENING.fullmatch(stripped):
            in_region = True
        elif stripped == CLOSING:
            in_region = False
        elif not (in_region or in_fence):
            check([(number, line)])
    if quote and not SOURCE.search(" ".join(text for _, text in quote)):
        check(quote)
    return found


def test_typed_numbers_finds_measurements_outside_regions_code_and_sourced_quotes():
    page = "\n".join(["took 12.5 ms, 1.4x and 3 % here; 2,000 tokens, 0.32 and a 95% bootstrap interval are not",
                      "<!-- rendered: lease -->", "rendered 9.9 ms", CLOSING,
                      "```console", "$ kvlab bench  # 8.1 GB/s", "```",
                      "> 0.8400 against 4.2 ms", "> (vllm-ascend #2039, published)", "",
                      "> 7 ms quoted from nowhere", "", "ends at 63.6 req/s"])
    assert [hit.split(":")[0] for hit in typed_numbers(page)] == ["line 1"] * 3 + ["line 11", "line 13"]
    assert typed_numbers("> a quotation: 5.0 tok/s\n> with no source") != []


def test_the_committed_page_is_what_the_committed_results_render():
    text = RESULTS_DOC.read_text()
    rendered = render(text, committed_results_dir())
    diff = "".join(list(difflib.unified_diff(text.splitlines(True), rendered.splitlines(True), "committed",
                                             "rendered"))[:60])
    assert rendered == text, f"docs/results.md is not what the committed results render: {STALE}\n{diff}"


def test_every_region_renders_on_the_page():
    assert sorted(rendered_regions(RESULTS_DOC.read_text())) == sorted(REGIONS)


@pytest.mark.parametrize("page", ["README.md", "docs/results.md"])
def test_no_measured_number_is_typed(page):
    typed = typed_numbers((ROOT / page).read_text())
    assert typed == [], (f"{page} types measured numbers outside its rendered regions (render them from the "
                         f"results, kvlab.plotting.story.documents, or quote them with their source):\n"
                         + "\n".join(typed))


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_no_measured_number_is_typed_in_a_notebooks_markdown(notebook):
    cells = json.loads(notebook.read_text())["cells"]
    typed = [f"cell {index}, {hit}" for index, cell in enumerate(cells) if cell["cell_type"] == "markdown"
             for hit in typed_numbers("".join(cell["source"]))]
    assert typed == [], (f"{notebook.name} types measured numbers in its markdown (read them from the rows: "
                         "kvlab.plotting.story):\n" + "\n".join(typed))


def _edit(results: Path, stem: str, match: dict, **changes) -> dict:
    """Change the row of ``stem``'s newest run that matches ``match``; returns it as it was."""
    newest = results_for(stem, results)
    path = results / newest[0]["source"]
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    (row,) = [r for r in records if r.get("run_id") == newest[0]["run_id"] and r.get("record") != "run"
              and all(r.get(key) == value for key, value in match.items())]
    before = dict(row)
    row.update(changes)
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
    return before


def test_the_page_follows_a_changed_row(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(committed_results_dir(), results)
    before = _edit(results, "03_concurrency", {"server": "KVLabConnector", "concurrency": 16}, throughput_rps=99.87,
                   throughput_samples_rps=None)
    theirs = next(r for r in results_for("03_concurrency", results)
                  if r["server"] == "vLLM prefix cache" and r["concurrency"] == 16)
    ours = next(line for line in region("concurrency", results).splitlines() if line.startswith("- KVLabConnector ("))
    assert "16 at a time 99.9 req/s" in ours and f"16 at a time {before['throughput_rps']:.1f} req/s" not in ours
    assert f"{99.87 / theirs['throughput_rps']:.2f}× against a target of at least" in region("targets", results)

    _edit(results, "03_ttft", {"scenario": "KVLab whole-step, memory"}, median_s=0.2, min_s=0.19, max_s=0.21,
          samples_s=None)
    assert "| KVLab whole-step, memory | 200.0 (190.0–210.0) ms |" in region("ttft", results)
    page = render(RESULTS_DOC.read_text(), results)
    assert "200.0 (190.0–210.0) ms" in page and "200.0 (190.0–210.0) ms" not in RESULTS_DOC.read_text()


def test_render_keeps_the_prose_and_replaces_each_region(tmp_path):
    page = "how it was measured\n<!-- rendered: lease -->\nan old 12.0 ms\n<!-- /rendered -->\nthe end\n"
    rendered = render(page, tmp_path)  # the lease reads no rows
    assert rendered.startswith("how it was measured\n<!-- rendered: lease -->\n\n") and rendered.endswith(
        "\n\n<!-- /rendered -->\nthe end\n")
    assert "an old 12.0 ms" not in rendered and "leases an object for" in rendered
    assert render(rendered, tmp_path) == rendered


@pytest.mark.parametrize("page, error", [
    ("<!-- rendered: nope -->\n<!-- /rendered -->", "line 1: unknown rendered region 'nope'"),
    ("<!-- rendered: lease -->\ntext", "line 1: region 'lease' is never closed"),
    ("text\n<!-- /rendered -->", "line 2: <!-- /rendered --> closes no region"),
    ("<!-- rendered: lease -->\n<!-- rendered: ttft -->", "line 2: a region opens inside region 'lease'"),
    ("<!-- rendered: Lease rows -->", "line 1: a malformed region marker"),
    ("<!-- rendered: ttft -->\n<!-- /rendered -->", "rendered region 'ttft': no 03_ttft-"),
])
def test_a_page_that_cannot_be_rendered_is_a_clear_error(tmp_path, page, error):
    with pytest.raises(RenderError, match=re.escape(error)):
        render(page, tmp_path)  # an empty results folder


def test_results_doc_command_checks_and_renders(tmp_path, capsys):
    page = tmp_path / "results.md"
    page.write_text("<!-- rendered: lease -->\nstale\n<!-- /rendered -->\n")
    command = ["results-doc", "--doc", str(page), "--results-dir", str(tmp_path)]
    assert main([*command, "--check"]) == 1 and "stale" in page.read_text()
    assert "make figures" in capsys.readouterr().err
    assert main(command) == 0 and "stale" not in page.read_text()
    assert main([*command, "--check"]) == 0


def test_the_load_test_region_sets_every_machines_runs_side_by_side(tmp_path):
    """Two machines' load-test files: both runs, the older first."""
    run = {"record": "run", "hardware": "cpu: A (2 cores)", "profile": "paper"}
    row = {"requests_sent": 8, "clients": 2, "num_gpu_blocks": 96, "failed": 0, "differing_tokens": 0,
           "within_drift": 8, "max_gap": 0.0, "identical": 8, "hits": 3, "kvlab": {}, "faults": {}}
    for machine, date, hits in (("a", "2026-12-07", 5), ("b", "2026-12-02", 3)):  # the newer file sorts first
        lines = [{**run, "hardware": f"cpu: {machine.upper()} (2 cores)", "date": date, "run_id": machine},
                 {**row, "hits": hits, "run_id": machine}]
        (tmp_path / f"05_load_test-cpu-{machine}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    text = region("load-test", tmp_path)
    assert text.index("3 prefix hits (run: cpu: B (2 cores)") < text.index("5 prefix hits (run: cpu: A (2 cores)")
