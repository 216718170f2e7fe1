"""The texts and tasks the engine checks run offline: a Project Gutenberg book that
reasoning-gym ships (perplexity on reused KV) and GSM8K-style problems (a task score)."""

from __future__ import annotations

import functools
import importlib.resources
import math
import re
from dataclasses import dataclass
from typing import Sequence

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
