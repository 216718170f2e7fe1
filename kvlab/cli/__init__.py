"""Command line: ``python -m kvlab layout|bench|layerwise|notebooks|report|results-doc|lab|models|lmeval ...``.

Imports torch only at start-up (matplotlib where a report needs it), so ``bench`` runs on
a bare GPU machine."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from kvlab.cache.geometry import resolve_model
from kvlab.cache.layouts import LAYOUTS, get_layout
from kvlab.cache.segments import transfer_cost
from kvlab.cli.parser import build_parser
from kvlab.results import default_results_path

# what a service manager, Ctrl-C (or kill -INT) and a closed terminal send; SIGINT too because a
# shell starts a script's background job with SIGINT ignored, and Python then leaves it so
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _parse_block_ids(text: str) -> str | list[int]:
    if text in ("scattered", "contiguous"):
        return text
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--block-ids takes 'scattered', 'contiguous' or ids like 3,7,9, not {text!r}") from None


def layout_report(args: argparse.Namespace) -> dict:
    geometry = resolve_model(args.model, dtype=args.dtype, block_size=args.block_size)
    layout = get_layout(args.layout)
    cost = transfer_cost(layout, geometry, args.tokens, block_ids=_parse_block_ids(args.block_ids),
                         num_blocks=args.num_blocks, seed=args.seed)
    del cost["layout"]
    return {
        "geometry": geometry.describe(),
        "layout": layout.describe(),
        "bytes_per_page": geometry.page_bytes,
        "bytes_per_block_all_layers": geometry.block_bytes,
        **cost,
        "seed": args.seed,
    }


def run_layout(args: argparse.Namespace) -> int:
    if args.list:
        for name, layout in LAYOUTS.items():
            print(f"{name:28s} {layout.family:28s} {layout.shape_text}")
        return 0
    report = layout_report(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0


def print_report(report: dict) -> None:
    from kvlab.plotting.common import human_bytes

    g, layout = report["geometry"], report["layout"]
    mla = f"MLA latent {g['kv_lora_rank']}+{g['qk_rope_head_dim']}" if g["mla"] else f"{g['num_kv_heads']} kv heads x {g['head_size']}"
    rows = [
        ("model", f"{g['name']}: {g['num_layers']} layers, {mla}, {g['dtype']}"),
        ("layout", f"{layout['name']} ({layout['family']}): {layout['shape']}"),
        ("block size", f"{g['block_size']} tokens"),
        ("bytes per page", f"{human_bytes(report['bytes_per_page'])} (one layer, one block)"),
        ("bytes per block", f"{human_bytes(report['bytes_per_block_all_layers'])} (all layers)"),
        ("tokens moved", f"{report['tokens']} in {report['blocks']} {report['block_ids']} blocks of {report['num_blocks']}"),
        ("bytes moved", human_bytes(report["bytes_moved"])),
        ("segments", str(report["segments"])),
    ]
    rows += [("", f"{count} x {human_bytes(int(size))}") for size, count in report["segment_sizes"].items()]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def _csv(text: str | None, kind: type = str) -> list | None:
    if text is None:
        return None
    try:
        return [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"expected a comma-separated list of {kind.__name__}, got {text!r}") from None


def run_bench(args: argparse.Namespace) -> int:
    from kvlab.experiments import bench

    if args.runs < 1:
        raise ValueError(f"--runs must be at least 1, got {args.runs}")
    profile = dict(bench.PROFILES["quick" if args.quick else args.profile or "full"])
    for key, value in (("models", _csv(args.model)), ("tokens", _csv(args.tokens, int)),
                       ("layouts", _csv(args.layouts)), ("methods", _csv(args.methods))):
        if value is not None:
            profile[key] = value
            if key in ("models", "tokens"):  # the sizes asked for, and only those
                profile.pop("extra_tokens", None)
    configs = bench.configs(profile, dtype=args.dtype, block_size=args.block_size)  # refuses a bad profile
    # notebook 02 and the docs read each its own way
    stem = {"ceiling": "02_ceiling", "conversions": "02_conversions"}.get(args.profile, "02_transfer")
    out = None if args.no_save else args.out or default_results_path(stem, args.device, args.results_dir)
    repeats = profile["repeats"] if args.repeats is None else args.repeats
    rows = []
    for _ in range(args.runs):  # back to back, each its own run record
        rows += bench.run_sweep(configs, args.device, repeats=repeats, out=out)
    print(bench.format_rows(rows))
    if args.profile == "ceiling":
        print(bench.format_targets(bench.ceiling_targets(rows)))
    if out:
        print(f"appended {len(rows)} rows to {out}")
    return 0


def run_layerwise(args: argparse.Namespace) -> int:
    from kvlab.experiments import bench

    if args.compute == "attention":
        return run_attention_layerwise(args)
    out = None if args.no_save else args.out or default_results_path("02_layerwise", args.device, args.results_dir)
    rows = bench.run_pipeline_sweep(_csv(args.model), _csv(args.tokens, int), _csv(args.intensities, float),
                                    args.device, args.repeats, out=out)
    return _print_layerwise(rows, out, lambda row: f"{row['model']:40s} {row['tokens']:6d} tokens  "
                                                   f"intensity {row['intensity']:<5g} ")


def run_attention_layerwise(args: argparse.Namespace) -> int:
    from kvlab.experiments import bench

    out = None if args.no_save else args.out or default_results_path("02_attention", args.device, args.results_dir)
    rows = bench.run_attention_sweep(_csv(args.model), _csv(args.tokens, int), args.new_tokens, args.device,
                                     args.repeats, out=out)
    return _print_layerwise(rows, out, lambda row: f"{row['model']:40s} {row['prefix_tokens']:6d} + "
                                                   f"{row['new_tokens']} tokens  load {row['load_s'] * 1e3:8.2f} ms  "
                                                   f"attention {row['compute_s'] * 1e3:8.2f} ms  ")


def _print_layerwise(rows: list[dict], out, head) -> int:
    """One line per layerwise row (``head(row)``, then its sequential and layerwise times and
    the speed-up), and where the rows were appended."""
    for row in rows:
        print(f"{head(row)}sequential {row['sequential_s'] * 1e3:8.2f} ms  layerwise {row['layerwise_s'] * 1e3:8.2f} ms  "
              f"speedup {row['speedup']:.2f} (ideal {row['ideal_speedup']:.2f})")
    if out:
        print(f"appended {len(rows)} rows to {out}")
    return 0


def run_device_summary(args: argparse.Namespace) -> int:
    from kvlab.experiments.device_check import format_summary, summarize

    steps = {}
    for text in args.step:
        try:
            name, ended = text.split("=")
            rc, seconds = map(int, ended.split(":"))
        except ValueError:
            raise ValueError(f"--step takes NAME=RC:SECONDS, got {text!r}") from None
        steps[name] = {"rc": rc, "seconds": seconds}
    result = summarize(Path(args.out), steps)
    print(format_summary(result))
    return 0 if result["ok"] else 1


def run_models(args: argparse.Namespace) -> int:
    """``models prepare`` builds the local model folders, ``models list`` shows them; each
    prints one line a folder (name, state, size, path)."""
    from kvlab.plotting.common import human_bytes
    from kvlab.runtime import models

    if args.action == "prepare":
        models.prepare_all(args.models_dir, only=args.only)
    for model in models.list_models(args.models_dir):
        print(f"{model.name:28s} {model.state:10s} {human_bytes(model.size_bytes):>10s}  {model.path}")
    return 0


def run_lmeval(args: argparse.Namespace) -> int:
    """gsm8k-style problems (reasoning-gym) through lm-eval's vLLM backend, with and/or
    without KVLabConnector, one engine per process; prints the scores, hits and times."""
    import tempfile
    from pathlib import Path

    from kvlab.experiments import lmeval
    from kvlab.runtime import models

    model = args.model if Path(args.model).is_dir() else models.model_path(args.model)
    lmeval.check_run(model, limit=args.limit, num_fewshot=args.num_fewshot, max_gen_toks=args.max_gen_toks)
    connectors = {"both": ["none", "kvlab"], "all": ["none", "vllm-prefix-cache", "kvlab"]}.get(args.connector,
                                                                                                [args.connector])
    with tempfile.TemporaryDirectory() as tmp:
        task_dir = lmeval.write_task(args.task_dir or tmp, seed=args.seed)
        rows = lmeval.compare_connectors(model, task_dir, connectors, limit=args.limit, num_fewshot=args.num_fewshot,
                                         seed=args.seed, max_gen_toks=args.max_gen_toks)
    print(lmeval.format_rows(rows))
    for connector in connectors:
        row = next(r for r in rows if r["connector"] == connector)
        print(f"{connector}: {row['wall_s']:.1f} s, connector hits {row['hit_tokens']} tokens, "
              f"generations identical to {connectors[0]}: {row['identical_generations']} of {row['problems']}")
    return 0


def run_loadtest(args: argparse.Namespace) -> int:
    """KVLabConnector through ``vllm serve`` under load and faults, every response against its
    same-split control (kvlab.experiments.load_test); or (``--measure``) the worker's memory
    with a full memory tier, or the chunk checks' cost. Appends one summary row to
    data/results; the load test exits 1 unless no request failed and none left the bound."""
    import tempfile
    from pathlib import Path

    from transformers import AutoTokenizer

    from kvlab.experiments.load_test import LoadTest, integrity_costs, worker_memory
    from kvlab.experiments.tasks import book_text
    from kvlab.results import default_results_path, record_run
    from kvlab.runtime import models

    if args.measure != "serve" and (args.mode != "whole-step" or args.cross_layer or args.remote):
        raise ValueError(f"--mode, --cross-layer and --remote set up the load test (--measure serve), "
                         f"not --measure {args.measure}")
    model = args.model if Path(args.model).is_dir() else str(models.model_path(args.model))
    if args.measure == "integrity":
        summary, stem = integrity_costs(), "05_integrity_costs"
    else:
        ids = AutoTokenizer.from_pretrained(model)(book_text())["input_ids"]
        if args.measure == "memory":
            summary, stem = worker_memory(model, ids, prompts=args.requests), "05_worker_memory"
        else:
            with tempfile.TemporaryDirectory() as tmp:
                test = LoadTest(model, tmp, requests=args.requests, clients=args.clients,
                                num_gpu_blocks=args.num_gpu_blocks, fault_interval_s=args.fault_interval,
                                connector=args.connector, mode=args.mode, cross_layer=args.cross_layer,
                                remote=args.remote)
                summary = {k: v for k, v in test.run(ids).items() if k != "rows"}
            stem = "05_load_test"
    out = args.out or default_results_path(stem, "cpu")
    record_run(out, [summary], "cpu")
    print(json.dumps({k: v for k, v in summary.items() if k != "rss_mib"}, indent=2))
    print(f"appended the summary to {out}")
    if args.measure != "serve":
        return 0
    return 0 if summary["failed"] == 0 and summary["within_drift"] == summary["requests_sent"] else 1


def run_lab(args: argparse.Namespace, jupyter_args: Sequence[str]) -> int:
    """JupyterLab on working copies of the notebooks (lab/, kvlab.runtime.lab.working_copies:
    running one never writes into notebooks/), opening just the notebook named, until Ctrl-C,
    SIGTERM or SIGHUP (or until it is shut down from its File menu); prints the URL to open,
    token included, and where its log goes, and opens it unless --no-browser."""
    import threading
    import webbrowser

    from kvlab.runtime.lab import JupyterLab, LabError, find_notebook, working_copies
    from kvlab.runtime.notebooks import NOTEBOOKS_DIR

    committed = args.notebooks_dir or NOTEBOOKS_DIR
    folder, kept = working_copies(committed)
    for line in kept:
        print(f"kvlab: {line}", file=sys.stderr)
    notebook = find_notebook(folder, args.notebook) if args.notebook else None
    lab = JupyterLab(folder, port=args.port, token=args.token, extra_args=jupyter_args)
    # JupyterLab and its kernels run in process groups of their own, which a service manager's
    # SIGTERM, kill -INT or a closed terminal's SIGHUP does not reach: each becomes a Ctrl-C, so
    # the with block stops them
    previous = {sig: signal.signal(sig, _interrupt) for sig in STOP_SIGNALS}
    try:
        with lab:
            url = lab.lab_url(notebook)
            print(f"JupyterLab on {folder} (copies of {committed}): open {url}\n"
                  f"its log: {lab.log_path}; Ctrl-C stops it", flush=True)
            if not args.no_browser:
                # in a thread, as Jupyter does: a console browser would block until it is closed
                threading.Thread(target=webbrowser.open, args=(url,), daemon=True).start()
            return lab.process.wait()
    except KeyboardInterrupt:  # stopped on the way out of the with block
        return 0
    except LabError as exc:
        print(f"kvlab: error: {exc}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_report(args: argparse.Namespace) -> int:
    from kvlab.plotting.report import write_report

    write_report(args.notebooks_dir, args.out)
    return 0


def run_notebooks(args: argparse.Namespace) -> int:
    """Execute the notebooks headless into ``--out``, then rebuild the report from them; drawn
    from the committed results (make figures), also render docs/results.md from them. A run
    that measures (make run) leaves the page alone: its new rows are not committed yet."""
    from kvlab.plotting.report import write_report
    from kvlab.results import committed_as_in_git, committed_results_dir
    from kvlab.runtime.notebooks import run_notebooks as execute

    with committed_as_in_git() as solutions_env:  # the solutions' answers read what is committed
        execute(profile=args.profile, only=args.only, out=args.out, measure=not args.from_results,
                solutions_env=solutions_env)
    write_report(Path(args.out) / "notebooks", Path(args.out) / "report")
    drawn_from = Path(args.out) / "results"
    if args.from_results and drawn_from.resolve() == committed_results_dir().resolve():
        return run_results_doc(argparse.Namespace(results_dir=drawn_from, doc=None, check=False))
    return 0


def run_results_doc(args: argparse.Namespace) -> int:
    """Render docs/results.md's regions from the results (``--check``: exit 1, changing
    nothing, when the page is not what they render)."""
    from kvlab.plotting.story.documents import RESULTS_DOC, STALE, write_results_doc

    doc = Path(args.doc) if args.doc else RESULTS_DOC
    changed = write_results_doc(args.results_dir, doc, check=args.check)
    if args.check and changed:
        print(f"kvlab: {doc} is not what the results render: {STALE}", file=sys.stderr)
        return 1
    print(f"kvlab: {doc} {'rendered' if changed else 'already renders'} the results", file=sys.stderr)
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    """The first stop signal is a Ctrl-C; later ones are ignored, so they do not cut the stop short."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt


