"""Pages rendered from the committed results, so a number a reader cites is never typed.
docs/results.md keeps its prose of how each thing was measured; between
``<!-- rendered: NAME -->`` and ``<!-- /rendered -->`` stands the Markdown that
``REGIONS[NAME]`` reads from a results directory: a notebook's reading (kvlab.plotting.story)
or a table of the rows, each naming whose run it quotes. ``make figures`` and ``python -m
kvlab results-doc`` rewrite every region; tests/plotting/test_documents.py fails when the
page and the committed rows differ."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

from kvlab.cache import preset
from kvlab.experiments import costmodel
from kvlab.experiments.engine_checks import against_control
from kvlab.experiments.peers import LEASE_MS
from kvlab.experiments.scale_model import calibration, fit_stores, predict
from kvlab.experiments.ttft import connector_costs, with_overheads
from kvlab.plotting.story import accuracy_tables, serving, tables, targets
from kvlab.plotting.story.accuracy import accuracy_takeaways, connectors_reading, generations_reading, task_reading
from kvlab.plotting.story.claims import paragraphs, prose
from kvlab.plotting.story.connector import layouts_reading, ttft_reading
from kvlab.plotting.story.transfer import break_even_reading, fit_reading, transfer_takeaways
from kvlab.results import committed_results_dir, load_results, results_for
from kvlab.runtime.mooncake import MooncakeStore

RESULTS_DOC = Path(__file__).resolve().parents[3] / "docs" / "results.md"
OPENING = re.compile(r"<!-- rendered: (?P<name>[a-z0-9-]+) -->")
CLOSING = "<!-- /rendered -->"
STALE = "run `make figures` (or `python -m kvlab results-doc`) and commit the page"

HEADLINE_MODEL, HEADLINE_TOKENS = "llama-3.1-8b", 1024  # notebook 02's headline transfer
SCALE_MODELS, SCALE_HOSTS = ("smollm2-135m", "llama-3.1-8b"), (1, 2, 4, 8, 16, 32, 64)  # notebook 04's scale model


class RenderError(ValueError):
    """A page that cannot be rendered: an unknown or unclosed region, or rows it needs missing."""


def every_run(stem: str, results: Path) -> list[dict]:
    """Every run in the results file of ``stem`` that holds the newest one (the runs a table
    compares, such as three back to back, or a test and its baseline)."""
    newest = results_for(stem, results)
    return load_results([results / newest[0]["source"]], latest=False)


def every_machines_runs(stem: str, results: Path) -> list[dict]:
    """Every run of ``stem`` on every machine that committed one, oldest first: a reading that
    sets runs side by side, each naming its hardware (the load test's runs before and after
    the results' names gained the vector instructions)."""
    files = sorted(results.glob(f"{stem}-*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no {stem}-*.jsonl in {results}: run with measure=True (make run) first")
    return sorted(load_results(files, latest=False), key=lambda row: row["run_date"] or "")


def _accuracy(results: Path) -> list[dict]:
    rows = results_for("04_accuracy", results)
    compared = {name: against_control([r for r in rows if r.get("table") == name])
                for name in ("generations", "perplexity")}
    return [*compared["generations"], *compared["perplexity"],
            *(r for r in rows if r.get("table") not in compared)]


def _transfer(results: Path) -> Any:
    model = preset(HEADLINE_MODEL).name
    here = results_for("02_transfer", results)
    return paragraphs(transfer_takeaways(here, model, HEADLINE_TOKENS, results_for("02_layerwise", results)),
                      tables.transfer_table(here, model, HEADLINE_TOKENS))


def _cost_model(results: Path) -> Any:
    here = results_for("02_transfer", results)
    fits = costmodel.fit(load_results(sorted(results.glob("02_transfer-*.jsonl"))))
    mine = [f for f in fits if f.hardware == here[0]["hardware"]]
    return paragraphs(fit_reading(costmodel.predictions(here, mine)),
                      break_even_reading([f for f in fits if f.method in ("segments", "gather")],
                                         preset(HEADLINE_MODEL).num_layers))


def _ttft(results: Path) -> Any:
    rows = with_overheads(results_for("03_ttft", results))
    return paragraphs(tables.ttft_table(rows), ttft_reading(rows))


def _prefix_rows(results: Path) -> list[dict]:
    return [r for r in results_for("03_beyond", results) if r["kind"] == "prefix"]


def _at_scale(results: Path) -> Any:
    beyond = results_for("03_beyond", results)
    fits = fit_stores([r for r in beyond if r["kind"] == "pace"])
    geometries = [preset(name, block_size=32) for name in SCALE_MODELS]
    scale = predict([f for f in fits if f.direction == "get"], geometries, hosts=SCALE_HOSTS,
                    servers={"redis cluster": 3})
    return serving.scale_reading(fits, calibration(fits, _prefix_rows(results)), scale, geometries[0].name, beyond)


def _targets(results: Path) -> Any:
    return targets.targets_table(*(results_for(stem, results) for stem in (
        "03_costs_by_length", "03_lookup_scaling", "03_redis_pace", "03_concurrency", "03_serving")))


def _connectors(results: Path) -> Any:
    rows = connector_costs(results_for("04_connectors", results))
    return paragraphs(accuracy_tables.connectors_table(rows), connectors_reading(rows))


def _accuracy_region(results: Path) -> Any:
    rows = _accuracy(results)
    return paragraphs(accuracy_tables.accuracy_table(rows),
                      generations_reading([r for r in rows if r.get("table") == "generations"]),
                      task_reading([r for r in rows if r.get("table") == "task"]))


# Each region of a page and what renders it from a results directory.
REGIONS: dict[str, Callable[[Path], Any]] = {
    "targets": _targets,
    "transfer": _transfer,
    "ceiling": lambda results: tables.ceiling_table(every_run("02_ceiling", results)),
    "conversions": lambda results: tables.conversions_table(results_for("02_conversions", results)),
    "cost-model": _cost_model,
    "ttft": _ttft,
    "engine-layouts": lambda results: layouts_reading(results_for("03_engine_layouts", results)),
    "backend-throughput": lambda results: tables.throughput_table(results_for("03_backend_throughput", results)),
    "layouts-sharing": lambda results: tables.layouts_sharing_table(results_for("03_layouts_sharing", results)),
    "engine-sharing": lambda results: tables.engine_sharing_table(results_for("03_engine_sharing", results)),
    "serve": lambda results: serving.serve_reading(results_for("03_serve", results)),
    "serving": lambda results: tables.serving_table(results_for("03_serving", results)),
    "sharing": lambda results: tables.sharing_table(results_for("03_sharing", results)),
    "redis": lambda results: serving.strategies_reading(results_for("03_network", results), "redis"),
    "mooncake": lambda results: serving.strategies_reading(_prefix_rows(results), "mooncake"),
    "redis-cluster": lambda results: serving.strategies_reading(_prefix_rows(results), "redis cluster"),
    "peers": lambda results: tables.peers_table(results_for("03_peers", results)),
    "lease": lambda results: serving.lease_reading(MooncakeStore.lease_ms, LEASE_MS),
    "at-scale": _at_scale,
    "hit-profile": lambda results: serving.profile_reading(results_for("03_overhead_profile", results)),
    "hit-profile-before": lambda results: serving.profile_reading(results_for("03_overhead_profile_before", results)),
    "tier-reads": lambda results: tables.tier_reads_table(results_for("03_tier_reads", results)),
    "lengths": lambda results: serving.lengths_reading(results_for("03_costs_by_length", results)),
    "lookups": lambda results: serving.lookups_reading(results_for("03_lookup_scaling", results)),
    "redis-pace": lambda results: serving.pace_reading(results_for("03_redis_pace", results)[0]),
    "concurrency": lambda results: serving.concurrency_reading(results_for("03_concurrency", results)),
    "load-test": lambda results: serving.load_test_reading(every_machines_runs("05_load_test", results)),
    "roundtrips": lambda results: accuracy_takeaways(results_for("04_roundtrip", results)),
    "accuracy": _accuracy_region,
    "damage": lambda results: accuracy_tables.damage_table(_accuracy(results)),
    "engine-differences": lambda results: accuracy_tables.differences_table(
        results_for("04_engine_differences", results)),
    "lmeval": lambda results: accuracy_tables.lmeval_table(results_for("04_lmeval", results)),
    "connectors": _connectors,
    "architectures": lambda results: paragraphs(
        accuracy_tables.architectures_table(results_for("04_architectures", results)),
        accuracy_takeaways(None, architectures=results_for("04_architectures", results))),
    "seed-request": lambda results: accuracy_tables.seed_table(results_for("04_seed_requests", results)),
}


def region(name: str, results_dir: str | Path) -> str:
    """The Markdown of one region, read from the results in ``results_dir``."""
    if name not in REGIONS:
        raise RenderError(f"unknown rendered region {name!r}; known: {', '.join(REGIONS)}")
    try:
        return str(REGIONS[name](Path(results_dir)) or prose(None)).strip()
    except (FileNotFoundError, ValueError) as error:
        raise RenderError(f"rendered region {name!r}: {error}") from error


def render(text: str, results_dir: str | Path) -> str:
    """``text`` with the body of every rendered region replaced by what its rows say now."""
    out: list[str] = []
    opened: tuple[str, int] | None = None
    for number, line in enumerate(text.split("\n"), 1):
        opening = OPENING.fullmatch(line.strip())
        if opening or (line.startswith("<!-- rendered") and not opening):
            if not opening:
                raise RenderError(f"line {number}: a malformed region marker {line!r} (names are a-z, 0-9 and -)")
            if opened:
                raise RenderError(f"line {number}: a region opens inside region {opened[0]!r} (line {opened[1]})")
            opened = opening["name"], number
            if opened[0] not in REGIONS:
                raise RenderError(f"line {number}: unknown rendered region {opened[0]!r}; known: {', '.join(REGIONS)}")
            out.append(line)
        elif line.strip() == CLOSING:
            if not opened:
                raise RenderError(f"line {number}: {CLOSING} closes no region")
            out += ["", region(opened[0], results_dir), "", line]
            opened = None
        elif not opened:
            out.append(line)
    if opened:
        raise RenderError(f"line {opened[1]}: region {opened[0]!r} is never closed with {CLOSING}")
    return "\n".join(out)


def rendered_regions(text: str) -> list[str]:
    """The names of the regions ``text`` renders, in order."""
    return [m["name"] for m in (OPENING.fullmatch(line.strip()) for line in text.split("\n")) if m]


def write_results_doc(results_dir: str | Path | None = None, path: str | Path = RESULTS_DOC,
                      check: bool = False) -> bool:
    """Render ``path`` (docs/results.md) from ``results_dir`` (the committed results by
    default) and write it back unless ``check``; True when its text changed (would change)."""
    path = Path(path)
    text = path.read_text()
    rendered = render(text, committed_results_dir() if results_dir is None else results_dir)
    if rendered != text and not check:
        path.write_text(rendered)
    return rendered != text
