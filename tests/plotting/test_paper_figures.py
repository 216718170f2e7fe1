"""Every figure function drawn from the committed results as its notebook draws it: legends
name each series once, and text is readable at print size in a single and a double column.
(Same bytes on every save: tests/plotting/test_plotting.py; ``make figures`` redrawing the
committed figures byte for byte: tests/integration/test_notebooks_run.py.)"""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.text  # noqa: E402
import pytest  # noqa: E402

from kvlab.cache import LAYOUTS, Holds, preset, sweep  # noqa: E402
from kvlab.plotting import common  # noqa: E402
from kvlab.plotting import (  # noqa: E402
    accuracy_figure, atlas, bandwidth_vs_tokens, break_even_figure, comparison_figure, cost_model_figure,
    deployed_figure, engine_layouts_figure, hardware_figure, hooks_timeline, layerwise_figure, memory_map, miniature, network_tier_figure,
    registration_figure, roundtrip_figure, segment_scaling, segments_by_layout, transfer_ratios,
    ttft_figure,
)
from kvlab.results import committed_results_dir, load_results, results_for  # noqa: E402

LLAMA = preset("llama-3.1-8b")


def committed(stem: str) -> list[dict]:
    return results_for(stem, committed_results_dir())


def transfer_rows() -> list[dict]:
    return load_results(sorted(committed_results_dir().glob("02_transfer-*.jsonl")))


def cost_fits():
    from kvlab.experiments import costmodel

    return costmodel.fit(transfer_rows())


def cost_predictions() -> list[dict]:
    from kvlab.experiments import costmodel

    return costmodel.predictions(transfer_rows(), cost_fits())


def accuracy_tables() -> tuple[list[dict], list[dict], list[dict]]:
    """The three tables notebook 04 draws its accuracy figure from."""
    import pandas as pd

    from kvlab.experiments.engine_checks import against_control

    accuracy = pd.DataFrame(committed("04_accuracy"))
    generations, perplexity, task = (accuracy[accuracy["table"] == name].dropna(axis=1, how="all").convert_dtypes()
                                     for name in ("generations", "perplexity", "task"))
    return (against_control(generations.to_dict("records")), against_control(perplexity.to_dict("records")),
            task.to_dict("records"))


def comparison_rows() -> list[dict]:
    from kvlab.experiments.ttft import connector_costs

    return connector_costs(committed("04_connectors"))


def ttft_rows() -> list[dict]:
    from kvlab.experiments.ttft import with_overheads

    return with_overheads(committed("03_ttft"))


# Each figure function, called as its notebook calls it, on what it reads there.
FIGURES = {
    "memory_map": lambda **kw: memory_map(["LBHNC", "BLHNC", "ascend_kv_tuple"], miniature(LLAMA), **kw),
    "atlas": lambda **kw: atlas([n for n, layout in LAYOUTS.items() if layout.requires is not Holds.MLA],
                                miniature(LLAMA), **kw),
    "segment_scaling": lambda **kw: segment_scaling(sweep(["LBHNC", "BLHNC", "flash_attn_v0.12"], LLAMA,
                                                          [16, 64, 256, 1024], [16, 32]), "llama", **kw),
    "segments_by_layout": lambda **kw: segments_by_layout(sweep(["LBHNC", "BLHNC", "flash_attn_v0.12"], LLAMA, [256],
                                                                [16, 64]), "llama", **kw),
    "transfer_ratios": lambda **kw: transfer_ratios(transfer_rows(), LLAMA.name, 1024, **kw),
    "bandwidth_vs_tokens": lambda **kw: bandwidth_vs_tokens(transfer_rows(), LLAMA.name, "gather", **kw),
    "cost_model_figure": lambda **kw: cost_model_figure(cost_predictions(), **kw),
    "break_even_figure": lambda **kw: break_even_figure(
        [f for f in cost_fits() if f.method in ("segments", "gather")], LLAMA.num_layers, **kw),
    "layerwise_figure": lambda **kw: layerwise_figure(load_results(sorted(committed_results_dir().glob(
        "02_layerwise-*.jsonl"))), **kw),
    "hardware_figure": lambda **kw: hardware_figure(transfer_rows(), LLAMA.name, 1024, **kw),
    "ttft_figure": lambda **kw: ttft_figure(ttft_rows(), "time to first token (cpu: AMD EPYC (2 cores))", **kw),
    "hooks_timeline": lambda **kw: hooks_timeline(committed("03_timeline"), "a prefix loaded layer by layer", **kw),
    "registration_figure": lambda **kw: registration_figure(committed("03_registration"), "save and reload", **kw),
    "engine_layouts_figure": lambda **kw: engine_layouts_figure(committed("03_engine_layouts"), "in the engine", **kw),
    "deployed_figure": lambda **kw: deployed_figure(committed("03_serving"), "vLLM's default processes", **kw),
    "network_tier_figure": lambda **kw: network_tier_figure(committed("03_network"), "a prefix through Redis", **kw),
    "roundtrip_figure": lambda **kw: roundtrip_figure(committed("04_roundtrip"), **kw),
    "accuracy_figure": lambda **kw: accuracy_figure(*accuracy_tables(), "reuse paths", **kw),
    "comparison_figure": lambda **kw: comparison_figure(comparison_rows(), "connectors", **kw),
}


