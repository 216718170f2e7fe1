"""Markdown tables read from result rows, for the pages rendered from them (docs/results.md):
what a notebook shows as a DataFrame, as a reader cites it. Each table is captioned with
whose run it shows, and a number carries its spread where the rows keep one. Notebooks 02
to 05 here; notebook 06's in accuracy_tables."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from kvlab.experiments.targets import CONVERSION_TARGET, CPU_TARGETS, ceiling_targets
from kvlab.experiments.tier_reads import ONE_THREAD_STREAM, STREAM
from kvlab.experiments.ttft import engine_floor
from kvlab.harness.spread import MEDIAN_ONLY, Estimate, difference, ratio, row_estimate, spread, summary
from kvlab.plotting.common import as_records, human_bytes, model_name, short_hardware
from kvlab.plotting.story.claims import Prose, amount, number, paragraphs, quantity, quoted, span, versus


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table (a ``|`` inside a cell escaped)."""
    def line(cells: Sequence[Any]) -> str:
        return "| " + " | ".join(str(cell).replace("|", "\\|") for cell in cells) + " |"

    return "\n".join([line(header), "|" + "---|" * len(header), *map(line, rows)])


def captioned(caption: str, header: Sequence[str], rows: Iterable[Sequence[Any]], measured: Any) -> Prose:
    """A table under a caption that ends with whose run ``measured`` (the rows) is."""
    return Prose(f"{caption} {quoted(measured)}:\n\n{markdown_table(header, rows)}")


def _ratio_cell(row: dict | None) -> str:
    """``0.83 (0.80–0.87)``: a ratio to the ceiling with its quartiles over the repeats."""
    if row is None:
        return ""
    return f"{row['ratio']:.2f} ({row.get('ratio_q1', row['ratio']):.2f}–{row.get('ratio_q3', row['ratio']):.2f})"


def transfer_table(rows: Any, model: str, tokens: int) -> Prose:
    """Notebook 02: each layout's and method's share of the same-run copy ceiling moving
    ``tokens`` scattered tokens of ``model`` to host memory, offload / load."""
    rows = [r for r in as_records(rows) if r.get("status") == "ok" and r["model"] == model and r["tokens"] == tokens
            and r.get("block_ids") == "scattered" and r.get("target") == "host" and number(r.get("ratio"))]
    if not rows:
        raise ValueError(f"no transfer rows of {model} at {tokens} tokens (scattered, to host memory)")
    at = {(r["layout"], r["method"], r["direction"]): r for r in rows}
    layouts, methods = dict.fromkeys(r["layout"] for r in rows), list(dict.fromkeys(r["method"] for r in rows))
    body = []
    for layout in layouts:
        first = next(r for r in rows if r["layout"] == layout)
        body.append([f"{layout} ({first['segments']:,} × {human_bytes(first['mean_segment_bytes'])})"]
                    + [" / ".join(_ratio_cell(at.get((layout, m, d))) for d in ("offload", "load")) for m in methods])
    return captioned(f"{model_name(model)}, {tokens:,} tokens in scattered blocks: each method's median share of "
                     f"the same-run copy ceiling (interquartile range over {span(r.get('repeats', 1) for r in rows)} "
                     "repeats), offload / load", ["layout (segments × size)", *methods], body, rows)


def _verdict(row: dict, goal: float) -> str:
    low, high = row.get("ratio_q1", row["ratio"]), row.get("ratio_q3", row["ratio"])
    return "met" if low >= goal else "missed" if high < goal else "within the spread of the target"


