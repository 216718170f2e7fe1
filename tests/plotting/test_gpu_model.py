"""Notebook 02's GPU section: its prose is computed from the model's rows, and the figures'
footers name the published sources apart from kvlab's own measurements."""

import re

import pytest

from kvlab.cache import preset
from kvlab.experiments import costmodel, gpu_costmodel
from kvlab.experiments.published import OWN_SOURCE, load_published
from kvlab.plotting import answer_markdown, citations, fit_markdown
from kvlab.plotting.saving import provenance
from kvlab.results import committed_results_dir, load_results

ROWS = load_published()
PARAMS = gpu_costmodel.fit(ROWS)
EVALUATION = gpu_costmodel.evaluate(ROWS, PARAMS)
QUESTION = gpu_costmodel.layout_question(PARAMS, EVALUATION)


def test_fit_prose_states_the_held_out_errors():
    text = fit_markdown(EVALUATION, gpu_costmodel.describe(PARAMS))
    held = [e for e in EVALUATION if e["role"] == "held-out"]
    assert f"{len(held)} held-out rows" in text and f"{len(PARAMS)} parameters" in text
    worst = max(held, key=lambda e: abs(e["error"]))
    assert worst["id"] in text and f"{100 * worst['error']:+.0f}%" in text
    assert "no GPU rows of its own yet" in text


def test_the_answer_is_computed_and_set_against_the_cpu_finding():
    cpu_fits = [f for f in costmodel.fit(load_results(sorted(committed_results_dir().glob("02_transfer-*.jsonl"))))
                if f.method in ("gather", "segments")]
    cpu = costmodel.chunk_gain(cpu_fits, [preset("llama-3.1-8b")])
    text = answer_markdown(QUESTION, cpu, EVALUATION)
    per_segment = [q["gain"] for q in QUESTION if q["mechanism"] == "memcpy_per_segment" and q["link"] == "pcie5"]
    assert f"{min(per_segment):.1f}–{max(per_segment):.1f}x faster on H100 and H200" in text
    assert "Against kvlab's CPU finding" in text and "disagree" in text
    assert "Against kvlab's CPU finding" not in answer_markdown(QUESTION, [])
    assert not re.search(r"nan", text)
    nixl = [e for e in EVALUATION if e["role"] == "held-out" and e["mechanism"] == "nixl"]
    assert f"off by {100 * nixl[0]['error']:+.0f}%" in text


def test_footers_name_published_sources_apart_from_measurements():
    rows = citations([{"source": "vLLM #48434", "hardware": "H100 PCIe Gen5"},
                      {"source": OWN_SOURCE, "hardware": "cuda: NVIDIA H100"}])
    assert provenance(rows) == "measured on cuda: NVIDIA H100, kvlab profile; published: vLLM #48434 (H100 PCIe Gen5)"
    assert provenance(rows[:1]) == "published: vLLM #48434 (H100 PCIe Gen5)"
    assert provenance([{"hardware": "cpu: x", "profile": "paper"}]) == "measured on cpu: x, paper profile"


@pytest.mark.parametrize("mechanism", gpu_costmodel.QUESTION_MECHANISMS)
def test_every_mechanism_is_answered_on_every_machine(mechanism):
    assert {q["machine"] for q in QUESTION if q["mechanism"] == mechanism} == set(gpu_costmodel.MACHINES)


def test_the_answer_for_one_model_folder_at_its_block_size():
    """Notebook 04's question: one model's geometry (SmolLM2 at block size 32: 24 KiB pages, all
    under the DMA's small-page cliff), one chunk size."""
    question = gpu_costmodel.layout_question(PARAMS, EVALUATION, models=[preset("smollm2-135m", block_size=32)],
                                             tokens=(256,))
    assert {q["per_layer_segments"] for q in question} == {240} and {q["cross_layer_segments"] for q in question} == {8}
    text = answer_markdown(question, [], EVALUATION)
    assert "SmolLM2-135M-Instruct; 256 tokens" in text and "where per-layer pages are" not in text
