"""The table of published GPU measurements: every row names its source, its link and the
words it was quoted in; the numbers a row carries are the ones its quote holds; kvlab's own
CUDA rows join it as this project's, held out."""

import csv
import re

import pytest

from kvlab.experiments.published import (COLUMNS, OWN_SOURCE, PUBLISHED_CSV, Measurement, check_row, load_published,
                                         model_link_of, own_rows)

ROWS = load_published()


def test_every_row_names_its_source_link_and_quote():
    assert len(ROWS) >= 60
    for row in ROWS:
        assert row.source.strip() and row.quote.strip(), row.id
        assert re.match(r"https://(github\.com/[\w.-]+/[\w.-]+/(pull|issues)/\d+|blog\.vllm\.ai/)", row.url), row.id
        # a repository's row names its number, and its link is to that number
        number = re.search(r"#(\d+)", row.source)
        if number:
            assert row.url.endswith("/" + number.group(1)), row.id


def test_a_rows_value_is_in_its_quote():
    """The numbers are as quoted: the value (and the top of a range) appear in the quote's words."""
    for row in ROWS:
        if row.role == "geometry":
            continue
        for column in ("value", "value_high"):
            text = row.fields[column]
            if text and row.metric not in ("threshold_bytes",):
                digits = text.rstrip("0").rstrip(".") if "." in text else text
                assert digits in row.quote.replace(",", ""), (row.id, column, text)


def test_the_sources_asked_for_are_there():
    sources = {row.source for row in ROWS}
    for wanted in ("vLLM #48434", "PegaFlow #128", "FlexKV #193", "vLLM #55434", "vLLM #56110", "vLLM #30207",
                   "vLLM #27743"):
        assert wanted in sources
    assert any(source.startswith("vLLM blog") for source in sources)


def test_roles_and_mechanisms_are_known():
    assert {row.role for row in ROWS} == {"fit", "held-out", "context", "geometry"}
    assert {row.mechanism for row in ROWS if row.role in ("fit", "held-out")} <= {
        "dma_batch", "memcpy_per_segment", "copy_kernel", "nixl", "copy_engine"}


def test_a_row_without_its_source_or_link_is_refused(tmp_path):
    fields = dict(ROWS[0].fields)
    for column, bad in (("source", ""), ("url", ""), ("url", "somewhere"), ("quote", " "), ("role", "guess"),
                        ("value", "about 5")):
        with pytest.raises(ValueError, match=ROWS[0].id):
            check_row({**fields, column: bad})
    path = tmp_path / "t.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        writer.writerows([fields, fields])
    with pytest.raises(ValueError, match="twice"):
        load_published(path)


def test_derived_quantities_come_from_the_quoted_ones():
    by_id = {row.id: row for row in ROWS}
    merged = by_id["vllm48434-8k-run16-merged-submit"]
    assert merged.submissions == 8192 / 16 and merged.nbytes == 8192 * 8192 and merged.segment == 16 * 8192
    pegaflow = by_id["pegaflow128-layer-first"]  # bytes = the quoted bandwidth x the quoted latency
    assert pegaflow.submissions == 460 and pegaflow.nbytes == pytest.approx(45.5e9 * 10.5e-3)
    gap = by_id["blog-ttft-gap-90k"]  # one 16-token block per descriptor
    assert gap.submissions == 5625 and gap.nbytes == 5625 * 524288
    assert by_id["vllm55434-cuda-ipc-posting"].quoted == pytest.approx(0.569)


def test_own_cuda_rows_join_the_table_as_this_projects():
    cuda = {"hardware": "cuda: NVIDIA H100 80GB HBM3", "status": "ok", "target": "host", "method": "dma",
            "model": "meta-llama/Llama-3.1-8B-Instruct", "layout": "LBHNC", "direction": "load", "tokens": 1024,
            "segments": 2048, "bytes": 134217728, "seconds": 0.0031, "run_id": "abc", "profile": "standard",
            "source": "02_transfer-cuda-nvidia-h100.jsonl", "block_ids": "scattered"}
    cpu = {**cuda, "hardware": "cpu: AMD EPYC (2 cores)"}
    rows = own_rows([cuda, cpu, {**cuda, "status": "unavailable: no CUDA"}, {**cuda, "method": "memcpy"}])
    assert len(rows) == 1
    (row,) = rows
    assert isinstance(row, Measurement) and row.role == "own" and row.source == OWN_SOURCE
    assert row.url == "data/results/02_transfer-cuda-nvidia-h100.jsonl" and row.mechanism == "dma_batch"
    assert row.quoted == pytest.approx(0.0031) and row.submissions == 2048 and row.model_link == "pcie5"
    check_row(row.fields)
    assert model_link_of("cuda: NVIDIA GB200") == "nvlink_c2c"


def test_the_table_is_the_committed_file():
    assert PUBLISHED_CSV.parts[-3:] == ("data", "published", "gpu_transfers.csv")
