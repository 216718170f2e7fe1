import pytest
import torch

from kvlab import hooks
from kvlab.cache import ModelGeometry, allocate, allocate_chunk, compatible_layouts, layer_name
from kvlab.transfer import Transfer

LAYER = layer_name(0)


class RecordingConnector:
    """Records what the hooks call; ``has_metadata`` plays vLLM's has_connector_metadata."""

    def __init__(self, has_metadata: bool = True) -> None:
        self.has_metadata = has_metadata
        self.calls: list[tuple] = []

    def has_connector_metadata(self) -> bool:
        return self.has_metadata

    def wait_for_layer_load(self, layer_name):
        self.calls.append(("wait", layer_name))

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata):
        self.calls.append(("save", layer_name, kv_layer, attn_metadata))


def _both_hooks(kv=None):
    hooks.wait_for_kv_layer_from_connector(LAYER)
    hooks.maybe_save_kv_layer_to_connector(LAYER, kv if kv is not None else torch.zeros(2))


def test_hooks_are_noops_without_a_connector_or_metadata():
    _both_hooks()  # nothing active: nothing to call, nothing raised
    assert hooks.current_connector() is None
    idle = RecordingConnector(has_metadata=False)
    with hooks.connector_active(idle, {LAYER: "meta"}):
        _both_hooks()
    no_attn_metadata = RecordingConnector()
    with hooks.connector_active(no_attn_metadata, None):
        _both_hooks()
    assert idle.calls == no_attn_metadata.calls == []


def test_dict_metadata_gives_the_layer_entry_and_single_objects_pass_as_is():
    connector = RecordingConnector()
    with hooks.connector_active(connector, {LAYER: "mine", layer_name(1): "other"}):
        _both_hooks()
    single = object()
    with hooks.connector_active(connector, single):
        _both_hooks()
    with hooks.connector_active(connector, [{LAYER: "first micro-batch"}, {LAYER: "second"}]):
        hooks.maybe_save_kv_layer_to_connector(LAYER, None)
    assert [c[0] for c in connector.calls] == ["wait", "save", "wait", "save", "save"]
    assert [c[3] for c in connector.calls if c[0] == "save"] == ["mine", single, "first micro-batch"]


def test_missing_layer_key_names_the_layer():
    with hooks.connector_active(RecordingConnector(), {"model.layers.7.self_attn.attn": 1}):
        with pytest.raises(KeyError, match=r"model\.layers\.0\.self_attn\.attn.*model\.layers\.7"):
            hooks.maybe_save_kv_layer_to_connector(LAYER, torch.zeros(1))


def test_nested_contexts_restore_the_outer_connector():
    outer, inner = RecordingConnector(), RecordingConnector()
    with hooks.connector_active(outer, "o"):
        with hooks.connector_active(inner, "i"):
            hooks.wait_for_kv_layer_from_connector(LAYER)
        hooks.wait_for_kv_layer_from_connector(LAYER)
    assert len(outer.calls) == len(inner.calls) == 1


@pytest.mark.parametrize("layout, geometry", [
    ("LBHNC", ModelGeometry("t", 2, 2, 8, block_size=4)),
    ("ascend_kv_tuple", ModelGeometry("t", 2, 2, 8, block_size=4)),
    ("ascend_mla_tuple", ModelGeometry.mla("m", 2, 16, 8, block_size=4)),
])
def test_kv_layers_reach_the_connector_unchanged(layout, geometry):
    kv = allocate(layout, geometry, 3).layers[LAYER]
    connector = RecordingConnector()
    with hooks.connector_active(connector, {LAYER: "m"}):
        hooks.maybe_save_kv_layer_to_connector(LAYER, kv)
    assert connector.calls[0][2] is kv
    assert isinstance(kv, tuple) == (layout != "LBHNC")


