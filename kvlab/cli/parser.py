"""The command line's arguments: every command and its flags, as argparse sees them (what
each command does is kvlab.cli's COMMANDS)."""

from __future__ import annotations

import argparse

from kvlab.cache.layouts import LAYOUTS
from kvlab.experiments.load_test import REMOTE_TIERS
from kvlab.experiments.ttft import CONNECTOR_MODES
from kvlab.runtime.notebooks import PROFILES


def _positive_int(text: str) -> int:
    """An argparse type: an integer >= 1, else argparse's usage error naming the option."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """Every command and its flags (the handlers are kvlab.cli.COMMANDS)."""
    from kvlab import cli

    parser = argparse.ArgumentParser(prog="kvlab", description=cli.__doc__)
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

    doc = sub.add_parser("results-doc", help="render docs/results.md's measured numbers from the committed results")
    doc.add_argument("--results-dir", default=None, help="the results to render from (default: the committed ones)")
    doc.add_argument("--doc", default=None, help="the page (default: the checkout's docs/results.md)")
    doc.add_argument("--check", action="store_true", help="change nothing; exit 1 when the page is not what the "
                                                          "results render")

    bench = sub.add_parser("bench", help="time offload and load against this machine's copy ceiling")
    bench.add_argument("--profile", choices=["quick", "standard", "full", "gpu", "ceiling", "conversions", "dry"],
                       default=None, help="a preset sweep (default: full's methods and layouts for the models "
                                          "given; conversions: caches copied to and from other layouts)")
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
    load.add_argument("--mode", choices=list(CONNECTOR_MODES), default="whole-step",
                      help="the connector's mode; hooks: layerwise through kvlab's CPU attention backend")
    load.add_argument("--cross-layer", action="store_true",
                      help="ask vLLM for a cross-layer (BLHNC) cache: enable_cross_layers_blocks")
    load.add_argument("--remote", choices=REMOTE_TIERS, default=None,
                      help="a remote tier after disk, on a server started here, SIGKILLed once half the requests "
                           "are answered (the Redis server; the Mooncake master)")
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
                     help="open just this notebook, e.g. 07 or 07_extend_kvlab.ipynb "
                          "(default: the tabs JupyterLab saved last)")
    lab.add_argument("--port", type=int, default=None, help="default: a free one")
    lab.add_argument("--token", default=None, help="default: a random one, printed in the URL; '' turns the login off")
    lab.add_argument("--no-browser", action="store_true", help="do not open the desktop's browser")
    lab.add_argument("--notebooks-dir", default=None,
                     help="default: the repository's notebooks/; JupyterLab serves copies in lab/ beside it")
    return parser
