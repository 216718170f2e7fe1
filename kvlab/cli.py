"""Command line: ``python -m kvlab layout ...`` and ``python -m kvlab notebooks``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from kvlab.geometry import resolve_model
from kvlab.layouts import LAYOUTS, get_layout
from kvlab.plotting import human_bytes
from kvlab.segments import transfer_cost


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
    nb.add_argument("--quick", action="store_true", help="small sizes, as the tests run them")
    nb.add_argument("--only", nargs="*", default=None, help="notebook names (default: all)")
    nb.add_argument("--out", default="data", help="where figures and executed notebooks go")

    args = parser.parse_args(argv)
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
        else:
            from kvlab.notebooks import run_notebooks

            run_notebooks(quick=args.quick, only=args.only, out=args.out)
    except ValueError as exc:
        print(f"kvlab: error: {exc}", file=sys.stderr)
        return 2
    return 0
