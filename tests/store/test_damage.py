"""kvlab.store.damage: each deliberate fault changes exactly what it says (one layer, every
block moved by one, noise of the asked size), on per-layer, cross-layer, tuple and MLA
buffers, and the undo puts every byte back."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import ModelGeometry, allocate
from kvlab.store.damage import DAMAGES, KVDamage, damage_chunks

GQA = ModelGeometry("damage-test", 3, 2, 8, torch.float32, 4)
MLA = ModelGeometry("damage-mla", 3, 1, 12, torch.float32, 4, kv_lora_rank=8, qk_rope_head_dim=4)
CASES = [("LBHNC", GQA), ("BLHNC", GQA), ("ascend_kv_tuple", GQA), ("mla_v0.12", MLA)]


def filled(layout: str, geometry: ModelGeometry):
    cache = allocate(layout, geometry, 3)
    for tensor in cache.storage:
        tensor.normal_(generator=torch.Generator().manual_seed(1))
    return cache


def parts(cache) -> list[torch.Tensor]:
    return [p for layer in cache.layers.values() for p in (layer if isinstance(layer, tuple) else (layer,))]


@pytest.mark.parametrize("layout, geometry", CASES)
def test_each_damage_changes_what_it_says_and_the_undo_restores_it(layout: str, geometry: ModelGeometry) -> None:
    before = [p.clone() for p in parts(filled(layout, geometry))]
    per_layer = len(before) // geometry.num_layers
    block_dim = allocate(layout, geometry, 1).layout.view_shape.index("B")
    for name, damage in DAMAGES.items():
        cache = filled(layout, geometry)
        undo = damage_chunks([cache], name)
        after = parts(cache)
        for i, (old, new) in enumerate(zip(before, after)):
            if damage.kind == "zero":
                hit = damage.layer is None or i // per_layer == damage.layer
                assert torch.equal(new, torch.zeros_like(old) if hit else old), (name, i)
            elif damage.kind == "block-order":
                assert torch.equal(new, old.roll(-1, dims=block_dim)) and not torch.equal(new, old), (name, i)
            elif damage.kind == "block-shift":
                shifted = torch.cat([old.narrow(block_dim, 1, 2), old.narrow(block_dim, 2, 1)], dim=block_dim)
                assert torch.equal(new, shifted), (name, i)
            else:
                relative = (new - old).std() / old.std()
                assert 0.5 * damage.scale < relative < 2 * damage.scale, (name, i, float(relative))
        undo()
        assert all(torch.equal(a, b) for a, b in zip(before, parts(cache))), name


def test_bad_damages_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown damage"):
        KVDamage("flip")
    with pytest.raises(ValueError, match="positive scale"):
        KVDamage("noise")
    with pytest.raises(ValueError, match="only 'zero'"):
        KVDamage("noise", layer=1, scale=0.1)
    with pytest.raises(ValueError, match="out of range"):
        KVDamage("zero", layer=3).apply(filled("LBHNC", GQA))
    with pytest.raises(ValueError, match="the named ones"):
        damage_chunks([], "scrambled")
