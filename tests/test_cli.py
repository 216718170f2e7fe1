import json
import subprocess
import sys

import pytest

from kvlab.cli import main


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
    ],
)
def test_bad_input(capsys, argv, message):
    code, _, err = run(capsys, "layout", *argv)
    assert code == 2 and message in err and "Traceback" not in err


def test_module_entry_point():
    out = subprocess.run([sys.executable, "-m", "kvlab", "layout", "--tokens", "64", "--json"],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["segments"] == 128


def test_core_imports_torch_only():
    code = (
        "import sys, kvlab.geometry, kvlab.layouts, kvlab.segments, kvlab.plotting, kvlab.cli;"
        "bad = [m for m in ('vllm', 'lmcache', 'transformers', 'pandas') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