# one handler per command: each takes the parsed arguments and the ones argparse did not
# know (only lab accepts any: they go to jupyter lab), and returns the exit status
COMMANDS: dict[str, Callable[[argparse.Namespace, Sequence[str]], int]] = {
    "layout": lambda args, extra: run_layout(args),
    "notebooks": lambda args, extra: run_notebooks(args),
    "report": lambda args, extra: run_report(args),
    "results-doc": lambda args, extra: run_results_doc(args),
    "bench": lambda args, extra: run_bench(args),
    "layerwise": lambda args, extra: run_layerwise(args),
    "models": lambda args, extra: run_models(args),
    "lmeval": lambda args, extra: run_lmeval(args),
    "loadtest": lambda args, extra: run_loadtest(args),
    "device-summary": lambda args, extra: run_device_summary(args),
    "lab": run_lab,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, jupyter_args = parser.parse_known_args(argv)
    if jupyter_args and args.command != "lab":
        parser.error(f"unrecognized arguments: {' '.join(jupyter_args)}")
    try:
        return COMMANDS[args.command](args, jupyter_args)
    # what a user's input or machine causes (a bad value, a missing or unwritable file, a
    # missing package), each with its own message; anything else is a bug: a traceback
    except (ValueError, OSError, OverflowError, ModuleNotFoundError) as exc:
        print(f"kvlab: error: {exc}", file=sys.stderr)
        return 2
