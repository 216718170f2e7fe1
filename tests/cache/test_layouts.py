import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.cache import (
    LAYOUTS,
    ModelGeometry,
    address_labels,
    allocate,
    allocate_chunk,
    allocations,
    axis_sizes,
    compatible_layouts,
    get_layout,
    preset,
)
from kvlab.cache.quant import QUANTS

KV = ModelGeometry("kv", 3, 2, 8, dtype="float32", block_size=4)
MLA = ModelGeometry.mla("mla", 3, 12, 4, dtype="float32", block_size=4)
QUANTIZED = [ModelGeometry(f"kv-{name}", 3, 2, 16, block_size=4).quantized(name) for name in QUANTS]
CASES = [(name, g) for g in (KV, MLA, *QUANTIZED) for name in compatible_layouts(g)]


def test_every_layout_holds_kv_or_mla():
    assert {name for name, _ in CASES} == set(LAYOUTS)
    assert {name for name, g in CASES if g.is_mla} >= {"BLHNC", "mla_v0.12", "ascend_mla_tuple", "KV_MLA_FMT"}


def test_unknown_layout_lists_choices():
    with pytest.raises(ValueError, match=r"unknown layout 'NHDL'; choose one of \['LBHNC'"):
        get_layout("NHDL")
    assert get_layout("blhnc").name == "BLHNC"


@pytest.mark.parametrize("name", ["flash_attn_v0.12", "KV_2LTD", "ascend_kv_tuple", "CPU_LBHNC"])
def test_mla_in_kv_split_layout_is_refused(name):
    with pytest.raises(ValueError, match="keeps K and V apart.*MLA-capable layouts"):
        allocate(name, MLA, 4)


def test_mla_layout_for_kv_model_is_refused():
    with pytest.raises(ValueError, match="is for MLA caches.*K/V layouts"):
        allocate("mla_v0.12", KV, 4)


@pytest.mark.parametrize("blocks", [0, -3, 2.5, True])
def test_bad_block_count(blocks):
    with pytest.raises(ValueError, match="num_blocks must be a positive integer"):
        allocate("LBHNC", KV, blocks)


def test_bad_fill():
    with pytest.raises(ValueError, match="fill must be"):
        allocate("LBHNC", KV, 2, fill="ones")


@pytest.mark.parametrize("name, geometry", CASES, ids=[f"{n}-{g.name}" for n, g in CASES])
def test_views_cover_storage_exactly_once(name, geometry):
    cache = allocate(name, geometry, 5)
    for view in cache.layers.values():
        for tensor in view if isinstance(view, tuple) else (view,):
            tensor.add_(1)
    assert all(bool((t == 1).all()) for t in cache.storage)
    assert cache.nbytes == 5 * geometry.block_bytes
    assert len(cache.layers) == geometry.num_layers


def _code(layer, block, part, token, head, geometry, num_blocks):
    return (((layer * num_blocks + block) * 2 + part) * geometry.block_size + token) * geometry.num_kv_heads + head


@pytest.mark.parametrize("name, geometry", CASES, ids=[f"{n}-{g.name}" for n, g in CASES])
def test_views_put_each_head_vector_where_the_layout_says(name, geometry):
    """Write (layer, block, part, token, head) through the views; read it back in address order."""
    layout = get_layout(name)
    if "".join(layout.view_shape) != layout.view_order:
        pytest.skip("a reshaped page (CPU backend): its view axes are not the layout's axes")
    num_blocks = 3
    cache = allocate(layout, geometry, num_blocks)
    for layer, view in enumerate(cache.layers.values()):
        for part, tensor in enumerate(view if isinstance(view, tuple) else (view,)):
            sizes = axis_sizes(layout, geometry, num_blocks, part if layout.is_tuple else None)
            axes = layout.view_order
            full = tensor.view([sizes[a] for a in axes])
            grid = dict(zip(axes, torch.meshgrid(*[torch.arange(sizes[a]) for a in axes], indexing="ij")))
            code = _code(layer, grid["B"], grid.get("S", part), grid["N"], grid["H"], geometry, num_blocks)
            full.copy_(code.to(full.dtype))
    labels = address_labels(layout, geometry, num_blocks)
    firsts = [t.flatten()[:: alloc.sizes[-1]] for t, alloc in zip(cache.storage, allocations(layout, geometry, num_blocks))]
    expected = _code(labels["layer"], labels["block"], labels["part"], labels["token"], labels["head"], geometry, num_blocks)
    assert torch.equal(torch.cat(firsts).long(), expected.to(geometry.dtype).long())  # 1-byte rows wrap alike


