"""Deliberately damaged stored KV: the sensitivity controls of the accuracy checks. A check
that still passes after its reloaded KV was zeroed, perturbed or shuffled between blocks
cannot be looking at that KV, so every check is run once more on damaged chunks and must
move by a measured amount."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from kvlab.cache.allocation import KVCache, view_parts

KINDS = ("zero", "noise", "block-order", "block-shift")


@dataclass(frozen=True)
class KVDamage:
    """One way to damage a stored chunk in place (its checksum left as it was, so a tier
    that trusts its memory loads the damage).

    ``zero``: every layer, or only ``layer``; ``noise``: add Gaussian noise whose standard
    deviation is ``scale`` times each layer's own; ``block-order``: each block gets the next
    block's KV and the last the first's (the same blocks in another order); ``block-shift``:
    each block gets the next block's KV and the last keeps its own (a block id off by one: the
    first block's KV is lost, the last is there twice)."""

    kind: str
    layer: int | None = None
    scale: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown damage {self.kind!r}; choose one of {KINDS}")
        if self.kind == "noise" and not self.scale > 0:
            raise ValueError(f"noise needs a positive scale, got {self.scale}")
        if self.layer is not None and self.kind != "zero":
            raise ValueError("only 'zero' damages a single layer")

    def describe(self) -> str:
        """The damage in words, for the text beside the checks it moves."""
        if self.kind == "zero":
            return "every layer zeroed" if self.layer is None else f"only layer {self.layer} zeroed"
        if self.kind == "noise":
            return f"Gaussian noise of {self.scale:.0%} of each layer's own standard deviation added"
        if self.kind == "block-order":
            return "the prefix's blocks in another order (each block gets the next one's KV, the last the first's)"
        return ("a block id off by one (each block gets the next one's KV, the last keeps its own: the first "
                "block is lost)")

    def apply(self, cache: KVCache) -> None:
        """Damage ``cache`` (a chunk's host buffer) in place."""
        layers = list(cache.layers.values())
        if self.layer is not None:
            if not 0 <= self.layer < len(layers):
                raise ValueError(f"layer {self.layer} out of range: the cache has {len(layers)} layers")
            layers = [layers[self.layer]]
        generator = torch.Generator().manual_seed(self.seed)
        block_dim = cache.layout.view_shape.index("B") if "B" in cache.layout.view_shape else None
        if self.kind.startswith("block") and block_dim is None:
            raise ValueError(f"{cache.layout.name} has no block dimension to reorder")
        with torch.inference_mode():  # an engine makes its chunks in inference mode
            for part in (p for layer in layers for p in view_parts(layer)):
                if self.kind == "zero":
                    part.zero_()
                elif self.kind == "noise":
                    noise = torch.randn(part.shape, generator=generator, dtype=torch.float32)
                    part.add_((noise * part.float().std() * self.scale).to(part.dtype))
                elif self.kind == "block-order":
                    part.copy_(part.roll(-1, dims=block_dim))
                elif part.shape[block_dim] > 1:
                    rest = part.shape[block_dim] - 1
                    part.narrow(block_dim, 0, rest).copy_(part.narrow(block_dim, 1, rest).clone())


# The named damages the engine checks run (phase "warm-<name>"): two noise scales a decade
# apart show how the checks scale with the size of the fault. A reordering of a prefix's
# blocks is nearly invisible to attention (each key carries its position; the causal mask
# covers the whole prefix), an off-by-one block id is not.
DAMAGES = {
    "zeroed": KVDamage("zero"),
    "layer0-zeroed": KVDamage("zero", layer=0),
    "noise-1pct": KVDamage("noise", scale=0.01),
    "noise-10pct": KVDamage("noise", scale=0.1),
    "block-order": KVDamage("block-order"),
    "block-shift": KVDamage("block-shift"),
}


def damage_chunks(buffers: Sequence[KVCache], damage: KVDamage | str) -> Callable[[], None]:
    """Damage every buffer in place and return what puts their bytes back."""
    if isinstance(damage, str):
        if damage not in DAMAGES:
            raise ValueError(f"unknown damage {damage!r}; the named ones are {sorted(DAMAGES)}")
        damage = DAMAGES[damage]
    with torch.inference_mode():
        originals = [[t.clone() for t in buffer.storage] for buffer in buffers]
    for buffer in buffers:
        damage.apply(buffer)

    def undo() -> None:
        with torch.inference_mode():
            for buffer, saved in zip(buffers, originals):
                for tensor, original in zip(buffer.storage, saved):
                    tensor.copy_(original)
    return undo
