"""Notebook 06's tables for the pages rendered from result rows (docs/results.md): every
reuse path against recompute and the control, the same KV damaged on purpose, bf16, lm-eval,
the connectors side by side, every architecture and the reference request. Counts and
scores as the rows hold them; each table names whose run it shows."""

from __future__ import annotations

from typing import Any

from kvlab.experiments.paths import Reuse
from kvlab.plotting.common import as_records, model_name
from kvlab.plotting.story.claims import Prose, amount, number
from kvlab.plotting.story.tables import captioned
from kvlab.store.damage import DAMAGES


def _of(row: dict | None, key: str, fmt: str = "g") -> str:
    return format(row[key], fmt) if row is not None and number(row.get(key)) else ""


def _diffs(row: dict | None) -> str:
    return f"{_of(row, 'max_logprob_diff')} / {_of(row, 'max_logprob_diff_vs_control')}" if row else ""


def _score(row: dict | None) -> str:
    return f"{row['accuracy']:.3f} ± {row['stderr']:.3f}" if row is not None and number(row.get("accuracy")) else ""


def accuracy_table(rows: Any) -> Prose:
    """Per reuse path: generations identical to recompute, logprob differences against
    recompute and against the control, the book windows' perplexity, and the task score
    (rows of one AccuracyCheck run: its generations, perplexity and task tables)."""
    rows = as_records(rows)
    tables = {name: {r["path"]: r for r in rows if r.get("table") == name} for name in ("generations", "perplexity",
                                                                                       "task")}
    paths = list(tables["generations"]) or list(tables["perplexity"])
    if not paths:
        raise ValueError("no generations or perplexity rows of an accuracy check")
    body = []
    for path in paths:
        generation, book, task = (tables[name].get(path) for name in ("generations", "perplexity", "task"))
        body.append([path, f"{generation['identical']:,} of {generation['prompts']:,}" if generation else "",
                     _diffs(generation), _of(book, "reused_prefix_tokens", ","), _of(book, "perplexity", ".4f"),
                     _diffs(book), _score(task)])
    first = rows[0]
    return captioned(f"{model_name(first['model'])} ({first.get('dtype', '')}), every reuse path against recompute "
                     "and against vLLM's own prefix hit (the control)",
                     ["path", "generations identical to recompute", "largest logprob difference vs recompute / "
                      "vs the control", "book: prefix tokens reused", "book perplexity",
                      "book logprob difference vs recompute / vs the control", "task score"], body, rows)


def damage_table(rows: Any) -> Prose:
    """The same KV damaged on purpose: per damage and path, how far the checks moved from the
    path's undamaged run (rows of an AccuracyCheck run's sensitivity table)."""
    rows = [r for r in as_records(rows) if r.get("table") == "sensitivity"]
    if not rows:
        raise ValueError("no sensitivity rows (the same KV damaged on purpose)")
    body = [[DAMAGES[r["damage"]].describe().split(" (")[0] if r["damage"] in DAMAGES else r["damage"], r["path"],
             f"{r['changed_generations']:,} of {r['prompts']:,}",
             f"{r['accuracy_undamaged']:.3f} → {r['accuracy']:.3f}", "yes" if r["beyond_stderr"] else "no",
             _of(r, "perplexity_ratio", ",.3g"), _of(r, "max_logprob_change", ".3g")] for r in rows]
    return captioned("Each damage against the same path's undamaged run",
                     ["damage", "path", "generations changed", "task score", "moved beyond one standard error",
                      "book perplexity ratio", "largest logprob change"], body, rows)


def differences_table(rows: Any) -> Prose:
    """bf16: recompute, vLLM's prefix hit and KVLab side by side, and whether vLLM's
    batch-invariant mode could run here (rows of notebook 06's engine differences)."""
    rows = as_records(rows)
    generations = [r for r in rows if r.get("table") == "generations"]
    body = [[r["path"], f"{r['identical']:,} of {r['prompts']:,}", f"{r['identical_to_control']:,}", _diffs(r)]
            for r in generations]
    if not body:
        raise ValueError("no generations rows of the bf16 check")
    table = captioned(f"{model_name(generations[0]['model'])} in {generations[0].get('dtype', '')}",
                      ["path", "generations identical to recompute", "identical to the control",
                       "largest logprob difference vs recompute / vs the control"], body, generations)
    invariance = [r for r in rows if r.get("table") == "batch invariance"]
    said = [f"vLLM's batch-invariant mode: {'ran' if r.get('available') else 'not available here'}"
            + (f" (the row's reason: `{r['reason']}`)" if r.get("reason") else "") + "." for r in invariance]
    return Prose("\n\n".join([str(table), *said]))