def ceiling_table(rows: Any) -> Prose:
    """The CPU copy engines against their targets, per run: the best method of each group in
    its worse direction, judged on its interquartile range, and the ceilings it ran under."""
    rows = as_records(rows)
    targets = ceiling_targets(rows)
    if not targets:
        raise ValueError("no ceiling-profile rows to judge the CPU targets on")
    by = {(r["run_id"], r["layout"], r["method"], r["direction"]): r for r in rows
          if r.get("status") == "ok" and r.get("target") == "host"}
    runs = list(dict.fromkeys(t["run_id"] for t in targets))
    body = []
    for name, goal in CPU_TARGETS.items():
        cells = []
        for run in runs:
            best = next((t for t in targets if t["run_id"] == run and t["target"] == name), None)
            row = best and by[(run, best["layout"], best["method"], best["direction"])]
            cells.append(f"{best['layout']} `{best['method']}` ({best['direction']}) {_ratio_cell(row)}: "
                         f"{_verdict(row, goal)}" if row else "")
        body.append([name, f"{goal:.2f}", *cells])
    ceilings = [r["ceiling_gbps"] for r in rows if number(r.get("ceiling_gbps"))]
    streams = [r["native_ceiling_gbps"] for r in rows if number(r.get("native_ceiling_gbps"))]
    native = [t["native_ratio"] for t in targets if t["target"] == "cross-layer" and number(t.get("native_ratio"))]
    machines = "; ".join(dict.fromkeys(short_hardware(r.get("hardware")) for r in rows))
    table = captioned(f"The best method of each group in its worse direction, median share of the same-run ceiling "
                      f"(interquartile range), one column a run back to back on {machines}",
                      ["target", "at least", *(f"run {i}" for i in range(1, len(runs) + 1))], body, rows)
    ceilings_line = (f"The ceiling (torch's contiguous copy of the same bytes) was {span(ceilings, ' GB/s', 1)} "
                     f"and the STREAM-style copy {span(streams, ' GB/s', 1)}" if streams else
                     f"The ceiling was {span(ceilings, ' GB/s', 1)}")
    against = (f"; the best cross-layer method reached {span(native, '', 2)} of the STREAM-style copy." if native
               else ".")
    return Prose(f"{table}\n\n{ceilings_line}{against}")


def conversions_table(rows: Any) -> Prose:
    """Engines of other layouts or tensor-parallel sizes sharing one store: each (cache
    layout, stored layout, shards) case's best method in each direction, median share of the
    same-run ceiling, beside the cache's copy into its own layout, judged against
    CONVERSION_TARGET by the worse direction."""
    rows = [r for r in as_records(rows) if r.get("status") == "ok" and number(r.get("ratio"))]
    best: dict[tuple, dict] = {}
    for r in rows:
        key = (r["model"], r["tokens"], r["layout"], r["target"], r.get("ranks", 1), r["direction"])
        if key not in best or r["ratio"] > best[key]["ratio"]:
            best[key] = r
    pairs = list(dict.fromkeys(key[:5] for key in best if key[3] != "host" or key[4] > 1))
    if not pairs:
        raise ValueError("no conversion rows (kvlab bench --profile conversions)")
    body, loads = [], {True: [], False: []}  # converted loads by whether their runs are whole pages
    for model, tokens, layout, stored, ranks in pairs:
        load, offload = (best.get((model, tokens, layout, stored, ranks, d)) for d in ("load", "offload"))
        if load and number(load.get("native_ratio")):
            loads[load["mean_segment_bytes"] >= PAGE_BYTES].append(load["native_ratio"])
        own = [best.get((model, tokens, layout, "host", 1, d)) for d in ("load", "offload")]
        moved = [r for r in (load, offload) if r]
        worse = min(moved, key=lambda r: r["ratio"])
        streams = [r["native_ratio"] for r in moved if number(r.get("native_ratio"))]
        physical = "" if not streams else "met" if min(streams) >= CONVERSION_TARGET else f"missed ({min(streams):.2f})"
        shard = "" if ranks == 1 else f", one of {ranks} TP shards"
        body.append([model_name(model), f"{tokens:,}", f"{layout} ← {layout if stored == 'host' else stored}{shard}",
                     f"{load['segments']:,} × {human_bytes(load['mean_segment_bytes'])}" if load else "",
                     *(_best_cell(r) for r in (load, own[0], offload, own[1])), _verdict(worse, CONVERSION_TARGET),
                     physical])
    table = captioned(f"A cache's scattered blocks copied from (load) and into (offload) a host buffer of another "
                     f"layout or holding one tensor-parallel shard of its heads (loaded: gathered into the cache's "
                     f"heads; offloaded: the heads a rank slices out of a chunk of every head), the best method's "
                     f"median share of the same-run copy ceiling (interquartile range over "
                     f"{span(r.get('repeats', 1) for r in rows)} repeats) and of the STREAM-style copy, beside the "
                     f"cache's copy to and from its own layout; judged by the worse direction against "
                     f"{CONVERSION_TARGET:.2f} of the ceiling, and of the STREAM-style copy (its median)",
                     ["model", "tokens", "cache ← stored", "segments × size (load)", "load, converted", "load, own layout",
                      "offload, converted", "offload, own layout", f"at least {CONVERSION_TARGET:.2f}",
                      f"at least {CONVERSION_TARGET:.2f} of STREAM"], body, rows)
    kinds = [f"{what} reached {span(loads[pages], '', 2)} of the STREAM-style copy" for pages, what in (
        (True, "converted loads in runs of whole pages"),
        (False, "converted loads in runs of one head of one token (token-major against head-major pages)"))
             if loads[pages]]
    reading = "; ".join(kinds)
    return paragraphs(table, Prose(f"{reading[:1].upper()}{reading[1:]}.") if kinds else None)


