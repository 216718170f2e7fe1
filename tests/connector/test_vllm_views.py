"""kvlab's layouts against vLLM itself: the installed vLLM (>= 0.29) and the 0.12-0.28
release wheels' get_kv_cache_shape / get_kv_cache_stride_order results (fixture)."""

import json
from pathlib import Path

import pytest
import torch

from kvlab.cache import VLLM_V29_LAYOUTS, ModelGeometry, allocate, layer_name, preset, vllm_layout

GEOMETRIES = [
    preset("smollm2-135m").with_(num_layers=5),
    preset("llama-3.1-8b").with_(num_layers=4),
    preset("deepseek-v2-lite").with_(num_layers=3),
    ModelGeometry("tiny-fp32", 2, 2, 32, dtype="float32", block_size=32),
    preset("qwen3-30b-a3b", dtype="fp8").with_(num_layers=2),
    ModelGeometry("one-kv-head", 3, 1, 64, dtype="float16"),
]


def signature(t: torch.Tensor):
    return tuple(t.shape), t.stride(), t.storage_offset(), t.dtype


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: g.name)
@pytest.mark.parametrize("layout", [*VLLM_V29_LAYOUTS, "CPU_LBHNC"])
def test_views_match_installed_vllm(geometry, layout):
    pytest.importorskip("vllm")
    from kvlab.connector.vllm_views import vllm_layer_views

    if geometry.is_mla and layout == "CPU_LBHNC":
        pytest.skip("CPU_ATTN holds K and V; MLA has its own CPU backend")
    theirs = vllm_layer_views(layout, geometry, 6)
    ours = allocate(layout, geometry, 6).layers
    assert list(ours) == list(theirs)
    for name in theirs:
        assert signature(ours[name]) == signature(theirs[name]), name
        assert ours[name].untyped_storage().nbytes() == theirs[name].untyped_storage().nbytes()


def test_installed_vllm_layout_enum_matches():
    kv_cache_layout = pytest.importorskip("vllm.v1.kv_cache_layout")
    from kvlab.cache.layouts import _V29_PERMUTATIONS

    assert {m.name: m.value for m in kv_cache_layout.KVCacheLayout} == _V29_PERMUTATIONS


def test_cpu_backend_supports_only_lbhnc():
    pytest.importorskip("vllm")
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert [layout.name for layout in CPUAttentionBackend.supported_kv_cache_layouts()] == ["LBHNC"]
    assert vllm_layout("0.32", "CPU_ATTN").name == "CPU_LBHNC"


FIXTURE = json.loads((Path(__file__).parents[1] / "fixtures" / "vllm_kv_shapes_0.12-0.28.json").read_text())

CELLS = [
    (version, backend, kv_layout, cross)
    for version, backends in FIXTURE["versions"].items()
    for backend in backends
    for kv_layout in ("NHD", "HND")
    for cross in (False, True)
]


def runner_views(shape, order, num_layers, cross):
    """What vLLM 0.12-0.28's model runner built from a backend's shape and stride order."""
    if cross:
        shape = (num_layers, *shape)
    order = tuple(order) if order is not None else tuple(range(len(shape)))
    inverse = [order.index(i) for i in range(len(order))]
    stored = torch.zeros([shape[i] for i in order]).permute(*inverse)
    return [stored[i] for i in range(num_layers)] if cross else [stored]


@pytest.mark.parametrize("version,backend,kv_layout,cross", CELLS)
def test_old_generations_match_release_wheels(version, backend, kv_layout, cross):
    cell = FIXTURE["versions"][version][backend]
    order = cell["stride_order"][kv_layout]["cross_layer" if cross else "per_layer"]
    args = FIXTURE["args"]["MLA" if backend == "MLA" else "standard"]
    if backend == "MLA":
        geometry = ModelGeometry.mla("mla", 3, 512, 64, dtype="float32", block_size=args["block_size"])
    else:
        geometry = ModelGeometry("kv", 3, args["num_kv_heads"], args["head_size"], dtype="float32",
                                 block_size=args["block_size"])
    # The runner took the cross-layer path only when the stride order has a layer axis
    # that is not outermost.
    if cross and (order is None or order[0] == 0):
        with pytest.raises(ValueError, match="no cross-layer"):
            vllm_layout(version, backend, kv_layout, cross)
        return
    layout = vllm_layout(version, backend, kv_layout, cross)
    cache = allocate(layout, geometry, args["num_blocks"])
    expected = runner_views(cell["shape"], order, geometry.num_layers, cross)
    for index, view in enumerate(expected if cross else expected * geometry.num_layers):
        ours = cache.layers[layer_name(index)]
        assert (tuple(ours.shape), ours.stride()) == (tuple(view.shape), view.stride()), layout.name
    if cross:
        # what register_cross_layers_kv_cache receives: the physical buffer itself (not a
        # copy), whose logical permutation cut by layer is exactly each layer's view
        whole = cache.cross_layer_tensor
        assert whole.is_contiguous() and whole.data_ptr() == cache.storage[0].data_ptr()
        physical = [((geometry.num_layers,) + tuple(cell["shape"]))[i] for i in order]
        assert list(whole.shape) == physical
        logical = whole.permute(*[order.index(i) for i in range(len(order))])
        for index in range(geometry.num_layers):
            ours, theirs = cache.layers[layer_name(index)], logical[index]
            assert (ours.data_ptr(), tuple(ours.shape), ours.stride()) == (
                theirs.data_ptr(), tuple(theirs.shape), theirs.stride()), (layout.name, index)


def test_vllm_layout_lookup_errors():
    with pytest.raises(ValueError, match="choose one of"):
        vllm_layout("0.20", "NOPE")
    with pytest.raises(ValueError, match="from vLLM 0.12 on"):
        vllm_layout("0.11", "FLASH_ATTN")
    with pytest.raises(ValueError, match="only LBHNC"):
        vllm_layout("0.32", "CPU_ATTN", "BLHNC")
    with pytest.raises(ValueError, match="cross-layer needs"):
        vllm_layout("0.32", "FLASH_ATTN", "LBNHC", cross_layer=True)
    with pytest.raises(ValueError, match="version must look like"):
        vllm_layout("latest", "FLASH_ATTN")
    assert vllm_layout("0.33.0", "FLASH_ATTN", "NHD").name == "LBNHC"
    assert vllm_layout("0.20", "FLASH_ATTN", "HND", cross_layer=True).name == "flash_attn_v0.12_hnd_cross"


def test_history_table():
    from kvlab.cache import vllm_history

    table = vllm_history(["0.12", "0.20", "0.26", "0.32"])
    assert table["FLASH_ATTN"]["0.20"] == "flash_attn_v0.12 + cross"
    assert table["TRITON_ATTN"]["0.12"] == "flashinfer_v0.12"
    assert table["CPU_ATTN"]["0.32"] == "CPU_LBHNC"
    assert table["MLA"]["0.20"] == "mla_v0.12"
