import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvlab.cli import main
from kvlab.experiments import layerwise_timing, lmeval, sweep

README = Path(__file__).resolve().parent.parent / "README.md"
SMALL_CONFIG = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256}


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "layout, segments, size",
    [("LBHNC", 512, 65536), ("BLHNC", 16, 2097152), ("flash_attn_v0.12", 1024, 32768)],
)
def test_layout_json(capsys, layout, segments, size):
    code, out, _ = run(capsys, "layout", "--layout", layout, "--model", "llama-3.1-8b", "--tokens", "256",
                       "--block-size", "16", "--json")
    report = json.loads(out)
    assert code == 0
    assert report["segments"] == segments and report["segment_sizes"] == {str(size): segments}
    assert report["bytes_per_page"] == 65536 and report["bytes_moved"] == 256 * 131072
    assert report["geometry"]["num_layers"] == 32 and report["layout"]["name"] == layout


def test_layout_table_and_contiguous(capsys):
    code, out, _ = run(capsys, "layout", "--layout", "BLHNC", "--block-ids", "contiguous")
    assert code == 0
    assert "segments         1" in out and "1 x 32 MiB" in out and "bytes per page   64 KiB" in out


def test_layout_list(capsys):
    code, out, _ = run(capsys, "layout", "--list")
    assert code == 0 and "ascend_kv_tuple" in out and "KV_2LTD" in out


def test_model_folder(capsys, tmp_path):
    (tmp_path / "config.json").write_text(
        '{"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256}'
    )
    code, out, _ = run(capsys, "layout", "--model", str(tmp_path), "--dtype", "fp32", "--json")
    assert code == 0 and json.loads(out)["geometry"]["dtype"] == "float32"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--layout", "NOPE"], "unknown layout 'NOPE'; choose one of"),
        (["--model", "gpt-9"], "unknown model 'gpt-9'"),
        (["--model", "deepseek-v2-lite", "--layout", "flash_attn_v0.12"], "keeps K and V apart"),
        (["--dtype", "int4"], "unsupported KV cache dtype"),
        (["--block-ids", "1,x"], "--block-ids takes"),
        (["--block-ids", "3,3", "--tokens", "32"], "appear more than once"),
        (["--tokens", "0"], "tokens must be a positive integer"),
        (["--block-size", "0"], "block_size must be a positive integer"),
        (["--num-blocks", "0"], "num_blocks must be a positive integer"),
        (["--num-blocks", "999999999999999999999"], "beyond 64-bit byte offsets"),
        (["--tokens", "99999999999"], "the block table is bounded at 1,048,576 blocks (16,777,216 tokens"),
        (["--tokens", "100000000"], "the block table is bounded at 1,048,576 blocks"),
        (["--tokens", "8388624"], "into 16,777,248 runs before merging, more than the segment arithmetic lists"),
        (["--layout", "KV_2LTD", "--tokens", "48", "--block-ids", "3,7,9"], "block ids apply to paged layouts only"),
        (["--layout", "KV_T2D", "--tokens", "48", "--block-ids", "3,7,9"], "KV_T2D is an LMCache chunk"),
        (["--layout", "KV_MLA_FMT", "--model", "deepseek-v2-lite", "--tokens", "48", "--block-ids", "3,7,9"],
         "KV_MLA_FMT is an LMCache chunk"),
    ],
)
def test_bad_input(capsys, argv, message):
    code, _, err = run(capsys, "layout", *argv)
    assert code == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize(
    "config, message",
    [
        ({"text_config": None}, "lacks 'num_hidden_layers'"),
        ({**SMALL_CONFIG, "num_hidden_layers": 10**9}, "into 16,000,000,000 runs before merging"),
        ({**SMALL_CONFIG, "num_key_value_heads": 8}, "num_key_value_heads (8) exceeds num_attention_heads (4)"),
    ],
    ids=["null text_config", "a billion layers", "more kv heads than heads"],
)
def test_bad_model_folder(capsys, tmp_path, config, message):
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, _, err = run(capsys, "layout", "--model", str(tmp_path))
    assert code == 2 and message in err and "Traceback" not in err


def test_readme_block_ids_example(capsys):
    """The README's example of a block table given as ids runs as it says."""
    example = re.search(r"`(--tokens \d+ --block-ids [\d,]+)` at block size (\d+)", README.read_text())
    code, out, _ = run(capsys, "layout", "--layout", "BLHNC", *example[1].split(), "--block-size", example[2], "--json")
    report = json.loads(out)
    assert code == 0 and report["block_ids"] == "given" and report["blocks"] == report["segments"] == 3


def forbid(monkeypatch, module, *names: str) -> None:
    """Fail the test if any of ``module``'s ``names`` is called: the work started."""
    def started(*args, **kwargs):
        raise AssertionError(f"{module.__name__} started its work before refusing the input")

    for name in names:
        monkeypatch.setattr(module, name, started)