def layouts_sharing_table(rows: Any) -> Prose:
    """Notebook 04: engines of two layouts sharing one store (hit_costs.layouts_sharing):
    each layout's whole-step hit from each file tier of chunks it stored, and of chunks the
    other layout stored, converted as they load; in all and the copy, and what converting
    costs, claimed only beyond the spread."""
    rows = as_records(rows)
    samples = {(r["tiers"], r["layout"], r["stored_as"], r["call"]): r["samples_ms"] for r in rows}
    hits = list(dict.fromkeys((r["tiers"], r["layout"]) for r in rows))
    if not hits:
        raise ValueError("no rows of layouts sharing a store (hit_costs.layouts_sharing)")
    body, compared = [], []
    for tier, layout in hits:
        other = next((s for t, l, s, _ in samples if (t, l) == (tier, layout) and s != layout), None)
        if other is None or (tier, layout, layout, "total") not in samples:
            continue
        own, converted = (samples[(tier, layout, stored, "total")] for stored in (layout, other))
        body.append([tier, layout, other,
                     *(_ms(spread([s / 1e3 for s in samples[(tier, layout, stored, call)]]))
                       for stored in (layout, other) for call in ("total", "copy"))])
        compared.append(versus(difference(converted, own), f"a {layout} hit from {tier} of {other}'s chunks",
                               "one of its own"))
    first = rows[0]
    table = captioned(f"A {first['tokens']:,}-token whole-step hit ({first['kv_bytes'] / 1e6:,.1f} MB), every connector "
                      f"call timed, median (min–max) over {len(own)} repeats: of chunks the engine stored itself, "
                      f"and of chunks an engine of the other layout stored, converted as they load",
                      ["tier", "engine", "the other layout", "its own: in all", "its own: the copy",
                       "converted: in all", "converted: the copy"], body, rows)
    return paragraphs(table, Prose(" ".join(f"{c[0].upper()}{c[1:]}." for c in compared)))


def engine_sharing_table(rows: Any) -> Prose:
    """Notebook 04: engines of two layouts sharing one store, in time to first token
    (engine_sharing.engines_sharing_a_store): each reader's overhead over its own prefix hit
    on a chunk stored as it lies and on one the other layout stored, and what converting
    costs, claimed only beyond the spread."""
    rows = as_records(rows)
    by = {(r["layout"], r["stored_as"]): r for r in rows}
    readers = list(dict.fromkeys(r["layout"] for r in rows))
    if not readers:
        raise ValueError("no rows of engines sharing a store (engine_sharing.engines_sharing_a_store)")
    body, compared = [], []
    for reader in readers:
        own = by.get((reader, reader))
        converted = next((r for (layout, stored), r in by.items() if layout == reader and stored != reader), None)
        if own is None or converted is None:
            continue
        samples = {r["stored_as"]: r["overhead_samples_s"] for r in (own, converted)}
        body.append([reader, converted["stored_as"],
                     *(cell for r in (own, converted) for cell in (_ms(spread(samples[r["stored_as"]])),
                                                                    f"{r['identical_to_control']} of 1")),
                     _ms(summary(own["floor_s"], own["floor_s"], own["floor_s"], own["samples"]))])
        compared.append(versus(difference([1e3 * s for s in samples[converted["stored_as"]]],
                                          [1e3 * s for s in samples[reader]]),
                               f"a {reader} engine's hit of {converted['stored_as']}'s chunks", "one of its own"))
    first = rows[0]
    table = captioned(f"Two engines sharing one {first['tier']} folder: each reads a {first['cached_tokens']:,}-token"
                      f" prefix ({first['kv_bytes'] / 1e6:,.1f} MB) an engine of its own layout stored and one the"
                      f" other layout stored, converted as it loads; the time to first token over the same engine's"
                      f" own prefix hit right after it, median (min–max) over {first['samples']} pairs, its outputs"
                      f" against the writer's own prefix hit (the same split: bitwise)",
                      ["engine", "the other layout", "its own: overhead", "its own: bitwise", "converted: overhead",
                       "converted: bitwise", "the engine's prefix hit"], body, rows)
    return paragraphs(table, Prose(" ".join(f"{c[0].upper()}{c[1:]}." for c in compared)))


PAGE_BYTES = 4096  # a run this long or longer moves whole pages (one head's tokens of a block)