def test_every_figure_function_is_drawn_here():
    import kvlab.plotting

    named = {"memory_map", "atlas", "segment_scaling", "segments_by_layout", "transfer_ratios", "bandwidth_vs_tokens",
             "hooks_timeline"}
    functions = {name for name in kvlab.plotting.__all__
                 if name.endswith("_figure") and name != "save_figure" or name in named}
    assert functions == set(FIGURES)


def _texts(fig: plt.Figure) -> list[matplotlib.text.Text]:
    fig.canvas.draw()  # makes the tick labels
    return [t for t in fig.findobj(matplotlib.text.Text) if t.get_text().strip() and t.get_visible()]


@pytest.mark.parametrize("width", ["single", "double"])
@pytest.mark.parametrize("name", sorted(FIGURES))
def test_figures_name_each_series_once_in_readable_text(name, width):
    fig = FIGURES[name](width=width)
    try:
        labels = common.legend_labels(fig)
        assert len(labels) == len(set(labels)), f"{name}: a legend repeats {labels}"
        assert fig.get_figwidth() == common.WIDTHS[width]
        small = {t.get_text() for t in _texts(fig) if t.get_fontsize() < common.SMALL}
        assert not small, f"{name}: text under {common.SMALL} pt: {sorted(small)[:5]}"
    finally:
        plt.close(fig)


def test_two_machines_are_told_apart_in_every_legend():
    """Two CPUs used to read "cpu" twice each in the break-even legend."""
    import dataclasses

    fits = [f for f in cost_fits() if f.method in ("segments", "gather")]
    xeon = [dataclasses.replace(f, hardware="cpu: Intel(R) Xeon(R) Processor (2 cores)") for f in fits]
    fig = break_even_figure(fits + xeon, LLAMA.num_layers)
    labels = common.legend_labels(fig)
    assert len(labels) == 2 * len(fits) == len(set(labels))
    assert sum("cpu: Intel Xeon (2 cores)" in label for label in labels) == len(fits)
    assert sum("cpu: AMD EPYC (2 cores)" in label for label in labels) == len(fits)

    rows = transfer_rows()
    both = rows + [{**r, "hardware": "cuda: NVIDIA H200"} for r in rows]
    fig = layerwise_figure([{**r, "hardware": h} for r in load_results(sorted(committed_results_dir().glob(
        "02_layerwise-*.jsonl"))) for h in ("cpu: AMD EPYC (2 cores)", "cuda: NVIDIA H200")])
    assert any(label.endswith("cuda: H200") for label in common.legend_labels(fig))
    fig = hardware_figure(both, LLAMA.name, 1024)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["cpu: AMD EPYC (2 cores)", "cuda: H200"]
    plt.close("all")


def test_one_machine_is_named_in_the_legend_title():
    fig = break_even_figure([f for f in cost_fits() if f.method == "gather"], LLAMA.num_layers)
    assert fig.legends[0].get_title().get_text() == "cpu: AMD EPYC (2 cores)"
    plt.close(fig)


def test_methods_and_paths_keep_one_colour_everywhere():
    from kvlab.experiments.paths import Reuse
    from kvlab.transfer import ALL_METHODS, method_colours

    palette = {common.BLACK, common.ORANGE, common.SKY_BLUE, common.GREEN, common.YELLOW, common.BLUE,
               common.VERMILLION, common.PURPLE}
    assert set(method_colours()) == set(ALL_METHODS) and set(method_colours().values()) <= palette
    assert len(set(method_colours().values())) == len(ALL_METHODS)
    assert set(common.PATH_COLOURS) == set(Reuse)
    assert common.path_colour("LMCache") == common.method_colour("lmcache")
    assert common.connector_colour("kvlab") == common.path_colour("KVLab whole-step, disk")
    fig = transfer_ratios(transfer_rows(), LLAMA.name, 1024)
    gather = [p for bars in fig.axes[0].containers if bars.get_label() == "gather" for p in bars.patches]
    assert gather and all(matplotlib.colors.to_hex(p.get_facecolor()) == common.BLUE.lower() for p in gather)
    plt.close(fig)


def test_widths():
    assert common.figure_width("single") == 3.3 and common.figure_width(5) == 5.0
    with pytest.raises(ValueError, match="width is one of"):
        common.figure_width("triple")
    with pytest.raises(ValueError, match="not a page's"):
        transfer_ratios(transfer_rows(), LLAMA.name, 1024, width=40)


def test_short_hardware():
    assert common.short_hardware("cpu: Intel(R) Xeon(R) Processor (2 cores)") == "cpu: Intel Xeon (2 cores)"
    assert common.short_hardware("cuda: NVIDIA H200") == "cuda: H200"
    assert common.short_hardware("cpu: AMD EPYC 7763 64-Core Processor (16 cores)") == "cpu: AMD EPYC 7763 (16 cores)"
    assert common.short_hardware(None) == "this machine"


@pytest.mark.parametrize("name", ["break_even_figure", "roundtrip_figure", "transfer_ratios", "memory_map"])
def test_nothing_to_draw_is_a_clear_error(name):
    import kvlab.plotting

    extra = {"break_even_figure": (32,), "transfer_ratios": (LLAMA.name, 1024), "memory_map": (miniature(LLAMA),)}
    with pytest.raises(ValueError, match="nothing to draw"):
        getattr(kvlab.plotting, name)([], *extra.get(name, ()))
