import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from kvlab.cache import preset, sweep  # noqa: E402
from kvlab.plotting import memory_map, miniature, save_figure, segment_scaling  # noqa: E402


def test_memory_map_and_save(tmp_path):
    small = miniature(preset("llama-3.1-8b"))
    assert (small.num_layers, small.num_kv_heads, small.block_size) == (4, 2, 4)
    fig = memory_map(["LBHNC", "BLHNC", "ascend_kv_tuple"], small, moved_blocks=(1, 4))
    assert len(fig.axes) == 12
    assert fig.axes[0].get_title() == "LBHNC\n8 segments for 2 blocks"
    assert fig.axes[1].get_title() == "BLHNC\n2 segments for 2 blocks"
    paths = save_figure(fig, "map", tmp_path, formats=("png", "svg", "pdf"))
    assert [p.suffix for p in paths] == [".png", ".svg", ".pdf"] and all(p.stat().st_size > 1000 for p in paths)


def test_memory_map_mla_and_bad_colour():
    small = miniature(preset("deepseek-v2-lite"))
    memory_map(["mla_v0.12", "ascend_mla_tuple"], small, colour_by=("layer", "part"))
    with pytest.raises(ValueError, match="colour by one of"):
        memory_map(["LBHNC"], small, colour_by=("colour",))


def test_segment_scaling(tmp_path):
    rows = sweep(["LBHNC", "BLHNC"], preset("qwen3-8b"), [16, 64, 256], [16, 32])
    fig = segment_scaling(rows, "qwen3")
    assert [ax.get_title() for ax in fig.axes if ax.get_title()] == ["block size 16", "block size 32"]
    assert all(len(ax.lines) == 2 for ax in fig.axes)  # a line per layout in each panel


def test_segments_by_layout():
    from kvlab.plotting import segments_by_layout

    rows = sweep(["LBHNC", "BLHNC", "flash_attn_v0.12", "BHLNC"], preset("llama-3.1-8b"), [256], [16, 64])
    fig = segments_by_layout(rows, "llama")
    assert sum(len(dots.get_offsets()) for dots in fig.axes[0].collections) == 6  # a dot per block size and row
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["LBHNC", "BLHNC, BHLNC", "flash_attn_v0.12"]
    assert " 512 × 64 KiB" not in [t.get_text() for t in fig.axes[0].texts] and "512 × 64 KiB" in [
        t.get_text() for t in fig.axes[0].texts]


def test_saved_figures_are_reproducible(tmp_path):
    small = miniature(preset("smollm2-135m"))
    first = [p.read_bytes() for p in save_figure(memory_map(["BLHNC"], small), "a", tmp_path, ("png", "svg", "pdf"))]
    second = [p.read_bytes() for p in save_figure(memory_map(["BLHNC"], small), "b", tmp_path, ("png", "svg", "pdf"))]
    assert first == second


def test_an_svg_is_the_same_bytes_where_a_cpu_rounds_a_coordinate_otherwise(tmp_path):
    """A drawing whose clip box differs in a float's last bits (another CPU's rounding of the
    same layout) saves the same SVG: matplotlib hashes those floats into its ids."""
    import matplotlib.pyplot as plt

    saved = []
    for nudge in (0.0, 1e-13):
        fig, ax = plt.subplots()
        ax.plot([0, 1], [0, 1], marker="o")
        ax.set_position([0.125 + nudge, 0.11, 0.775, 0.77])
        (path,) = save_figure(fig, f"nudged-{nudge}", tmp_path, ("svg",))
        saved.append(path.read_text())
        plt.close(fig)
    assert saved[0] == saved[1]
    assert 'id="p' in saved[0] and 'clip-path="url(#p' in saved[0], "the clip path is still named and used"


def test_atlas_draws_every_layout():
    from kvlab.cache import LAYOUTS, Holds
    from kvlab.plotting import atlas

    names = [n for n, layout in LAYOUTS.items() if layout.requires is not Holds.MLA and layout.scales != "regions"]
    fig = atlas(names, miniature(preset("llama-3.1-8b")), columns=6)
    drawn = [ax.get_xlabel().replace("\n", " ") for ax in fig.axes if ax.images]
    assert sorted(name for labels in drawn for name in labels.split(", ")) == sorted(names)
    assert len(drawn) < len(names)  # layouts drawing the same map share it
    nvfp4 = [n for n, layout in LAYOUTS.items() if layout.scales == "regions"]  # NVFP4's own, with its geometry
    fig = atlas(nvfp4, miniature(preset("llama-3.1-8b")).quantized("nvfp4"), by="kind")
    drawn = [ax.get_xlabel().replace("\n", " ") for ax in fig.axes if ax.images]
    assert sorted(name for labels in drawn for name in labels.split(", ")) == sorted(nvfp4)


def test_a_figure_names_the_machines_and_profiles_it_shows(tmp_path):
    import pandas as pd

    from kvlab.plotting.saving import provenance

    rows = [{"hardware": "cpu: A (2 cores)", "profile": "standard"}, {"hardware": "cpu: A (2 cores)", "profile": "standard"},
            {"hardware": "cuda: H200", "profile": "paper"}]
    assert provenance(rows) == "measured on cpu: A (2 cores), standard profile; cuda: H200, paper profile"
    assert provenance(pd.DataFrame(rows)) == provenance(rows)
    fig = segment_scaling(sweep(["BLHNC"], preset("llama-3.1-8b"), [16], [16]), "t")
    save_figure(fig, "f", tmp_path, formats=("png",), source=rows, compares_machines=True)
    assert [t.get_text() for t in fig.texts if "profile" in t.get_text()] == [provenance(rows)]


def test_in_a_notebook_a_saved_figure_is_shown_with_its_caption_and_alt_text(tmp_path, monkeypatch):
    """The report (kvlab.plotting.report) puts them under the image and in its alt attribute."""
    import IPython.display

    from kvlab.plotting import saving

    shown = []
    monkeypatch.setattr(saving, "shown_in_a_notebook", lambda: True)
    monkeypatch.setattr(IPython.display, "display", lambda figure, metadata=None: shown.append((figure, metadata)))
    fig = segment_scaling(sweep(["BLHNC"], preset("llama-3.1-8b"), [16, 64], [16]), "Llama-3.1-8B, scattered blocks")
    save_figure(fig, "segments", tmp_path, formats=("png",), source=[{"hardware": "cpu: A (2 cores)",
                                                                     "profile": "standard"}])
    ((figure, metadata),) = shown
    described = metadata["image/png"]
    assert figure is fig
    assert described["caption"] == "Llama-3.1-8B, scattered blocks. Measured on cpu: A (2 cores), standard profile."
    assert described["alt"].startswith("Figure segments: Llama-3.1-8B, scattered blocks.")
    assert "x: tokens moved" in described["alt"] and "Legend: BLHNC." in described["alt"]
