"""The notebooks' ipywidgets explorer updates its numbers and its picture in place."""

import pytest


def test_explorer_widget_updates():
    pytest.importorskip("ipywidgets")
    from kvlab.plotting.explorer import explore

    box = explore()
    (model, block_size, _), (layout_a, layout_b), numbers, picture = [
        getattr(child, "children", child) for child in box.children
    ]
    before = picture.value
    assert "BLHNC: 32 MiB in 16 segments" in numbers.value and before[:4] == b"\x89PNG"
    model.value = "deepseek-v2-lite"
    assert "flash_attn_v0.12" not in layout_a.options and "mla_v0.12" in layout_a.options
    layout_b.value = "ascend_mla_tuple"
    block_size.value = 64
    assert "ascend_mla_tuple: 7.6 MiB in 216 segments" in numbers.value
    assert picture.value != before