def _best_cell(row: dict | None) -> str:
    """``0.95 (0.93–0.97) `memcpy`, 1.01 of STREAM``: a best method's share of the ceiling,
    and of the STREAM-style copy where the run timed one."""
    if row is None:
        return ""
    stream = f", {row['native_ratio']:.2f} of STREAM" if number(row.get("native_ratio")) else ""
    return f"{_ratio_cell(row)} `{row['method']}`{stream}"


def _ms(estimate: Estimate) -> str:
    """``86.5 (85.2–108.9) ms``: a timing in seconds as a table cell, its interval in brackets
    (bare where the row kept no spread; the caption says which interval)."""
    value = estimate.scaled(1e3)
    if value.how == MEDIAN_ONLY or value.low == value.high:
        return amount(value.value, "ms", 1)
    return f"{value.value:,.1f} ({value.low:,.1f}–{value.high:,.1f}) ms"


def ttft_table(ttft: Any) -> Prose:
    """Notebook 03, section 1: each scenario's time to first token beside its own engine's
    prefix hit (rows of ttft.with_overheads; the overheads are the reading's)."""
    rows = as_records(ttft)
    body = [[r["scenario"], _ms(row_estimate(r)),
             _ms(row_estimate(engine_floor(r))) if r.get("phase") != "cold" and number(r.get("engine_floor_s")) else "",
             f"{r['identical']} of {r['prompts']}"] for r in rows]
    first = rows[0]
    return captioned(f"{model_name(first['model'])}, {first['prompt_tokens']:,}-token prompts, time to first token: "
                     f"median (min–max) over {span(r.get('samples') or 1 for r in rows)} samples a scenario",
                     ["scenario", "time to first token", "its engine's own prefix hit",
                      "generations identical to recompute"], body, rows)


def _range(row: dict, key: str) -> Any:
    low, high = row[f"{key}_range"]
    return summary(row[key], min(low, row[key]), max(high, row[key]), row["rounds"])


def throughput_table(rows: Any) -> Prose:
    """Notebook 04, section 1: prefill and decode throughput of plain CPU_ATTN and kvlab's
    backend on each layout, with each ratio's range over the interleaved rounds."""
    rows = as_records(rows)
    body = [[r["backend"], r["layout"], amount(r["prefill_tok_s"], "tok/s", 0), amount(r["decode_tok_s"], "tok/s", 1),
             quantity(_range(r, "prefill_ratio"), "×", 2), quantity(_range(r, "decode_ratio"), "×", 2)] for r in rows]
    first = rows[0]
    return captioned(f"{model_name(first['model'])}, no connector: prefill of {first['prompt_tokens']:,.0f}-token "
                     f"prompts, {first['decode_tokens']} tokens decoded; medians over {first['rounds']} interleaved "
                     "rounds, each ratio against plain CPU_ATTN taken within a round",
                     ["engine", "layout", "prefill", "decode", "prefill ratio", "decode ratio"], body, rows)


def serving_table(serving: Any) -> Prose:
    """Notebook 05, section 1: vLLM's own processes, each engine's prefix hit, warm time to
    first token, overhead, the model runner's time in save calls, and decode throughput."""
    rows = as_records(serving)

    def ms(row: dict, key: str) -> str:
        return amount(1e3 * row[key], "ms", 1) if number(row.get(key)) else ""

    body = [[r["engine"], ms(r, "floor_s"), ms(r, "warm_s"), ms(r, "overhead_s"), ms(r, "save_s_per_reference"),
             amount(r["tokens_per_s"], "tok/s", 1) if number(r.get("tokens_per_s")) else "",
             f"{r['identical']} of {r['prompts']}" if number(r.get("prompts")) else ""] for r in rows]
    stored = next((r["stored_bytes"] for r in rows if number(r.get("stored_bytes"))), None)
    per = f" per {stored / 2**20:,.1f} MiB stored" if stored else ""
    return captioned(f"{model_name(rows[0]['model'])} through vLLM's default processes, medians whose samples these "
                     "rows did not keep (no difference is claimed from them)",
                     ["engine", "its own prefix hit", "warm", "over its own prefix hit",
                      f"model runner in save calls{per}", "decode", "identical to the plain engine"], body, rows)