def test_cross_layer_tensor():
    assert allocate("LBHNC", KV, 2).cross_layer_tensor is None
    cache = allocate("flash_attn_v0.12_cross", KV, 2)
    assert tuple(cache.cross_layer_tensor.shape) == (2, 3, 2, 4, 2, 8)
    assert cache.cross_layer_tensor.is_contiguous()


def test_chunk_sizes():
    chunk = allocate_chunk("KV_2LTD", preset("smollm2-135m"), 256)
    assert tuple(chunk.storage[0].shape) == (2, 30, 256, 3 * 64)
    assert tuple(allocate_chunk("KV_MLA_FMT", preset("deepseek-v2-lite"), 64).storage[0].shape) == (1, 27, 64, 576)
    with pytest.raises(ValueError, match="not a multiple of the block size 16"):
        allocate_chunk("KV_2LTD", preset("smollm2-135m"), 100)
    with pytest.raises(ValueError, match="is a paged cache layout; chunk formats are"):
        allocate_chunk("BLHNC", preset("smollm2-135m"), 256)
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
        allocate_chunk("KV_T2D", preset("smollm2-135m"), 0)


@settings(max_examples=25, deadline=None)
@given(
    layers=st.integers(1, 4), heads=st.integers(1, 3), head=st.sampled_from([2, 4, 8]),
    block=st.sampled_from([1, 2, 4]), blocks=st.integers(1, 4),
    dtype=st.sampled_from(["float32", "bfloat16", "float16", "float8_e4m3fn"]),
)
def test_arange_fill_is_each_tensors_address(layers, heads, head, block, blocks, dtype):
    geometry = ModelGeometry("g", layers, heads, head, dtype="float32", block_size=block)
    cache = allocate("BLHNC", geometry, blocks, fill="arange")
    flat = cache.storage[0].flatten()
    assert torch.equal(flat, torch.arange(flat.numel(), dtype=flat.dtype))
    small = allocate("LBHNC", geometry.with_(dtype=dtype), blocks, device="meta")
    assert small.storage[0].dtype == geometry.with_(dtype=dtype).dtype


@pytest.mark.parametrize("name", ["CPU_LBHNC", "cpu_attn_v0.23"])
def test_cpu_page_is_all_k_rows_then_all_v_rows(name):
    """Split the view as vLLM's CPU backend does (view [B, H, 2*BS, D], chunk on dim 2)."""
    num_blocks = 3
    cache = allocate(name, KV, num_blocks)
    for layer, view in enumerate(cache.layers.values()):
        blocks, heads, tokens, _ = view.shape
        for part, half in enumerate(view.view(blocks, heads, tokens * 2, -1).chunk(2, dim=2)):
            b, h, n = torch.meshgrid(torch.arange(blocks), torch.arange(heads), torch.arange(tokens), indexing="ij")
            half.copy_(_code(layer, b, part, n, h, KV, num_blocks)[..., None].float())
    labels = address_labels(name, KV, num_blocks)
    firsts = torch.cat([t.flatten()[:: KV.head_size] for t in cache.storage])
    expected = _code(labels["layer"], labels["block"], labels["part"], labels["token"], labels["head"], KV, num_blocks)
    assert torch.equal(firsts.long(), expected)


