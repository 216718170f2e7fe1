"""Accuracy: evidence that moving KV out of the cache and back changes nothing.

Round trips (the section below): fill a paged cache with random bytes, offload some
scattered blocks into a host buffer or an LMCache chunk, scribble over other blocks and
load the KV back there (in one transfer, or one layer at a time), then compare the two
sets of blocks by value, bit for bit and by CRC32C, and check that no other block
changed. The cache is read back through ``kvlab.layouts.address_labels``, not through
the transfer module's own views, so a wrong stride in a copy method cannot hide itself.
Each result is a flat dict (a pandas row); a method this machine cannot run is a row
that says why.

Through the engine (the second section): the same requests on one vLLM engine per
reuse path (recompute; vLLM's own prefix-cache hit, the control; KVLabConnector
whole-step and layerwise; LMCache; vLLM's ExampleConnector), compared on greedy
generations, on teacher-forced logprobs of a text continued on top of a reused prefix
(perplexity), and on a GSM8K-style task's score.

The round trips need torch only; the engine checks start vLLM in child processes.
"""

from __future__ import annotations

import functools
import importlib.resources
import itertools
import math
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from kvlab.devices import resolve_device
from kvlab.geometry import ModelGeometry, dtype_name, parse_dtype
from kvlab.layouts import (KVCache, Layout, address_labels, allocate, allocations, check_compatible,
                           compatible_layouts, get_layout)
from kvlab.segments import check_block_ids
from kvlab.store import checksum
from kvlab.transfer import (METHODS, PEERS, LayerwiseLoad, Transfer, chunk_buffer, host_buffer, load, method_status,
                            offload)

# --- round trips -------------------------------------------------------------------

ROUNDTRIP_PATHS = ("whole", "layerwise")
ROUNDTRIP_DTYPES = ("bfloat16", "float32", "float16", "float8_e4m3fn")


def _paged_layout(name: str | Layout, geometry: ModelGeometry) -> Layout:
    """A paged cache layout that can hold this geometry (chunk formats are targets)."""
    layout = get_layout(name)
    if layout.is_chunk_format:
        raise ValueError(f"{layout.name} is an LMCache chunk format, not a paged cache: pass it as target; "
                         f"paged layouts: {compatible_layouts(geometry, chunk_formats=False)}")
    check_compatible(layout, geometry)
    return layout


def _chunk_formats(geometry: ModelGeometry) -> list[str]:
    return [n for n in compatible_layouts(geometry) if get_layout(n).is_chunk_format]


def _check_target(target: str, geometry: ModelGeometry) -> None:
    if target != "host" and target not in _chunk_formats(geometry):
        raise ValueError(f"target must be 'host' or one of {_chunk_formats(geometry)} for {geometry.name}, "
                         f"not {target!r}")


def _check_path(path: str) -> None:
    if path not in ROUNDTRIP_PATHS:
        raise ValueError(f"path must be one of {ROUNDTRIP_PATHS}, not {path!r}")


