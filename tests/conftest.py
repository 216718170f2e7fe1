"""Shared fixtures: the trained model the engine tests run and prompts cut from the book
reasoning-gym ships; ``running`` (imported by the server tests) for processes left behind."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def smollm2() -> str:
    """SmolLM2-135M-Instruct in fp32 (bitwise comparisons need it); skips without vLLM or
    the prepared folder."""
    pytest.importorskip("vllm")
    from kvlab.models import model_path

    try:
        return str(model_path("smollm2-135m-instruct-fp32"))
    except FileNotFoundError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="session")
def prompts(smollm2: str) -> list[list[int]]:
    """Two passages of the book (300 and 250 tokens)."""
    from transformers import AutoTokenizer

    from kvlab.accuracy import book_text

    ids = AutoTokenizer.from_pretrained(smollm2)(book_text())["input_ids"]
    return [ids[1000:1300], ids[5000:5250]]


def running(pids: list[int]) -> list[int]:
    """Which of ``pids`` still run (zombies waiting for their parent do not)."""
    alive = []
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            continue
        if stat[stat.rindex(")") + 2] != "Z":
            alive.append(pid)
    return alive

