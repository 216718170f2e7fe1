import json
from pathlib import Path

import pytest
import torch

from kvlab.cache import PRESETS, ModelGeometry, parse_dtype, preset, resolve_model

CONFIGS = Path(__file__).parents[1] / "fixtures" / "configs"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_match_published_configs(name):
    from_config = ModelGeometry.from_hf_config(CONFIGS / f"{name}.json")
    ours = PRESETS[name]
    fields = ("num_layers", "num_kv_heads", "head_size", "kv_lora_rank", "qk_rope_head_dim", "dtype")
    assert {f: getattr(ours, f) for f in fields} == {f: getattr(from_config, f) for f in fields}


def test_bytes_per_token():
    assert preset("llama-3.1-8b").token_bytes == 32 * 2 * 8 * 128 * 2
    assert preset("deepseek-v2-lite").token_bytes == 27 * 576 * 2
    assert preset("smollm2-135m", dtype="fp32").page_bytes == 16 * 3 * 128 * 4
    assert preset("qwen3-8b", block_size=32).block_bytes == 36 * 32 * 8 * 256 * 2


def test_dtypes():
    assert parse_dtype("bf16") is torch.bfloat16
    assert parse_dtype("torch.float16") is torch.float16
    assert parse_dtype(torch.float8_e4m3fn) is torch.float8_e4m3fn
    assert preset("llama-3.1-8b", dtype="fp8").itemsize == 1
    for bad in ("int8", torch.int32, "float64"):
        with pytest.raises(ValueError, match="unsupported KV cache dtype.*choose one of"):
            parse_dtype(bad)


def test_unknown_preset_lists_choices():
    with pytest.raises(ValueError, match=r"unknown model preset 'gpt-5'.*llama-3.1-8b"):
        preset("gpt-5")


def test_config_folder_and_dict(tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text((CONFIGS / "qwen3-8b.json").read_text())
    geometry = resolve_model(str(folder), block_size=32)
    assert geometry.block_size == 32 and geometry.name == "my-model", "named after the folder a user gave"
    assert resolve_model(str(folder / "config.json")).name == "my-model"
    multimodal = {"text_config": json.loads((CONFIGS / "llama-3.1-8b.json").read_text())}
    assert ModelGeometry.from_hf_config(multimodal).num_layers == 32


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "malformed config.json"),
        ("[1, 2]", "expected a JSON object"),
        ('{"num_attention_heads": 8}', "lacks 'num_hidden_layers'"),
        ('{"num_hidden_layers": 0, "num_attention_heads": 8, "hidden_size": 64}', "must be a positive integer"),
        ('{"num_hidden_layers": 2, "kv_lora_rank": 512}', "lacks 'qk_rope_head_dim'"),
        ('{"text_config": null, "model_type": "llava"}', "lacks 'num_hidden_layers'"),
        ('{"text_config": [2, 4]}', r"text_config must be a JSON object, got \[2, 4\]"),
        ('{"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 8, "hidden_size": 256}',
         r"num_key_value_heads \(8\) exceeds num_attention_heads \(4\)"),
    ],
)
def test_malformed_config(tmp_path, text, message):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        ModelGeometry.from_hf_config(path)


def test_null_text_config_is_no_text_config():
    """``"text_config": null`` (as some configs write it) leaves the top-level fields in charge."""
    config = {**json.loads((CONFIGS / "qwen3-8b.json").read_text()), "text_config": None}
    assert ModelGeometry.from_hf_config(config).num_kv_heads == 8


def test_missing_model_folder(tmp_path):
    with pytest.raises(ValueError, match="no such folder"):
        resolve_model(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="no config.json"):
        ModelGeometry.from_hf_config(tmp_path)


def test_bad_geometry():
    with pytest.raises(ValueError, match="num_kv_heads must be a positive integer"):
        ModelGeometry("x", 2, 0, 64)
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        ModelGeometry("x", 2, 2, 64, block_size=-16)
    with pytest.raises(ValueError, match="one latent head"):
        ModelGeometry("x", 2, 2, 576, kv_lora_rank=512, qk_rope_head_dim=64)
