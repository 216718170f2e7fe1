"""Command line: ``python -m kvlab layout|bench|layerwise|notebooks|report|lab|models|lmeval ...``.

Imports torch only at start-up (matplotlib where a report needs it), so ``bench`` runs on
a bare GPU machine."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Any, Sequence

from kvlab.cache.geometry import resolve_model
from kvlab.cache.layouts import LAYOUTS, get_layout
from kvlab.cache.segments import transfer_cost
from kvlab.results import default_results_path
from kvlab.runtime.notebooks import PROFILES
from kvlab.transfer.registry import ALL_METHODS

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


def _positive_int(text: str) -> int:
    """An argparse type: an integer >= 1, else argparse's usage error naming the option."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _csv(text: str | None, kind: type = str) -> list | None:
    if text is None:
        return None
    try:
        return [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"expected a comma-separated list of {kind.__name__}, got {text!r}") from None


def run_bench(args: argparse.Namespace) -> None:
    from kvlab.experiments import bench

    profile = dict(bench.PROFILES["quick" if args.quick else args.profile or "full"])
    for key, value in (("models", _csv(args.model)), ("tokens", _csv(args.tokens, int)),
                       ("layouts", _csv(args.layouts)), ("methods", _csv(args.methods))):
        if value is not None:
            profile[key] = value
            if key in ("models", "tokens"):  # the sizes asked for, and only those
                profile.pop("extra_tokens", None)
    if any(t <= 0 for t in profile["tokens"]):
        raise ValueError(f"--tokens must be positive, got {profile['tokens']}")
    for layout in profile["layouts"]:
        get_layout(layout)
    unknown = [m for m in profile["methods"] if m not in ALL_METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {list(ALL_METHODS)}")
    stem = "02_ceiling" if args.profile == "ceiling" else "02_transfer"  # notebook 02 reads each its own way
    out = None if args.no_save else args.out or default_results_path(stem, args.device, args.results_dir)
    configs = bench.configs(profile, dtype=args.dtype, block_size=args.block_size)
    repeats = profile["repeats"] if args.repeats is None else args.repeats
    if args.runs < 1:
        raise ValueError(f"--runs must be at least 1, got {args.runs}")
    rows = []
    for _ in range(args.runs):  # back to back, each its own run record
        rows += bench.run_sweep(configs, args.device, repeats=repeats, out=out)
    print(bench.format_rows(rows))
    if args.profile == "ceiling":
        print(bench.format_targets(bench.ceiling_targets(rows)))
    if out:
        print(f"appended {len(rows)} rows to {out}")


def run_layerwise(args: argparse.Namespace) -> None:
    from kvlab.experiments import bench

    if args.compute == "attention":
        run_attention_layerwise(args)
        return
    out = None if args.no_save else args.out or default_results_path("02_layerwise", args.device, args.results_dir)
    rows = bench.run_pipeline_sweep(_csv(args.model), _csv(args.tokens, int), _csv(args.intensities, float),
                                    args.device, args.repeats, out=out)
    for row in rows:
        print(f"{row['model']:40s} {row['tokens']:6d} tokens  intensity {row['intensity']:<5g} "
              f"sequential {row['sequential_s'] * 1e3:8.2f} ms  layerwise {row['layerwise_s'] * 1e3:8.2f} ms  "
              f"speedup {row['speedup']:.2f} (ideal {row['ideal_speedup']:.2f})")
    if out:
        print(f"appended {len(rows)} rows to {out}")


def run_attention_layerwise(args: argparse.Namespace) -> None:
    from kvlab.experiments import bench

    out = None if args.no_save else args.out or default_results_path("02_attention", args.device, args.results_dir)
    rows = bench.run_attention_sweep(_csv(args.model), _csv(args.tokens, int), args.new_tokens, args.device,
                                     args.repeats, out=out)
    for row in rows:
        print(f"{row['model']:40s} {row['prefix_tokens']:6d} + {row['new_tokens']} tokens  "
              f"load {row['load_s'] * 1e3:8.2f} ms  attention {row['compute_s'] * 1e3:8.2f} ms  "
              f"sequential {row['sequential_s'] * 1e3:8.2f} ms  layerwise {row['layerwise_s'] * 1e3:8.2f} ms  "
              f"speedup {row['speedup']:.2f} (ideal {row['ideal_speedup']:.2f})")
    if out:
        print(f"appended {len(rows)} rows to {out}")


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
                                connector=args.connector)
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