def _random_bytes(shape: Sequence[int], seed: int) -> torch.Tensor:
    """Every byte random (seeded, made on the host so every device gets the same bytes):
    each value of any dtype can occur, NaN, infinity and -0.0 patterns included."""
    return torch.randint(0, 256, tuple(shape), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _head_vectors(cache: KVCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each backing tensor as [head vector, element] rows (a view), with each row's block."""
    blocks = address_labels(cache.layout, cache.geometry, cache.num_blocks)["block"]
    out = []
    for tensor, alloc in zip(cache.storage, allocations(cache.layout, cache.geometry, cache.num_blocks)):
        rows = tensor.view(-1, alloc.sizes[-1])
        out.append((rows, blocks[:len(rows)]))
        blocks = blocks[len(rows):]
    return out


def _select(vectors: list[tuple[torch.Tensor, torch.Tensor]], block_ids: Sequence[int]) -> list[torch.Tensor]:
    """Host copies of these blocks' rows, block after block, per backing tensor: the same
    number of blocks of any cache of this layout comes out row for row comparable."""
    out = []
    for rows, blocks in vectors:
        host = rows.cpu()
        out.append(torch.cat([host[blocks == b] for b in block_ids]))
    return out


def _scribble(vectors: list[tuple[torch.Tensor, torch.Tensor]], block_ids: Sequence[int], seed: int) -> None:
    """Overwrite these blocks with other random bytes: a load that writes nothing shows."""
    for rows, blocks in vectors:
        target = rows.view(torch.uint8)
        mask = torch.isin(blocks, torch.tensor(block_ids)).to(target.device)
        target[mask] = _random_bytes((int(mask.sum()), target.shape[1]), seed).to(target.device)


def _max_abs_diff(expected: torch.Tensor, actual: torch.Tensor) -> float:
    """Largest |expected - actual| as numbers: equal infinities and NaN against NaN count
    as equal, NaN against a number as infinitely far."""
    e, a = expected.double(), actual.double()
    same = (e == a) | (e.isnan() & a.isnan())
    gap = (e - a).abs().nan_to_num(nan=float("inf"))
    return float(torch.where(same, 0.0, gap).max()) if e.numel() else 0.0


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def compare_blocks(expected: Sequence[torch.Tensor], actual: Sequence[torch.Tensor]) -> dict[str, Any]:
    """How ``actual`` differs from ``expected``: by value (``max_abs_diff``), bit for bit
    (``bit_exact``: a -0.0 for 0.0 or another NaN payload counts) and by CRC32C."""
    crc_source, crc_reloaded = checksum(expected), checksum(actual)
    return {
        "max_abs_diff": max(_max_abs_diff(e, a) for e, a in zip(expected, actual, strict=True)),
        "bit_exact": all(_bytes_equal(e, a) for e, a in zip(expected, actual, strict=True)),
        "checksum_equal": crc_source == crc_reloaded,
        "crc_source": crc_source,
        "crc_reloaded": crc_reloaded,
    }


def _unchanged_outside(before: list[torch.Tensor], vectors: list[tuple[torch.Tensor, torch.Tensor]],
                       block_ids: Sequence[int]) -> bool:
    """Every row outside ``block_ids`` holds the bytes ``before`` held."""
    for old, (rows, blocks) in zip(before, vectors):
        keep = ~torch.isin(blocks, torch.tensor(block_ids))
        if not _bytes_equal(old[keep], rows.cpu()[keep]):
            return False
    return True


def _block_ids(block_ids: Sequence[int], load_ids: Sequence[int] | None,
               num_blocks: int) -> tuple[list[int], list[int]]:
    """Checked source ids and where they load back (default: as many other blocks,
    reversed, so a load that ignores its block ids shows)."""
    block_ids = check_block_ids(block_ids, num_blocks)
    if not block_ids:
        raise ValueError("block_ids is empty: a round trip of no blocks proves nothing")
    if load_ids is None:
        free = [b for b in range(num_blocks) if b not in block_ids]
        if len(free) < len(block_ids):
            raise ValueError(f"{len(block_ids)} blocks need {len(block_ids)} others to load into: "
                             f"num_blocks {num_blocks} is too few (or pass load_ids)")
        load_ids = free[:len(block_ids)][::-1]
    load_ids = check_block_ids(load_ids, num_blocks)
    if len(load_ids) != len(block_ids):
        raise ValueError(f"{len(block_ids)} block_ids but {len(load_ids)} load_ids")
    return block_ids, load_ids


def _reload(buffer: KVCache, cache: KVCache, load_ids: list[int], method: str, path: str) -> list[Transfer]:
    """Load the buffer back into ``load_ids``: in one transfer, or layer by layer as a
    layerwise connector does (each layer waited for in turn)."""
    if path == "whole":
        return [load(buffer, cache, load_ids, method=method)]
    loading = LayerwiseLoad(buffer, cache, load_ids, method=method).start()
    for layer in range(cache.geometry.num_layers):
        loading.wait(layer)
    loading.finish()
    return [t for layer in loading.transfers for t in layer]


def roundtrip(
    layout: str | Layout,
    geometry: ModelGeometry,
    method: str = "gather",
    dtype: str | torch.dtype | None = None,
    *,
    target: str = "host",
    path: str = "whole",
    block_ids: Sequence[int] = (5, 1, 3),
    load_ids: Sequence[int] | None = None,
    num_blocks: int = 8,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> dict[str, Any]:
    """Offload ``block_ids`` of a random ``layout`` cache to ``target`` ("host": a host
    buffer in the cache's layout, or an LMCache chunk format), load them back into
    ``load_ids`` (default: as many other blocks, in reverse order) and compare.

    ``dtype`` overrides the geometry's; ``path`` is "whole" (one transfer) or "layerwise"
    (LayerwiseLoad). The row's ``exact`` is the verdict: values, bits and checksums equal
    and no block outside ``load_ids`` changed (by either hop). ``bytes`` and ``segments``
    are the load's.
    """
    if dtype is not None:
        geometry = geometry.with_(dtype=parse_dtype(dtype))
    layout = _paged_layout(layout, geometry)
    _check_target(target, geometry)
    _check_path(path)
    cache = allocate(layout, geometry, num_blocks, resolve_device(device))
    block_ids, load_ids = _block_ids(block_ids, load_ids, num_blocks)
    buffer = (host_buffer(cache, len(block_ids)) if target == "host"
              else chunk_buffer(cache, target, len(block_ids) * geometry.block_size))
    row: dict[str, Any] = {
        "model": geometry.name, "dtype": dtype_name(geometry.dtype), "layout": layout.name,
        "cross_layer": layout.is_cross_layer, "target": target, "method": method, "path": path,
        "block_ids": block_ids, "load_ids": load_ids,
    }
    problem = method_status(method, cache, buffer)
    if problem:
        return {**row, "status": f"unavailable: {problem}"}
    for i, tensor in enumerate(cache.storage):
        tensor.view(-1).view(torch.uint8).copy_(_random_bytes((tensor.numel() * tensor.element_size(),), seed + i))
    vectors = _head_vectors(cache)
    source = _select(vectors, block_ids)
    before = [rows.to("cpu", copy=True) for rows, _ in vectors]  # neither hop may write outside load_ids
    offload(cache, block_ids, buffer, method=method)
    _scribble(vectors, load_ids, seed + len(cache.storage))
    transfers = _reload(buffer, cache, load_ids, method, path)
    result = compare_blocks(source, _select(vectors, load_ids))
    untouched = _unchanged_outside(before, vectors, load_ids)
    exact = result["bit_exact"] and result["checksum_equal"] and result["max_abs_diff"] == 0.0 and untouched
    return {
        **row, "status": "ok", "exact": exact,
        "bytes": sum(t.nbytes for t in transfers), "segments": sum(t.plan.segments for t in transfers),
        **result, "untouched_unchanged": untouched,
    }


def roundtrip_table(
    geometry: ModelGeometry,
    layouts: Sequence[str] | None = None,
    methods: Sequence[str] | None = None,
    dtypes: Sequence[str | torch.dtype] = ROUNDTRIP_DTYPES,
    targets: Sequence[str] | None = None,
    paths: Sequence[str] = ROUNDTRIP_PATHS,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> list[dict[str, Any]]:
    """``roundtrip`` for every layout x target x dtype x method x path (progress bar).

    Defaults: every paged layout that fits the geometry (per-layer and cross-layer), the
    host buffer and every fitting LMCache chunk format, every method kvlab knows (those
    that cannot run here are rows saying why). Arguments are checked before the sweep.
    """
    layouts = [l.name for l in (_paged_layout(n, geometry) for n in
                                (compatible_layouts(geometry, chunk_formats=False) if layouts is None else layouts))]
    methods = list(METHODS + PEERS) if methods is None else list(methods)
    unknown = [m for m in methods if m not in METHODS + PEERS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {list(METHODS + PEERS)}")
    dtypes = [parse_dtype(d) for d in dtypes]
    targets = ["host", *_chunk_formats(geometry)] if targets is None else list(targets)
    for target in targets:
        _check_target(target, geometry)
    for path in paths:
        _check_path(path)
    device = resolve_device(device)
    sweep = list(itertools.product(layouts, targets, dtypes, methods, paths))
    return [
        roundtrip(layout, geometry, method, dtype, target=target, path=path, seed=seed, device=device)
        for layout, target, dtype, method, path in tqdm(sweep, desc="KV round trips", leave=False)
    ]


def roundtrip_summary(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per model, layout and method: round trips run and bit-exact (checksums
    equal, untouched blocks unchanged), the worst value difference, and why a method
    could not run here. Small enough to commit; the full table is thousands of rows."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["layout"], row["cross_layer"], row["method"]), []).append(row)
    summary = []
    for (model, layout, cross_layer, method), group in groups.items():
        ran = [r for r in group if r["status"] == "ok"]
        summary.append({
            "model": model, "layout": layout, "cross_layer": cross_layer, "method": method,
            "round_trips": len(ran), "bit_exact": sum(bool(r["exact"]) for r in ran),
            "checksums_equal": sum(bool(r["checksum_equal"]) for r in ran),
            "max_abs_diff": max((r["max_abs_diff"] for r in ran), default=None),
            "dtypes": sorted({r["dtype"] for r in ran}), "targets": sorted({r["target"] for r in ran}),
            "unavailable": sorted({r["status"] for r in group if r["status"] != "ok"}),
        })
    return summary


# ---- Through the engine: generations, logprobs, perplexity, task scores ---------------
# Every check runs the same requests on one engine per reuse path (each in its own
# process, see kvlab.engine) and compares what the path returns when the prefix was
# reused with what recompute returns, and with what vLLM's own prefix-cache hit returns:
# the control, i.e. the difference vLLM itself makes when it reuses KV.

BOOK = "in_the_year_2889.txt"  # the Project Gutenberg text reasoning-gym ships
STOP = ("Question:",)
_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?")


def book_text() -> str:
    """Jules Verne's "In the Year 2889", as shipped inside reasoning-gym (offline)."""
    return (importlib.resources.files("reasoning_gym") / "data" / BOOK).read_text(encoding="utf-8")


def text_windows(token_ids: Sequence[int], windows: int, prefix_tokens: int, scored_tokens: int) -> list[tuple[list[int], list[int]]]:
    """Consecutive (prefix, continuation) pairs cut from a text: the prefix is what a
    reuse path serves from its KV, the continuation is scored token by token on top."""
    if min(windows, prefix_tokens, scored_tokens) < 1:
        raise ValueError("windows, prefix_tokens and scored_tokens must be positive")
    span = prefix_tokens + scored_tokens
    if windows * span > len(token_ids):
        raise ValueError(f"the text has {len(token_ids)} tokens: too short for {windows} windows of {span}")
    return [(list(token_ids[i * span:i * span + prefix_tokens]), list(token_ids[i * span + prefix_tokens:(i + 1) * span]))
            for i in range(windows)]


@dataclass(frozen=True)
class GSMTask:
    """GSM8K-style problems from reasoning-gym's ``gsm_symbolic`` generator, asked
    few-shot as lm-eval asks gsm8k ("Question: ...\\nAnswer: ... #### N"); the shots come
    from a different seed than the problems, and every prompt shares them (a long common
    prefix: exactly what a KV connector serves)."""

    size: int = 8
    seed: int = 0
    shots: int = 3

    def __post_init__(self) -> None:
        if self.size < 1 or self.shots < 0:
            raise ValueError(f"size must be >= 1 and shots >= 0, got size={self.size}, shots={self.shots}")

    @functools.cached_property
    def dataset(self):
        import reasoning_gym

        return reasoning_gym.create_dataset("gsm_symbolic", size=self.size, seed=self.seed)

    def prompts(self) -> list[str]:
        import reasoning_gym

        shots = reasoning_gym.create_dataset("gsm_symbolic", size=max(self.shots, 1), seed=self.seed + 10_000)
        prefix = "".join(f"Question: {shots[i]['question']}\nAnswer: {shots[i]['metadata']['answer_cot']}\n\n"
                         for i in range(self.shots))
        return [f"{prefix}Question: {self.dataset[i]['question']}\nAnswer:" for i in range(self.size)]

    def score(self, completions: Sequence[str]) -> dict[str, dict[str, float]]:
        """Accuracy and its standard error (as lm-eval reports them) per answer filter:
        "strict-match" reads "#### N", "flexible-extract" the last number."""
        if len(completions) != self.size:
            raise ValueError(f"{len(completions)} completions for {self.size} problems")
        scores = {}
        for name, extract in (("strict-match", _strict_answer), ("flexible-extract", _last_number)):
            hits = [self.dataset.score_answer(extract(text.split(STOP[0])[0]), self.dataset[i]) == 1.0
                    for i, text in enumerate(completions)]
            scores[name] = {"accuracy": sum(hits) / len(hits), "stderr": _stderr(hits), "n": len(hits)}
        return scores


def _strict_answer(text: str) -> str | None:
    found = _STRICT.search(text)
    return found.group(1).replace(",", "").rstrip(".") if found else None


def _last_number(text: str) -> str | None:
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def _stderr(hits: Sequence[bool]) -> float:
    """Standard error of a mean of 0/1 scores (sample variance, as lm-eval computes it)."""
    n = len(hits)
    if n < 2:
        return float("nan")
    p = sum(hits) / n
    return math.sqrt(p * (1 - p) / (n - 1))


@dataclass(frozen=True)
class ReusePath:
    """One way of serving a prompt's prefix: its engine and the phase whose outputs used
    the reused KV ("cold" for recompute, where nothing is reused)."""

    name: str
    connector: str = "none"
    extra: dict = field(default_factory=dict)
    prefix_caching: bool = False
    phase: str = "warm"
    zeroed: bool = False  # also a run on zeroed stored KV (the sensitivity control)

    @property
    def phases(self) -> tuple[str, ...]:
        return ("cold",) + (() if self.phase == "cold" else (self.phase,)) + (("warm-zeroed",) if self.zeroed else ())


RECOMPUTE, CONTROL = "recompute", "vLLM prefix-cache hit"


def reuse_paths(lmcache: bool = False, chunk_size: int | None = None) -> list[ReusePath]:
    """Recompute, the control, KVLabConnector whole-step and layerwise (with the
    zeroed-KV sensitivity run), LMCache (when asked: it needs a server) and vLLM's
    ExampleConnector."""
    kvlab = {"store": "cpu", **({"chunk_size": chunk_size} if chunk_size else {})}
    paths = [ReusePath(RECOMPUTE, phase="cold"), ReusePath(CONTROL, prefix_caching=True, phase="floor"),
             ReusePath("KVLab whole-step", "kvlab", kvlab, zeroed=True),
             ReusePath("KVLab layerwise", "kvlab", {**kvlab, "layerwise": True}, zeroed=True)]
    if lmcache:
        paths.append(ReusePath("LMCache", "lmcache"))
    return paths + [ReusePath("ExampleConnector", "example")]


@dataclass
class AccuracyCheck:
    """Run the same requests on every reuse path and compare: greedy generations of the
    task prompts, teacher-forced logprobs of text continuations on top of reused prefixes
    (perplexity), and task scores. Usage: ``report = AccuracyCheck(model).run()``."""

    model: str
    dtype: str = "float32"
    task: GSMTask = field(default_factory=GSMTask)
    max_tokens: int = 96
    windows: int = 2
    prefix_tokens: int = 512
    scored_tokens: int = 64
    block_size: int = 32
    max_model_len: int = 4096
    lmcache: Any = None  # a running kvlab.lmcache.LMCacheServer: adds the LMCache path
    workdir: str | None = None
    paths: list[ReusePath] | None = None

    def requests(self) -> tuple[list[list[int]], list[list[int] | None]]:
        """Token ids of the task prompts, then of the text windows' prefixes, with the
        continuations to force (None for the task prompts)."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.model)
        prompts = [tokenizer.encode(p) for p in self.task.prompts()]
        windows = text_windows(tokenizer.encode(book_text()), self.windows, self.prefix_tokens, self.scored_tokens)
        return prompts + [p for p, _ in windows], [None] * len(prompts) + [c for _, c in windows]

    def run(self) -> AccuracyReport:
        from kvlab.engine import EngineSpec, check_inputs, run_any_engine

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
            for path in tqdm(paths, desc="reuse paths", unit="engine"):
                spec = EngineSpec(model=self.model, connector=path.connector, extra=dict(path.extra),
                                  prefix_caching=path.prefix_caching, phases=path.phases, dtype=self.dtype,
                                  block_size=self.block_size, max_tokens=self.max_tokens,
                                  max_model_len=self.max_model_len, workdir=str(workdir / path.name.replace(" ", "-")),
                                  batch=True, stop=STOP, max_num_batched_tokens=batch_tokens)
                results[path.name] = run_any_engine(spec, prompts, self.lmcache, forced=forced)
        return AccuracyReport(self, paths, results, self.task.size)


@dataclass
class AccuracyReport:
    """What every reuse path returned, and the comparisons as table rows."""

    check: AccuracyCheck
    paths: list[ReusePath]
    results: dict[str, dict]
    task_size: int

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
            diverge = [_first_difference(r["token_ids"], ref["token_ids"]) for r, ref in zip(rows, reference)]
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
            if path.zeroed:
                row["perplexity_zeroed_kv"] = _perplexity(self.rows(path, "warm-zeroed")[self.task_size:])
            table.append(row)
        return table

    def records(self) -> list[dict]:
        """Every table's rows, each tagged with its table, model and dtype (to record)."""
        labels = {"model": Path(self.check.model).name, "dtype": self.check.dtype}
        return [{"table": name, **labels, **row} for name, rows in
                (("generations", self.generations()), ("perplexity", self.perplexity()), ("task", self.task_scores()))
                for row in rows]

    def task_scores(self) -> list[dict]:
        """Per path and answer filter: accuracy +/- stderr of the task, and whether its
        difference to recompute is within one stderr."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.check.model)
        scores = {}
        for path in self.paths:
            texts = [tokenizer.decode(r["token_ids"], skip_special_tokens=True) for r in self.rows(path)[:self.task_size]]
            scores[path.name] = self.check.task.score(texts)
        base = scores[self.paths[0].name]
        rows = []
        for name, by_filter in scores.items():
            for f, s in by_filter.items():
                difference = s["accuracy"] - base[f]["accuracy"]
                rows.append({"path": name, "filter": f, **s, "difference": difference,
                             "within_stderr": difference == 0 or abs(difference) <= base[f]["stderr"]})
        return rows


def against_control(rows: Sequence[dict]) -> list[dict]:
    """Rows of one table (generations or perplexity) with ``no_worse_than_control``: the
    path is as close to recompute as vLLM's own prefix hit is (as many identical
    generations, a logprob difference no larger)."""
    control = next((r for r in rows if r["path"] == CONTROL), None)
    if control is None:
        raise ValueError(f"these rows have no {CONTROL!r} row to compare with")
    counts = control.get("identical") is not None and control["identical"] == control["identical"]  # not NaN
    return [{**r, "no_worse_than_control": r["max_logprob_diff"] <= control["max_logprob_diff"]
             and (not counts or r["identical"] >= control["identical"])} for r in rows]


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _max_logprob_diff(rows: Sequence[dict], reference: Sequence[dict]) -> float:
    """Largest chosen-token logprob difference over the positions where both chose the
    same tokens so far (after a divergence the contexts differ)."""
    worst = 0.0
    for row, ref in zip(rows, reference):
        same = _first_difference(row["token_ids"], ref["token_ids"])
        upto = len(row["token_ids"]) if same is None else same
        worst = max([worst] + [abs(p - q) for p, q in zip(row["logprobs"][:upto], ref["logprobs"][:upto])])
    return worst


def _perplexity(rows: Sequence[dict]) -> float:
    logprobs = [lp for r in rows for lp in r["logprobs"]]
    return math.exp(-sum(logprobs) / len(logprobs))
