"""Model geometry: the few numbers of a model that fix the size and shape of its KV cache.

A geometry is built from a Hugging Face ``config.json`` (a folder, a file or a dict) or
from a preset for the models the project studies. Presets are checked against the
published configs in ``tests/fixtures/configs/``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from kvlab.cache.quant import KVQuant, get_quant

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}

_DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A KV cache dtype from a torch dtype or its name ('bf16', 'bfloat16', 'torch.bfloat16')."""
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
        name = str(dtype)
    else:
        name = str(dtype).removeprefix("torch.").lower()
        name = _DTYPE_ALIASES.get(name, name)
        if name in DTYPES:
            return DTYPES[name]
    raise ValueError(
        f"unsupported KV cache dtype {name!r}; choose one of {sorted(DTYPES)} "
        f"(aliases: {sorted(_DTYPE_ALIASES)})"
    )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class ModelGeometry:
    """The KV-cache shape of a model.

    For attention with separate K and V (MHA/GQA) a token of one layer holds
    ``2 * num_kv_heads * head_size`` elements. For MLA it holds one latent of
    ``kv_lora_rank + qk_rope_head_dim`` elements (``num_kv_heads`` is 1, ``head_size``
    the latent size). A quantized cache (``quant``, kvlab.cache.quant) stores each head's
    row of K or V as ``row_size`` bytes: its values, and its scales where they are inline.
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype = torch.bfloat16
    block_size: int = 16
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    quant: KVQuant | None = None

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_size", "block_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        if self.quant is not None:
            object.__setattr__(self, "quant", get_quant(self.quant))
        stored = self.quant is not None and str(self.dtype).removeprefix("torch.") == dtype_name(self.quant.storage)
        object.__setattr__(self, "dtype", self.quant.storage if stored else parse_dtype(self.dtype))
        if (self.kv_lora_rank is None) != (self.qk_rope_head_dim is None):
            raise ValueError("an MLA geometry needs both kv_lora_rank and qk_rope_head_dim")
        if self.is_mla:
            if self.num_kv_heads != 1:
                raise ValueError(f"an MLA cache has one latent head, got num_kv_heads={self.num_kv_heads}")
            if self.head_size != self.kv_lora_rank + self.qk_rope_head_dim:
                raise ValueError(
                    f"an MLA head_size must be kv_lora_rank + qk_rope_head_dim = "
                    f"{self.kv_lora_rank + self.qk_rope_head_dim}, got {self.head_size}"
                )
        self._check_quant()

    def _check_quant(self) -> None:
        if self.quant is None:
            return
        if self.is_mla:
            raise ValueError(f"kvlab models {self.quant.name} for K/V caches, not MLA latents")
        if self.dtype != self.quant.storage:
            raise ValueError(f"{self.quant.name} is stored as {dtype_name(self.quant.storage)}, "
                             f"not {dtype_name(self.dtype)}")
        self.quant.check(self.head_size)

    def quantized(self, quant: str | KVQuant) -> ModelGeometry:
        """This model's KV in a quantized format (kvlab.cache.quant.QUANTS), stored as the
        format stores it."""
        quant = get_quant(quant)
        return replace(self, quant=quant, dtype=quant.storage)

    @classmethod
    def mla(cls, name: str, num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int, **kw: Any) -> ModelGeometry:
        return cls(name, num_layers, 1, kv_lora_rank + qk_rope_head_dim,
                   kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim, **kw)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def row_size(self) -> int:
        """Elements of one head's row of K or V: the head size, or a quantized row's bytes."""
        return self.head_size if self.quant is None else self.quant.row_bytes(self.head_size)

    @property
    def parts(self) -> tuple[int, ...]:
        """Sizes of the parts of one head's content: (K, V), or MLA's (latent, rope)."""
        if self.is_mla:
            return (self.kv_lora_rank, self.qk_rope_head_dim)
        return (self.row_size, self.row_size)

    @property
    def part_names(self) -> tuple[str, str]:
        return ("latent", "rope") if self.is_mla else ("K", "V")

    @property
    def content_size(self) -> int:
        """Elements per (layer, token, head): C in vLLM's [L, B, H, N, C]."""
        return sum(self.parts) if not self.is_mla else self.head_size

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def token_bytes_per_layer(self) -> int:
        return self.num_kv_heads * self.content_size * self.itemsize

    @property
    def token_bytes(self) -> int:
        """KV bytes one token occupies over all layers."""
        return self.num_layers * self.token_bytes_per_layer

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer (vLLM's page_size_bytes)."""
        return self.block_size * self.token_bytes_per_layer

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers: one cross-layer page."""
        return self.num_layers * self.page_bytes

    def with_(self, **changes: Any) -> ModelGeometry:
        return replace(self, **changes)

    def describe(self) -> dict[str, Any]:
        quant = {} if self.quant is None else {"kv_cache_dtype": self.quant.name, "row_bytes": self.row_size}
        return {
            "name": self.name,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "mla": self.is_mla,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "dtype": dtype_name(self.dtype),
            "block_size": self.block_size,
            "token_bytes": self.token_bytes,
            "page_bytes": self.page_bytes,
            "block_bytes": self.block_bytes,
            **quant,
        }

    @classmethod
    def from_hf_config(
        cls,
        config: str | Path | dict[str, Any],
        *,
        name: str | None = None,
        dtype: str | torch.dtype | None = None,
        block_size: int = 16,
    ) -> ModelGeometry:
        """Read a geometry from a Hugging Face config (folder, config.json path or dict)."""
        source = "config dict"
        if not isinstance(config, dict):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise ValueError(f"no config.json at {path}")
            source = str(path)
            try:
                config = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise ValueError(f"malformed config.json {path}: {exc}") from exc
            if not isinstance(config, dict):
                raise ValueError(f"malformed config.json {path}: expected a JSON object")
        text_config = config.get("text_config")  # a multimodal model's language model; null means none
        if text_config is not None:
            if not isinstance(text_config, dict):
                raise ValueError(f"{source}: text_config must be a JSON object, got {text_config!r}")
            config = text_config

        def need(key: str) -> int:
            if key not in config:
                raise ValueError(f"{source} lacks {key!r}, needed for the KV cache geometry")
            value = config[key]
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{source}: {key} must be a positive integer, got {value!r}")
            return value

        name = name or config.get("_name_or_path") or config.get("model_type") or "model"
        dtype = dtype or config.get("torch_dtype") or config.get("dtype") or "bfloat16"
        num_layers = need("num_hidden_layers")
        if config.get("kv_lora_rank"):
            return cls.mla(name, num_layers, need("kv_lora_rank"), need("qk_rope_head_dim"),
                           dtype=dtype, block_size=block_size)
        heads = need("num_attention_heads")
        kv_heads = need("num_key_value_heads") if "num_key_value_heads" in config else heads
        if kv_heads > heads:
            raise ValueError(
                f"{source}: num_key_value_heads ({kv_heads}) exceeds num_attention_heads ({heads}); "
                f"each KV head serves one or more query heads"
            )
        head_size = config.get("head_dim") or need("hidden_size") // heads
        return cls(name, num_layers, kv_heads, head_size, dtype=dtype, block_size=block_size)


# The models the project studies, as in their published config.json (bf16).
PRESETS: dict[str, ModelGeometry] = {
    "llama-3.1-8b": ModelGeometry("meta-llama/Llama-3.1-8B-Instruct", 32, 8, 128),
    "deepseek-v2-lite": ModelGeometry.mla("deepseek-ai/DeepSeek-V2-Lite-Chat", 27, 512, 64),
    "qwen3-8b": ModelGeometry("Qwen/Qwen3-8B", 36, 8, 128),
    "qwen3-30b-a3b": ModelGeometry("Qwen/Qwen3-30B-A3B", 48, 4, 128),
    "deepseek-r1-distill-qwen-1.5b": ModelGeometry("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", 28, 2, 128),
    "smollm2-135m": ModelGeometry("HuggingFaceTB/SmolLM2-135M-Instruct", 30, 3, 64),
}


def preset(name: str, **changes: Any) -> ModelGeometry:
    """A preset geometry by its short name, with optional changes (dtype, block_size)."""
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    if "dtype" in changes:
        changes["dtype"] = parse_dtype(changes["dtype"])
    return PRESETS[key].with_(**changes)


def resolve_model(model: str, *, dtype: str | torch.dtype | None = None, block_size: int = 16) -> ModelGeometry:
    """A preset name, or a path to a Hugging Face model folder or its config.json (named after
    the folder: a config's own name is often a training run's, or only its architecture's)."""
    if model.lower() in PRESETS:
        changes: dict[str, Any] = {"block_size": block_size}
        if dtype is not None:
            changes["dtype"] = dtype
        return preset(model, **changes)
    path = Path(model)
    if path.exists():
        folder = path if path.is_dir() else path.parent
        return ModelGeometry.from_hf_config(path, name=folder.resolve().name, dtype=dtype, block_size=block_size)
    raise ValueError(
        f"unknown model {model!r}: not a preset ({sorted(PRESETS)}) and no such folder or config.json"
    )