def sharing_table(sharing: Any) -> Prose:
    """Notebook 05, section 1: engines that read what another process stored (shared memory,
    Redis) and tensor-parallel ranks, each against the writer's tokens and logprobs."""
    rows = as_records(sharing)

    def listed(value: Any) -> str:
        return ", ".join(f"{v:,}" for v in value) if isinstance(value, list) else f"{value:,}"

    body = [[r["engine"], model_name(r["model"]), r["ranks"], listed(r["cached_tokens"]), listed(r["prompt_tokens"]),
             listed(r["loaded_blocks_per_rank"]), r["shm_reads"], r["redis_reads"], r["load_errors"],
             f"{r['identical']} of {r['prompts']}", f"{r['max_logprob_diff']:.2g}"] for r in rows]
    return captioned("Engines sharing stored KV", ["engine", "model", "ranks", "cached tokens", "of prompt tokens",
                                                   "blocks loaded per rank", "shared-memory reads", "Redis reads",
                                                   "failed loads", "identical to the writer",
                                                   "largest logprob difference"], body, rows)


def peers_table(peers: Any) -> Prose:
    """Notebook 04, section 3: vLLM's and LMCache's own connectors and kvlab's tiers on a
    Mooncake Store and a Redis Cluster, engine B loading what engine A stored."""
    rows = as_records(peers)
    body = [[r["peer"], r["store"], r.get("version", ""), "yes" if r.get("runs") else f"no: {r.get('reason')}",
             f"{r['loaded_tokens']:,}" if number(r.get("loaded_tokens")) else "",
             "yes" if r.get("identical_to_control") else "no",
             f"{r['logprob_diff_vs_control']:.2g}" if number(r.get("logprob_diff_vs_control")) else "",
             f"{r['gap_to_cold']:.2g}" if number(r.get("gap_to_cold")) else "",
             f"{r['objects_per_chunk']:,.2f}" if number(r.get("objects_per_chunk")) else "",
             ", ".join(map(str, r.get("keys_per_node") or []))] for r in rows]
    return captioned("Engine B, a new process, loading what engine A stored, against the same-split control",
                     ["peer", "store", "version", "runs", "tokens loaded", "tokens and logprobs bitwise the control's",
                      "logprob difference from the control", "largest gap to A's whole prefill", "objects a chunk",
                      "keys a node"], body, rows)


_READ_PARTS = ("open and check the headers", "read and checksum", "copy into the cache")
READ_WAYS = {"buffered": "buffered, then copied", "into the cache": "straight into the cache"}


def tier_reads_table(rows: Any) -> Prose:
    """Notebook 05, section 2: a hit from each file tier part by part, read into a buffer
    and copied, or straight into the cache, beside the memory tier's copy; each whole read
    as a multiple of the STREAM copy of its bytes, and the two ways compared within their
    spread (rows of tier_reads.tier_read_profile)."""
    rows = as_records(rows)
    parts = {(r["tier"], r["path"], r["part"]): r["samples_ms"] for r in rows}
    stream = parts.get(("memory", "reference", STREAM))
    single = parts.get(("memory", "reference", ONE_THREAD_STREAM))  # runs before it have none
    if not rows or not stream:
        return Prose("")
    ways = [(tier, path) for tier, path in dict.fromkeys((r["tier"], r["path"]) for r in rows) if path != "reference"]

    def whole(tier: str, path: str) -> list[float]:
        """The read's samples in all: its last part when it has no total of its own."""
        return next(parts[(tier, path, p)] for p in ("in all", *reversed(_READ_PARTS)) if (tier, path, p) in parts)

    body = [[tier, READ_WAYS.get(path, path),
             *(_ms(spread([s / 1e3 for s in parts[(tier, path, p)]])) if (tier, path, p) in parts else ""
               for p in _READ_PARTS),
             _ms(spread([s / 1e3 for s in whole(tier, path)])), quantity(ratio(whole(tier, path), stream), "×", 2),
             *([quantity(ratio(whole(tier, path), single), "×", 2)] if single else [])]
            for tier, path in ways]
    first = rows[0]
    on_one = f", on one thread {_ms(spread([s / 1e3 for s in single]))}" if single else ""
    table = captioned(f"A {first['tokens']:,}-token hit ({first['kv_bytes'] / 1e6:,.1f} MB in {first['chunks']} "
                      f"chunks of {first['layout']}), read on one thread, median (min–max) over "
                      f"{len(stream)} repeats; the STREAM copy of its bytes on this machine's threads "
                      f"{_ms(spread([s / 1e3 for s in stream]))}{on_one}",
                      ["tier", "read", *_READ_PARTS, "in all", "× the STREAM copy",
                       *(["× one thread's STREAM copy"] if single else [])], body, rows)
    compared = [versus(difference(parts[(tier, "into the cache", "read and checksum")], whole(tier, "buffered")),
                       f"a read from {tier} straight into the cache", "the buffered read and copy", less="less")
                for tier, path in ways if path == "into the cache"]
    return paragraphs(table, Prose(" ".join(f"{c[0].upper()}{c[1:]}." for c in compared)) if compared else None)