@pytest.fixture
def no_measuring(monkeypatch):
    forbid(monkeypatch, sweep, "measure")
    forbid(monkeypatch, layerwise_timing, "pipeline_timing", "attention_pipeline")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--quick", "--out", "/dev/full"], "cannot write results to /dev/full: No space left on device"),
        (["layerwise", "--out", "/dev/full"], "cannot write results to /dev/full: No space left on device"),
        (["bench", "--no-save", "--model", "smollm2-135m", "--tokens", "100000000"], "GiB of memory this machine's"),
        (["layerwise", "--no-save", "--tokens", "100000000"], "GiB of memory this machine's"),
        (["layerwise", "--compute", "attention", "--out", "/dev/full"], "cannot write results to /dev/full"),
        (["layerwise", "--compute", "attention", "--no-save", "--tokens", "64,100000000"], "GiB of memory this machine's"),
        (["layerwise", "--compute", "attention", "--no-save", "--tokens", "0"], "prefix_tokens must be a positive integer"),
        (["bench", "--no-save", "--model", "smollm2-135m", "--layouts", "mla_v0.12"],
         "layout mla_v0.12 is for MLA caches, but HuggingFaceTB/SmolLM2-135M-Instruct has separate K and V"),
        (["bench", "--no-save", "--model", "deepseek-v2-lite", "--layouts", "LBHNC,flash_attn_v0.12"],
         "layout flash_attn_v0.12 keeps K and V apart, but deepseek-ai/DeepSeek-V2-Lite-Chat is MLA"),
        *[(["layerwise", "--no-save", "--intensities", f"1,{bad}"], "intensities must be finite compute/load ratios > 0")
          for bad in ("inf", "nan", "-1", "0")],
    ],
)
def test_bench_refuses_before_measuring(capsys, no_measuring, argv, message):
    if "/dev/full" in argv and not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    code, _, err = run(capsys, *argv)
    assert code == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize("value", ["0", "-3", "x"])
def test_layerwise_refuses_new_tokens_below_one(capsys, no_measuring, value):
    """argparse's usage error names the option, before any model is looked up."""
    with pytest.raises(SystemExit) as exited:
        main(["layerwise", "--compute", "attention", "--no-save", "--new-tokens", value])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "argument --new-tokens: expected an integer >= 1" in err
    assert "Traceback" not in err


def test_results_file_in_a_file(capsys, no_measuring, tmp_path):
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "results.jsonl"
    code, _, err = run(capsys, "bench", "--model", "smollm2-135m", "--tokens", "32", "--out", str(out))
    assert code == 2 and f"kvlab: error: cannot write results to {out}" in err


@pytest.fixture
def no_engine(monkeypatch):
    forbid(monkeypatch, lmeval, "write_task", "run_child")


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "no model folder at {model}: no config.json there"),
        (["--limit", "0"], "limit must be an integer >= 1, got 0"),
        (["--max-gen-toks", "0"], "max_gen_toks must be an integer >= 1, got 0"),
        (["--num-fewshot", "-1"], "num_fewshot must be an integer >= 0, got -1"),
    ],
)
def test_lmeval_refuses_before_any_engine(capsys, no_engine, tmp_path, argv, message):
    model = tmp_path / "model"
    model.mkdir()
    if argv:  # a model folder, so that the option is what is refused
        (model / "config.json").write_text(json.dumps(SMALL_CONFIG))
    code, _, err = run(capsys, "lmeval", "--model", str(model), *argv)
    assert code == 2 and f"kvlab: error: {message.format(model=model)}" in err and "Traceback" not in err


@pytest.mark.parametrize("action", ["prepare", "list"])
def test_models_dir_that_is_a_file(capsys, tmp_path, action):
    (tmp_path / "file").write_text("")
    code, _, err = run(capsys, "models", action, "--models-dir", str(tmp_path / "file"))
    assert code == 2 and f"kvlab: error: the models folder {tmp_path / 'file'} is a file, not a folder" in err


def test_module_entry_point():
    out = subprocess.run([sys.executable, "-m", "kvlab", "layout", "--tokens", "64", "--json"],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["segments"] == 128


def test_core_imports_torch_only():
    code = (
        "import sys, kvlab.cache, kvlab.transfer, kvlab.store, kvlab.hooks, kvlab.plotting, kvlab.cli;"
        "bad = [m for m in ('vllm', 'lmcache', 'transformers', 'pandas') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_command_has_one_handler():
    """The parser's commands and the handlers are the same set: no command falls through to
    another's handler (the notebooks were once a bare else)."""
    import argparse

    from kvlab.cli import COMMANDS, build_parser

    (commands,) = [a.choices for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(commands) == set(COMMANDS)


def test_notebooks_and_report_commands_reach_their_handlers(monkeypatch, tmp_path):
    import kvlab.plotting.report
    import kvlab.runtime.notebooks

    calls = []
    monkeypatch.setattr(kvlab.runtime.notebooks, "run_notebooks", lambda **kw: calls.append(("notebooks", kw)))
    monkeypatch.setattr(kvlab.plotting.report, "write_report", lambda *a: calls.append(("report", tuple(map(str, a)))))
    assert main(["notebooks", "--only", "02", "--out", str(tmp_path), "--from-results"]) == 0
    # the solutions' environment: git's copy of data/results, or nothing where one is set already (conftest)
    assert set(calls[0][1].pop("solutions_env")) <= {"KVLAB_COMMITTED_RESULTS"}
    assert calls == [("notebooks", {"profile": "standard", "only": ["02"], "out": str(tmp_path), "measure": False}),
                     ("report", (str(tmp_path / "notebooks"), str(tmp_path / "report")))]
    calls.clear()
    assert main(["report", "--notebooks-dir", "nb", "--out", "rep"]) == 0
    assert calls == [("report", ("nb", "rep"))]
