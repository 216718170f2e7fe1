"""The texts and tasks the engine checks run offline: a Project Gutenberg book that
reasoning-gym ships (perplexity on reused KV) and GSM8K-style problems (a task score)."""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

BOOK = "in_the_year_2889.txt"  # the Project Gutenberg text reasoning-gym ships
STOP = ("Question:",)
_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?")


def book_text() -> str:
    """Jules Verne's "In the Year 2889", as shipped inside reasoning-gym (offline)."""
    return (importlib.resources.files("reasoning_gym") / "data" / BOOK).read_text(encoding="utf-8")


def book_prompts(model: str, count: int, length: int, stride: int = 2500, start: int = 0) -> list[list[int]]:
    """``count`` passages of the book, ``length`` tokens each, ``stride`` tokens apart from
    token ``start`` on, tokenized for ``model`` (a local folder): the prompts the
    time-to-first-token runs use."""
    from transformers import AutoTokenizer

    if min(count, length) <= 0 or start < 0:
        raise ValueError(f"need count and length positive and start from 0, got {count}, {length}, {start}")
    if length > stride:
        raise ValueError(f"passages of {length} tokens {stride} apart would overlap (share a prefix)")
    ids = AutoTokenizer.from_pretrained(model)(book_text())["input_ids"]
    if start + (count - 1) * stride + length > len(ids):
        raise ValueError(f"the book has {len(ids)} tokens: too short for {count} passages of {length} from {start}")
    return [ids[start + i * stride: start + i * stride + length] for i in range(count)]


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
class GymTask:
    """A reasoning-gym dataset (offline, seeded) asked few-shot as lm-eval asks its
    generation tasks ("Question: ...\nAnswer: ..."): the shots come from another seed than
    the problems and every prompt starts with them (a long common prefix: exactly what a
    KV connector serves). ``options`` configure the dataset; scored by its own
    ``score_answer`` on the first line of the answer."""

    name: str = "chain_sum"
    options: tuple[tuple[str, Any], ...] = ()
    size: int = 8
    seed: int = 0
    shots: int = 3
    stop: tuple[str, ...] = ("\n", "Question:")
    filters: ClassVar[tuple[str, ...]] = ("exact-match",)

    def __post_init__(self) -> None:
        if self.size < 1 or self.shots < 0:
            raise ValueError(f"size must be >= 1 and shots >= 0, got size={self.size}, shots={self.shots}")

    def resized(self, size: int) -> GymTask:
        return dataclasses.replace(self, size=size)

    @property
    def label(self) -> str:
        return f"{self.name}({', '.join(f'{k}={v}' for k, v in self.options)})" if self.options else self.name

    def _create(self, size: int, seed: int):
        import reasoning_gym

        return reasoning_gym.create_dataset(self.name, size=size, seed=seed, **dict(self.options))

    @functools.cached_property
    def dataset(self):
        return self._create(self.size, self.seed)

    def shot_answer(self, entry: dict) -> str:
        return entry["answer"]

    def prompts(self) -> list[str]:
        shots = self._create(max(self.shots, 1), self.seed + 10_000)
        prefix = "".join(f"Question: {shots[i]['question']}\nAnswer: {self.shot_answer(shots[i])}\n\n"
                         for i in range(self.shots))
        return [f"{prefix}Question: {self.dataset[i]['question']}\nAnswer:" for i in range(self.size)]

    def extract(self, text: str, name: str) -> str | None:
        return text.split("\n")[0].strip() if text.strip() else None

    def score(self, completions: Sequence[str]) -> dict[str, dict[str, float]]:
        """Accuracy and its standard error (as lm-eval reports them) per answer filter."""
        if len(completions) != self.size:
            raise ValueError(f"{len(completions)} completions for {self.size} problems")
        scores = {}
        for name in self.filters:
            hits = [self.dataset.score_answer(self.extract(text.split(STOP[0])[0], name), self.dataset[i]) == 1.0
                    for i, text in enumerate(completions)]
            scores[name] = {"accuracy": sum(hits) / len(hits), "stderr": _stderr(hits), "n": len(hits)}
        return scores


@dataclass(frozen=True)
class GSMTask(GymTask):
    """GSM8K-style problems from reasoning-gym's ``gsm_symbolic`` generator, asked as
    lm-eval asks gsm8k ("Answer: <reasoning> #### N"): "strict-match" reads "#### N",
    "flexible-extract" the last number. A 135M model solves almost none of them."""

    name: str = "gsm_symbolic"
    stop: tuple[str, ...] = STOP
    filters: ClassVar[tuple[str, ...]] = ("strict-match", "flexible-extract")

    def shot_answer(self, entry: dict) -> str:
        return entry["metadata"]["answer_cot"]

    def extract(self, text: str, name: str) -> str | None:
        return _strict_answer(text) if name == "strict-match" else _last_number(text)


def _gym(name: str, **options: Any) -> GymTask:
    return GymTask(name, tuple(options.items()))


# Tasks a small model might solve sometimes: scored by engine_checks.score_tasks to pick one
# (short answers, one line each; GSMTask's worked answers score 0 for SmolLM2-135M).
CANDIDATES = (
    _gym("chain_sum", min_terms=2, max_terms=2, min_digits=1, max_digits=1),
    _gym("chain_sum", min_terms=2, max_terms=2, min_digits=1, max_digits=2),
    _gym("basic_arithmetic", min_terms=2, max_terms=2, min_digits=1, max_digits=1),
    _gym("products", min_terms=2, max_terms=2, min_digits=1, max_digits=1),
    _gym("letter_counting", min_words=3, max_words=5),
    _gym("count_bits", min_n=1, max_n=15),
    _gym("gcd", min_numbers=2, max_numbers=2, min_value=1, max_value=20),
    _gym("word_sorting", min_words=2, max_words=3),
    _gym("word_sequence_reversal", min_words=2, max_words=3),
    _gym("leg_counting", min_animals=1, max_animals=2, max_instances=2),
    _gym("spell_backward", min_word_len=3, max_word_len=4),
    _gym("syllogism"),
)

# Measured with SmolLM2-135M-Instruct (fp32, greedy, 3 shots): tasks it solves sometimes,
# not always (20-80%), so a broken KV has room to move the score either way.
DISCRIMINATING = GymTask("chain_sum", (("min_terms", 2), ("max_terms", 2), ("min_digits", 1), ("max_digits", 1)),
                         size=200, shots=5)


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