def test_devices():
    from kvlab.cache import resolve_device

    assert allocate("BLHNC", KV, 2, device="auto").storage[0].device.type == resolve_device("auto").type
    with pytest.raises(ValueError, match="unknown device 'tpu'; choose auto, cpu, cuda, npu"):
        allocate("BLHNC", KV, 2, device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="'cuda:0' is not available on this machine"):
            allocate("BLHNC", KV, 2, device="cuda:0")
    from kvlab.cache import npu_available

    if not npu_available():
        with pytest.raises(ValueError, match="'npu' is not available on this machine \\(install torch_npu\\)"):
            allocate("BLHNC", KV, 2, device="npu")


_GOOD_LAYOUT = {"name": "mine", "family": "test", "order": "BNLHSD", "view_order": "BHNSD",
                "view_shape": ("B", "H", "N", "SD"), "shape_text": "[B, H, N, C]", "note": ""}


@pytest.mark.parametrize("changes, message", [
    ({"order": "BNLHS"}, "order must hold each of the axes LBSNHD once, with D innermost"),
    ({"order": "BNLHDS"}, "order must hold each of the axes LBSNHD once, with D innermost"),
    ({"order": "BNLHSDD"}, "order must hold each of the axes"),
    ({"split": "X"}, "split names axes"),
    ({"view_order": "BHNS"}, r"view_order must hold each axis .*\('BNHSD'\) once, got 'BHNS'"),
    ({"view_order": "BHNSD", "split": "S"}, r"view_order must hold .*\('BNHD'\)"),
])
def test_bad_layout_is_a_value_error(changes, message):
    """What register_layout is handed is user input: a clear ValueError naming the layout."""
    from kvlab.cache import Layout, register_layout

    with pytest.raises(ValueError, match="layout 'mine': " + message):
        register_layout(Layout(**{**_GOOD_LAYOUT, **changes}))
    assert "mine" not in LAYOUTS
    assert Layout(**_GOOD_LAYOUT).is_cross_layer  # the unchanged one is fine


def test_bad_layout_is_refused_under_python_O():
    """``python -O`` strips asserts: the check must survive it."""
    import subprocess
    import sys

    code = ("from kvlab.cache import Layout\n"
            "try:\n"
            "    Layout('mine', 'test', 'BNLHS', 'BHNS', ('B',), '', '')\n"
            "except ValueError as e:\n"
            "    print('refused:', e)\n"
            "else:\n"
            "    print('accepted')\n")
    done = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("refused: layout 'mine': order must hold"), done.stdout


def test_roles_are_data_on_the_layout():
    """What a connector adopts a vLLM cache as, what vLLM order a layout reads and how
    LMCache's CPU fallback views it are fields, not names: a layout registered with a role
    takes its part at once."""
    from dataclasses import replace

    from kvlab.cache.layouts import by_role, register_layout, unregister_layout

    assert by_role("mla") == ["mla_v0.29", "mla_v0.29_cross", "mla_v0.12"]
    assert by_role("cpu") == ["CPU_LBHNC", "CPU_LHBNC", "CPU_BLHNC", "CPU_BHLNC"]
    assert by_role("vllm") == ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]
    assert {LAYOUTS[n].vllm_order for n in ("CPU_BLHNC", "nvfp4_BLHNC", "BLHNC")} == {"BLHNC"}
    assert {n: LAYOUTS[n].lmcache_pages for n in LAYOUTS if LAYOUTS[n].lmcache_pages} == {
        "flash_attn_v0.12": ("S", "BN", "HD"), "flashinfer_v0.12": ("B", "S", "N", "HD"), "mla_v0.12": ("BN", "HSD")}
    register_layout(replace(LAYOUTS["CPU_LBHNC"], name="CPU_mine"))
    try:
        assert by_role("cpu")[-1] == "CPU_mine"
    finally:
        unregister_layout("CPU_mine")
    with pytest.raises(ValueError, match="role is one of"):
        replace(LAYOUTS["LBHNC"], role="gpu")