@pytest.mark.parametrize("geometry", [
    ModelGeometry("t", 2, 2, 8, dtype="float32", block_size=4),
    ModelGeometry.mla("m", 2, 16, 8, dtype="float32", block_size=4),
], ids=["kv", "mla"])
def test_layer_parts_agree_with_the_transfer_engine(geometry):
    """What the stack writes through layer_parts is where kvlab.transfer finds each layer's
    K/V (or latent/rope), checked against a canonical LMCache chunk for every paged layout."""
    chunk_format = "KV_MLA_FMT" if geometry.is_mla else "KV_2LTD"
    for layout in compatible_layouts(geometry, chunk_formats=False):
        cache = allocate(layout, geometry, 5)
        for i in range(geometry.num_layers):
            for p, part in enumerate(hooks.layer_parts(cache, layer_name(i))):
                part.copy_(torch.arange(part.numel()).view(part.shape) + 1000 * i + 100000 * p)
        chunk = allocate_chunk(chunk_format, geometry, 2 * geometry.block_size)
        Transfer(cache, [3, 1], chunk).run()
        for i in range(geometry.num_layers):
            tokens = [part[[3, 1]].flatten(0, 1).flatten(1) for part in hooks.layer_parts(cache, layer_name(i))]
            expected = [torch.cat(tokens, -1)] if geometry.is_mla else tokens
            assert all(torch.equal(chunk.storage[0][p, i], e) for p, e in enumerate(expected)), layout


def _geometry(layout: str, dtype: str) -> ModelGeometry:
    if "mla" in layout:
        return ModelGeometry.mla("tiny-mla", 3, 16, 8, dtype=dtype, block_size=4)
    return ModelGeometry("tiny", 3, 2, 8, dtype=dtype, block_size=4)


BLOCKS = [5, 2, 7, 0]  # scattered on purpose; 13 tokens fill 3 blocks and a bit


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["LBHNC", "CPU_LBHNC", "BLHNC", "ascend_kv_tuple", "ascend_mla_tuple"])
def test_layerwise_reload_is_bitwise_identical(layout, dtype):
    geometry = _geometry(layout, dtype)
    stack = hooks.TinyAttentionStack(geometry)
    generator = torch.Generator().manual_seed(1)
    prompt, continuation = (torch.randn(n, stack.hidden, generator=generator) for n in (10, 3))

    reference = allocate(layout, geometry, 8)
    ref_prompt = stack(prompt, reference, BLOCKS)
    ref_continuation = stack(continuation, reference, BLOCKS, start=10)

    cache = allocate(layout, geometry, 8)
    offloader = hooks.LayerwiseOffloader(cache, num_buffer_blocks=3)
    prompt_blocks = BLOCKS[:3]  # positions 0-9
    with offloader.step(hooks.OffloadPlan(save_blocks=prompt_blocks)):
        out_prompt = stack(prompt, cache, BLOCKS, connector=offloader)
    for tensor in cache.storage:
        tensor.zero_()
    assert not torch.equal(stack(continuation, cache, BLOCKS, start=10), ref_continuation)  # the prefix matters
    for tensor in cache.storage:
        tensor.zero_()
    with offloader.step(hooks.OffloadPlan(load_blocks=prompt_blocks)):
        out_continuation = stack(continuation, cache, BLOCKS, start=10, connector=offloader)

    assert torch.equal(out_prompt, ref_prompt)
    assert torch.equal(out_continuation, ref_continuation)
    assert all(torch.equal(a, b) for a, b in zip(cache.storage, reference.storage))