def _interrupt(signum: int, frame: Any) -> None:
    """The first stop signal is a Ctrl-C; later ones are ignored, so they do not cut the stop short."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvlab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    lay = sub.add_parser("layout", help="what moving T tokens costs in one layout")
    lay.add_argument("--layout", default="LBHNC", help=f"one of: {', '.join(LAYOUTS)}")
    lay.add_argument("--model", default="llama-3.1-8b", help="a preset or a Hugging Face model folder")
    lay.add_argument("--dtype", default=None, help="KV dtype (default: the model's, bf16 for presets)")
    lay.add_argument("--tokens", type=int, default=256)
    lay.add_argument("--block-size", type=int, default=16)
    lay.add_argument("--block-ids", default="scattered", help="scattered, contiguous, or ids like 3,7,9")
    lay.add_argument("--num-blocks", type=int, default=None, help="blocks in the cache (default 4x needed)")
    lay.add_argument("--seed", type=int, default=0)
    lay.add_argument("--json", action="store_true", help="print JSON instead of a table")
    lay.add_argument("--list", action="store_true", help="list the layouts and exit")

    nb = sub.add_parser("notebooks", help="execute the notebooks headless, writing data/")
    nb.add_argument("--profile", choices=PROFILES, default="standard",
                    help="standard: minutes, the slowest engine sweeps drawn from the committed paper results; "
                         "paper: every sweep in full (over an hour on 2 cores); quick: as the tests run them")
    nb.add_argument("--only", nargs="*", default=None, help="notebook names (default: all)")
    nb.add_argument("--out", default="data", help="where figures and executed notebooks go")
    nb.add_argument("--from-results", action="store_true",
                    help="measure nothing: redraw every figure from the committed results")

    rep = sub.add_parser("report", help="rebuild data/report/index.html from the executed notebooks")
    rep.add_argument("--notebooks-dir", default="data/notebooks", help="the executed notebooks")
    rep.add_argument("--out", default="data/report", help="where index.html goes")

    bench = sub.add_parser("bench", help="time offload and load against this machine's copy ceiling")
    bench.add_argument("--profile", choices=["quick", "standard", "full", "gpu", "ceiling", "dry"], default=None,
                       help="a preset sweep (default: full's methods and layouts for the models given)")
    bench.add_argument("--quick", action="store_true", help="the quick profile: under a minute on a small CPU")
    bench.add_argument("--model", default=None, help="comma-separated presets or model folders")
    bench.add_argument("--tokens", default=None, help="comma-separated token counts, e.g. 256,1024,4096")
    bench.add_argument("--layouts", default=None, help="comma-separated layouts")
    bench.add_argument("--methods", default=None, help="comma-separated methods and peers")
    bench.add_argument("--dtype", default=None)
    bench.add_argument("--block-size", type=int, default=16)
    bench.add_argument("--device", default="auto", help="auto, cpu, cuda or npu")
    bench.add_argument("--repeats", type=int, default=None)
    bench.add_argument("--runs", type=int, default=1, help="sweeps back to back (the ceiling targets hold over three)")
    bench.add_argument("--out", default=None, help="JSONL file to append to (default data/results/02_transfer-<hardware>.jsonl)")
    bench.add_argument("--results-dir", default=None, help="where the default-named JSONL goes (default data/results)")
    bench.add_argument("--no-save", action="store_true", help="print only")

    lw = sub.add_parser("layerwise", help="layer-by-layer loading overlapped with compute, against load-then-compute")
    lw.add_argument("--model", default="llama-3.1-8b,qwen3-30b-a3b")
    lw.add_argument("--tokens", default="256,1024")
    lw.add_argument("--intensities", default="0.25,0.5,1,2,4", help="per-layer compute time / load time")
    lw.add_argument("--device", default="auto")
    lw.add_argument("--repeats", type=int, default=5)
    lw.add_argument("--compute", choices=["matmul", "attention"], default="matmul",
                    help="matmul: a stand-in tuned to each intensity; attention: kvlab's tiny attention stack over "
                         "the loaded prefix, through the hooks (rows go to 02_attention-<hardware>.jsonl)")
    lw.add_argument("--new-tokens", type=_positive_int, default=128,
                    help="with --compute attention: tokens computed over the prefix")
    lw.add_argument("--out", default=None, help="JSONL file (default data/results/02_layerwise-<hardware>.jsonl)")
    lw.add_argument("--results-dir", default=None, help="where the default-named JSONL goes (default data/results)")
    lw.add_argument("--no-save", action="store_true")

    models = sub.add_parser("models", help="prepare or list the local model folders (SmolLM2, a tiny Llama)")
    models_sub = models.add_subparsers(dest="action", required=True)
    prepare = models_sub.add_parser("prepare", help="build the folders that are missing (SmolLM2 from its GGUF)")
    prepare.add_argument("--only", choices=["smollm2", "tiny", "minis"], default=None,
                         help="one family (default: all)")
    listing = models_sub.add_parser("list", help="which folders are prepared, where, and their size")
    for models_parser in (prepare, listing):
        models_parser.add_argument("--models-dir", default=None,
                                   help="where the folders are (default $KVLAB_MODELS_DIR or data/models)")

    ev = sub.add_parser("lmeval", help="lm-eval's vLLM backend on local gsm8k-style problems, with/without KVLabConnector")
    ev.add_argument("--model", default="smollm2-135m-instruct-fp32", help="a prepared model name or a model folder")
    ev.add_argument("--connector", choices=["none", "kvlab", "vllm-prefix-cache", "both", "all"], default="both",
                    help="both: none and kvlab; all: also vLLM's own prefix cache (the control)")
    ev.add_argument("--limit", type=int, default=8, help="problems evaluated")
    ev.add_argument("--num-fewshot", type=int, default=5)
    ev.add_argument("--max-gen-toks", type=int, default=200)
    ev.add_argument("--seed", type=int, default=0, help="problem generator and engine seed")
    ev.add_argument("--task-dir", default=None, help="where the task folder is written (default: a temporary one)")

    load = sub.add_parser("loadtest", help="KVLabConnector through vllm serve under load and injected faults, "
                                           "every response against its same-split control")
    load.add_argument("--model", default="smollm2-135m-instruct-fp32", help="a prepared model name or a model folder")
    load.add_argument("--requests", type=int, default=240)
    load.add_argument("--clients", type=int, default=16, help="concurrent clients (and vLLM's max_num_seqs)")
    load.add_argument("--num-gpu-blocks", type=int, default=96, help="KV cache blocks of 32 tokens: a small cache")
    load.add_argument("--fault-interval", type=float, default=1.0, help="seconds between injected faults")
    load.add_argument("--connector", choices=["kvlab", "none"], default="kvlab",
                      help="none: vLLM's own prefix cache under the same load, no faults (the batching baseline)")
    load.add_argument("--measure", choices=["serve", "memory", "integrity"], default="serve",
                      help="serve: the load test; memory: the worker's RSS over --requests unique prompts with a "
                           "512 MiB memory tier; integrity: CRC32C and HMAC-SHA256 cost per byte")
    load.add_argument("--out", default=None, help="results file (default: data/results/05_load_test-<machine>.jsonl)")

    summary = sub.add_parser("device-summary", help="summarize a scripts/device-check run (the folder it wrote)")
    summary.add_argument("out", help="the device check's $OUT")
    summary.add_argument("--step", action="append", default=[], metavar="NAME=RC:SECONDS",
                         help="how a step of the script ended (repeatable)")

    lab = sub.add_parser("lab", help="JupyterLab on the notebooks, on 127.0.0.1 (other options go to jupyter lab)",
                         description="JupyterLab on the notebooks, on 127.0.0.1, as root too. Options not listed here "
                                     "go to jupyter lab as they are, written --Name=value, e.g. "
                                     "--ServerApp.shutdown_no_activity_timeout=3600.")
    lab.add_argument("notebook", nargs="?", default=None,
                     help="open just this notebook, e.g. 05 or 05_extend_kvlab.ipynb "
                          "(default: the tabs JupyterLab saved last)")
    lab.add_argument("--port", type=int, default=None, help="default: a free one")
    lab.add_argument("--token", default=None, help="default: a random one, printed in the URL; '' turns the login off")
    lab.add_argument("--no-browser", action="store_true", help="do not open the desktop's browser")
    lab.add_argument("--notebooks-dir", default=None,
                     help="default: the repository's notebooks/; JupyterLab serves copies in lab/ beside it")

    args, jupyter_args = parser.parse_known_args(argv)
    if jupyter_args and args.command != "lab":
        parser.error(f"unrecognized arguments: {' '.join(jupyter_args)}")
    try:
        if args.command == "layout":
            if args.list:
                for name, layout in LAYOUTS.items():
                    print(f"{name:28s} {layout.family:28s} {layout.shape_text}")
                return 0
            report = layout_report(args)
            if args.json:
                print(json.dumps(report, indent=2))
            else:
                print_report(report)
        elif args.command == "bench":
            run_bench(args)
        elif args.command == "layerwise":
            run_layerwise(args)
        elif args.command == "models":
            return run_models(args)
        elif args.command == "lmeval":
            return run_lmeval(args)
        elif args.command == "loadtest":
            return run_loadtest(args)
        elif args.command == "device-summary":
            return run_device_summary(args)
        elif args.command == "report":
            from kvlab.plotting.report import write_report

            write_report(args.notebooks_dir, args.out)
        elif args.command == "lab":
            return run_lab(args, jupyter_args)
        else:
            from kvlab.runtime.notebooks import run_notebooks

            from kvlab.plotting.report import write_report

            run_notebooks(profile=args.profile, only=args.only, out=args.out, measure=not args.from_results)
            write_report(Path(args.out) / "notebooks", Path(args.out) / "report")
    # what a user's input or machine causes (a bad value, a missing or unwritable file, a
    # missing package), each with its own message; anything else is a bug: a traceback
    except (ValueError, OSError, OverflowError, ModuleNotFoundError) as exc:
        print(f"kvlab: error: {exc}", file=sys.stderr)
        return 2
    return 0