def lmeval_table(rows: Any) -> Prose:
    """lm-eval's vLLM backend per task and filter: each connector's score, the generations
    identical to no connector's, and the prompt tokens the connectors served."""
    rows = as_records(rows)
    connectors = list(dict.fromkeys(r["connector"] for r in rows))
    body = []
    for task, metric_filter in dict.fromkeys((r["task"], r["filter"]) for r in rows):
        mine = {r["connector"]: r for r in rows if (r["task"], r["filter"]) == (task, metric_filter)}
        body.append([task, metric_filter, *(f"{mine[c]['value']:.3f} ± {mine[c]['stderr']:.3f}" if c in mine else ""
                                            for c in connectors),
                     " / ".join(f"{r['identical_generations']:,} of {r['problems']:,}" for r in mine.values()),
                     " / ".join(f"{r['hit_tokens']:,}" for r in mine.values())])
    return captioned(f"{model_name(rows[0]['model'])} through lm-eval's vLLM backend, score per connector",
                     ["task", "filter", *connectors, "generations identical to the first's (each connector)",
                      "prompt tokens from a connector (each)"], body, rows)


def connectors_table(comparison: Any) -> Prose:
    """The connectors side by side (rows of ttft.connector_costs): time to first token cold
    and warm, each engine's own prefix hit, retrieve and store costs and throughputs."""
    rows = as_records(comparison)

    def ms(row: dict, key: str, digits: int = 1) -> str:
        return amount(1e3 * row[key], "ms", digits) if number(row.get(key)) else ""

    def gbps(row: dict, key: str) -> str:
        return amount(row[key], "GB/s", 2) if number(row.get(key)) else ""

    body = [[r["connector"], ms(r, "cold_s", 0), ms(r, "warm_s"), ms(r, "floor_s"), ms(r, "retrieve_s"),
             gbps(r, "retrieve_gbps"), ms(r, "runner_save_s", 0), gbps(r, "store_gbps")] for r in rows]
    first = next((r for r in rows if number(r.get("kv_bytes"))), rows[0])
    served = f", {first['cached_tokens']:,} tokens = {first['kv_bytes'] / 2**20:,.1f} MiB of KV served" \
        if number(first.get("kv_bytes")) else ""
    return captioned(f"{model_name(first['model'])} ({first.get('dtype', '')}), {first['prompt_tokens']:,}-token "
                     f"prompts{served}; medians whose samples these rows did not keep; retrieve = warm minus the "
                     "plain engine's prefix hit, store = KV bytes over the time the model runner blocked in save calls",
                     ["connector", "cold", "warm", "its own prefix hit", "retrieve", "retrieve throughput",
                      "runner blocked in saves", "store throughput"], body, rows)


def architectures_table(rows: Any) -> Prose:
    """Every architecture of the reference pull requests: per model, the reuse paths, the
    tokens they hit of those loadable, generations identical to the cold run, and the
    largest logprob difference from the cold run and from the control."""
    rows = [r for r in as_records(rows) if Reuse.of(r.get("path") or "") is not None]
    body = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        body.append([model_name(model), mine[0]["architecture"], mine[0]["attention"],
                     ", ".join(r["path"] for r in mine),
                     f"{sum(r['hit_tokens'] for r in mine):,} of {sum(r['loadable_tokens'] for r in mine):,}",
                     f"{sum(r['identical'] for r in mine)} of {sum(r['prompts'] for r in mine)}",
                     f"{max(r['max_logprob_diff_vs_cold'] for r in mine):g} / "
                     f"{max(r['max_logprob_diff_vs_control'] for r in mine):g}"])
    header = ["model", "architecture", "attention", "paths", "tokens hit of those loadable",
              "generations identical to cold", "largest logprob difference vs cold / vs the control"]
    return captioned("Every path on every architecture (summed over the paths), against its own cold run and the "
                     "control", header, body, rows)


def seed_table(rows: Any) -> Prose:
    """vllm-ascend #2039's request and a long one repeated, through ``vllm serve``: per
    model, the tokens #2039's prompt was answered with, and what the repeat found cached."""
    rows = as_records(rows)
    body = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = {(r["request"], r["api"]): r for r in rows if r["model"] == model}
        seed = [mine[key] for key in mine if key[0] == "seed prompt"]
        first, repeat = mine.get(("long, first", "completions")), mine.get(("long, repeat", "completions"))
        body.append([model_name(model), next(iter(mine.values())).get("layout", ""),
                     " / ".join(f"{r['completion_tokens']} ({r['api']})" for r in seed),
                     f"{repeat['cached_tokens']:,} of {repeat['prompt_tokens']:,}" if repeat else "",
                     ("yes" if repeat["token_ids"] == first["token_ids"] else "no") if first and repeat else ""])
    return captioned("Through `vllm serve` with KVLabConnector (vLLM's own prefix cache off)",
                     ["model", "layout registered", "#2039's prompt: tokens answered", "the long request repeated: "
                      "tokens cached", "the repeat's tokens the first's"], body, rows)