def test_trace_records_each_layer_in_order_and_waits_before_attention():
    geometry = _geometry("LBHNC", "float32")
    stack = hooks.TinyAttentionStack(geometry)
    cache = allocate("LBHNC", geometry, 8)
    prompt, continuation = torch.randn(10, stack.hidden), torch.randn(3, stack.hidden)
    offloader = hooks.LayerwiseOffloader(cache, num_buffer_blocks=5)
    with offloader.step(hooks.OffloadPlan(save_blocks=BLOCKS[:3])):
        stack(prompt, cache, BLOCKS, connector=offloader)
    plan = hooks.OffloadPlan(load_blocks=BLOCKS[:3], save_blocks=BLOCKS[2:], save_to=[3, 4])
    with hooks.LayerTrace() as trace, offloader.step(plan):
        stack(continuation, cache, BLOCKS, start=10, connector=offloader)
    rows = trace.rows()
    hooked = [r for r in rows if r["event"] != "load"]
    expected = [(layer_name(i), e) for i in range(geometry.num_layers) for e in ("load_wait", "attention", "save")]
    assert [(r["layer"], r["event"]) for r in hooked] == expected
    assert all(0 <= r["start"] <= r["end"] for r in rows)
    assert all(a["end"] <= b["start"] for a, b in zip(hooked, hooked[1:]))
    # each layer's load, copied by the loading thread, in layer order and in place before its wait ends
    loads = {r["layer"]: r for r in rows if r["event"] == "load"}
    assert list(loads) == [layer_name(i) for i in range(geometry.num_layers)]
    assert all(loads[r["layer"]]["end"] <= r["end"] for r in hooked if r["event"] == "load_wait")
    # without a connector only attention is traced, and nothing outside the trace is
    with hooks.LayerTrace() as plain:
        stack(continuation, cache, BLOCKS, start=10)
    assert [r["event"] for r in plain.rows()] == ["attention"] * geometry.num_layers
    assert len(trace.rows()) == len(rows)


def test_stack_refuses_a_cache_it_was_not_built_for():
    stack = hooks.TinyAttentionStack(_geometry("LBHNC", "float32"))
    with pytest.raises(ValueError, match="built for"):
        stack(torch.randn(2, stack.hidden), allocate("LBHNC", _geometry("LBHNC", "bfloat16"), 4), [0])
    with pytest.raises(ValueError, match="need 2 blocks"):
        stack(torch.randn(5, stack.hidden), allocate("LBHNC", _geometry("LBHNC", "float32"), 4), [0])


def test_timeline_figure_builds():
    import matplotlib

    matplotlib.use("Agg")
    from kvlab.plotting import hooks_timeline

    rows = [
        {"layer": layer_name(i), "event": event, "start": 3 * i + k, "end": 3 * i + k + 0.8}
        for i in range(3) for k, event in enumerate(("load_wait", "attention", "save"))
    ]
    fig = hooks_timeline(rows, "tiny")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["layer 0", "layer 1", "layer 2"]
    assert len(ax.collections) >= 3 and fig.legends


def test_vllm_path_is_a_noop_without_a_group_and_drives_an_active_one(monkeypatch):
    kv_transfer = pytest.importorskip("vllm.distributed.kv_transfer")
    forward_context = pytest.importorskip("vllm.forward_context")
    assert not kv_transfer.has_kv_transfer_group()
    _both_hooks()
    assert hooks.current_connector() is None

    connector = RecordingConnector()
    monkeypatch.setattr(kv_transfer, "has_kv_transfer_group", lambda: True)
    monkeypatch.setattr(kv_transfer, "is_v1_kv_transfer_group", lambda: True)
    monkeypatch.setattr(kv_transfer, "get_kv_transfer_group", lambda: connector)
    _both_hooks()  # a group but no forward context: a no-op
    monkeypatch.setattr(forward_context, "_forward_context", type("Context", (), {"attn_metadata": {LAYER: "v"}})())
    _both_hooks()
    assert [c[0] for c in connector.calls] == ["wait", "save"] and connector.calls[1][3] == "v"
    kvlab_side = RecordingConnector()
    with hooks.connector_active(kvlab_side, "k"):  # kvlab's own context wins
        _both_hooks()
    assert len(kvlab_side.calls) == 2 and len(connector.calls) == 2
