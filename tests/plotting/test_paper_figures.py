"""Every figure function drawn from the committed results as its notebook draws it: legends
name each series once, and text is readable at print size in a single and a double column.
(Same bytes on every save: tests/plotting/test_plotting.py; ``make figures`` redrawing the
committed figures byte for byte: tests/integration/test_notebooks_run.py.)"""

import matplotlib

matplotlib.use("Agg")

import matplotlib.container  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.text  # noqa: E402
import pytest  # noqa: E402

from kvlab.cache import compatible_layouts, preset, sweep  # noqa: E402
from kvlab.cache.hybrid import hybrid_miniature  # noqa: E402
from kvlab.plotting import common  # noqa: E402
from kvlab.plotting import (  # noqa: E402
    prefix_hit_figure,
    step_calls_figure,
    accuracy_figure, atlas, bandwidth_vs_tokens, break_even_figure, comparison_figure, cost_model_figure,
    deployed_figure, engine_layouts_figure, hardware_figure, hooks_timeline, hybrid_map, layerwise_figure, memory_map,
    miniature, network_tier_figure, registration_figure, segment_scaling, segments_by_layout, transfer_ratios,
    ttft_figure, costs_by_length_figure, lookup_scaling_figure, concurrency_figure, scale_prediction_figure,
    published_figure, layout_question_figure,
)
from kvlab.results import committed_results_dir, load_results, results_for  # noqa: E402

LLAMA = preset("llama-3.1-8b")
HYBRID = hybrid_miniature()


def committed(stem: str) -> list[dict]:
    return results_for(stem, committed_results_dir())


def records(rows) -> list[dict]:
    """Rows through a DataFrame and back, as the notebooks hand them over (NaN for a missing value)."""
    import pandas as pd

    return pd.DataFrame(rows).to_dict("records")


def transfer_rows() -> list[dict]:
    return load_results(sorted(committed_results_dir().glob("02_transfer-*.jsonl")))


def transfer_here() -> list[dict]:
    """Notebook 02's ``here``: the newest transfer run."""
    return committed("02_transfer")


def cost_fits():
    from kvlab.experiments import costmodel

    return costmodel.fit(transfer_rows())


def here_fits(methods=("segments", "gather")):
    """What notebook 02 draws its break-even figure from: the newest run's machine's fits."""
    return [f for f in cost_fits() if f.method in methods and f.hardware == transfer_here()[0]["hardware"]]


def cost_predictions() -> list[dict]:
    """What notebook 02 draws its cost model from: the newest run against its own machine's fits."""
    from kvlab.experiments import costmodel

    here = transfer_here()
    return costmodel.predictions(here, [f for f in cost_fits() if f.hardware == here[0]["hardware"]])


def gpu_model():
    """Notebook 02's GPU section: the published table, the model fitted on it, its evaluation."""
    from kvlab.experiments import gpu_costmodel
    from kvlab.experiments.published import load_published

    published = load_published()
    params = gpu_costmodel.fit(published)
    return params, gpu_costmodel.evaluate(published, params)


def gpu_question() -> list[dict]:
    from kvlab.experiments import gpu_costmodel

    return records(gpu_costmodel.layout_question(*gpu_model()))


def accuracy_tables() -> tuple[list[dict], list[dict], list[dict]]:
    """The three tables notebook 06 draws its accuracy figure from."""
    import pandas as pd

    from kvlab.experiments.engine_checks import against_control

    accuracy = pd.DataFrame(committed("04_accuracy"))
    generations, perplexity, task = (accuracy[accuracy["table"] == name].dropna(axis=1, how="all").convert_dtypes()
                                     for name in ("generations", "perplexity", "task"))
    return (records(against_control(generations.to_dict("records"))),
            records(against_control(perplexity.to_dict("records"))), task.to_dict("records"))


def comparison_rows() -> list[dict]:
    from kvlab.experiments.ttft import connector_costs

    return records(connector_costs(committed("04_connectors")))


def ttft_rows() -> list[dict]:
    from kvlab.experiments.ttft import with_overheads

    return records(with_overheads(committed("03_ttft")))


def ttft(**kw):
    rows = ttft_rows()
    return ttft_figure(rows, f"{rows[0]['model']}: time to first token, {int(rows[0]['prompt_tokens'])}-token prompts "
                             f"({rows[0]['hardware']})", **kw)


def timeline(**kw):
    rows = committed("03_timeline")
    return hooks_timeline(rows, f"{rows[0]['model']}, {rows[0]['prompt_tokens']}-token prefix loaded layer by layer "
                                f"({rows[0]['layout']}, {rows[0]['hardware']})", **kw)


def registration(**kw):
    rows = records(committed("03_registration"))
    return registration_figure(rows, f"{rows[0]['model']}: save and reload {int(rows[0]['tokens'])} tokens through "
                                     f"KVLabConnector", **kw)


def engine_layouts(**kw):
    rows = records(committed("03_engine_layouts"))
    return engine_layouts_figure(rows, f"Per-layer against cross-layer in vLLM's CPU engine: SmolLM2-135M, "
                                       f"{int(rows[0]['prompt_tokens'])}-token prompts", **kw)


def deployed(**kw):
    rows = committed("03_serving")
    return deployed_figure(rows, f"{rows[0]['model']}, vLLM's default processes ({rows[0]['hardware']})", **kw)


def network(**kw):
    rows = committed("03_network")
    return network_tier_figure(rows, f"{rows[0]['model']}: a {rows[0]['tokens']}-token prefix through Redis "
                                     f"({rows[0]['hardware']})", **kw)


def scale_prediction(**kw):
    from kvlab.experiments.scale_model import calibration, fit_stores, predict
    from kvlab.runtime.models import geometry_of, model_path

    rows = committed("03_beyond")
    fits = fit_stores([r for r in rows if r["kind"] == "pace"])
    geometry = geometry_of(model_path("smollm2-135m-instruct"), block_size=32)
    scale = predict([f for f in fits if f.direction == "get"], [geometry], hosts=(1, 2, 4, 8, 16, 32, 64),
                    servers={"redis cluster": 3})
    return scale_prediction_figure(scale, calibration(fits, [r for r in rows if r["kind"] == "prefix"]),
                                   f"{geometry.name}: fetching 2048-token prefixes from one store "
                                   f"({rows[0]['hardware']})", **kw)


def accuracy(**kw):
    generations, perplexity, task = accuracy_tables()
    return accuracy_figure(generations, perplexity, task, f"{task[0]['model']} ({task[0]['dtype']}): reuse paths "
                                                          f"against recompute and vLLM's own prefix hit", **kw)


def comparison(**kw):
    rows = comparison_rows()
    return comparison_figure(rows, f"{rows[0]['model']} ({rows[0]['dtype']}), {int(rows[0]['prompt_tokens'])}-token "
                                   f"prompts ({rows[0]['hardware']})", **kw)


# Each figure function, called as its notebook calls it (arguments and title), on what it reads there.
FIGURES = {
    "memory_map": lambda **kw: memory_map(["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BHLNC"], miniature(LLAMA), **kw),
    "atlas": lambda **kw: atlas(compatible_layouts(miniature(LLAMA)), miniature(LLAMA), **kw),
    "hybrid_map": lambda **kw: hybrid_map(HYBRID, ["LBHNC", "BLHNC"], [0, 1, 2, 0, 1, 2], 32, moved=(0, [0, 3]), **kw),
    "segment_scaling": lambda **kw: segment_scaling(sweep(
        ["LBHNC", "BLHNC", "flash_attn_v0.12", "ascend_kv_tuple"], LLAMA, [2 ** k for k in range(4, 14)],
        [16, 32, 64, 128]), "Llama-3.1-8B, bf16, scattered blocks", **kw),
    "segments_by_layout": lambda **kw: segments_by_layout(sweep(
        compatible_layouts(LLAMA, chunk_formats=False), LLAMA, [256], [16, 64]),
        "Llama-3.1-8B, bf16: moving 256 tokens from scattered blocks", **kw),
    "transfer_ratios": lambda **kw: transfer_ratios(transfer_here(), LLAMA.name, 1024, **kw),
    "bandwidth_vs_tokens": lambda **kw: bandwidth_vs_tokens(transfer_here(), LLAMA.name, "gather", **kw),
    "cost_model_figure": lambda **kw: cost_model_figure(cost_predictions(), **kw),
    "break_even_figure": lambda **kw: break_even_figure(here_fits(), LLAMA.num_layers, **kw),
    "layerwise_figure": lambda **kw: layerwise_figure(load_results(sorted(committed_results_dir().glob(
        "02_layerwise-*.jsonl"))), **kw),
    "hardware_figure": lambda **kw: hardware_figure(transfer_rows(), LLAMA.name, 1024, **kw),
    "ttft_figure": ttft,
    "hooks_timeline": timeline,
    "registration_figure": registration,
    "engine_layouts_figure": engine_layouts,
    "deployed_figure": deployed,
    "network_tier_figure": network,
    "scale_prediction_figure": scale_prediction,
    "accuracy_figure": accuracy,
    "comparison_figure": comparison,
    "costs_by_length_figure": lambda **kw: costs_by_length_figure(
        records(committed("03_costs_by_length")), "smollm2-135m-instruct-bf16: a hit against prompt length", **kw),
    "lookup_scaling_figure": lambda **kw: lookup_scaling_figure(
        records(committed("03_lookup_scaling")), "a scheduler's lookup against chunks stored", **kw),
    "concurrency_figure": lambda **kw: concurrency_figure(
        records(committed("03_concurrency")), "serving against concurrent requests", **kw),
    "published_figure": lambda **kw: published_figure(records(gpu_model()[1]), **kw),
    "layout_question_figure": lambda **kw: layout_question_figure(gpu_question(), **kw),
    "prefix_hit_figure": lambda **kw: prefix_hit_figure(title="a prefix hit through KVLabConnector", **kw),
    "step_calls_figure": lambda **kw: step_calls_figure(title="one engine step's connector calls", **kw),
}
PAGE_WIDE = {"prefix_hit_figure", "step_calls_figure"}  # diagrams that refuse a column's width


def test_every_figure_function_is_drawn_here():
    import kvlab.plotting

    named = {"memory_map", "atlas", "segment_scaling", "segments_by_layout", "transfer_ratios", "bandwidth_vs_tokens",
             "hooks_timeline", "hybrid_map"}
    functions = {name for name in kvlab.plotting.__all__
                 if name.endswith("_figure") and name != "save_figure" or name in named}
    assert functions == set(FIGURES)


def _texts(fig: plt.Figure) -> list[matplotlib.text.Text]:
    fig.canvas.draw()  # makes the tick labels
    return [t for t in fig.findobj(matplotlib.text.Text) if t.get_text().strip() and t.get_visible()]


@pytest.mark.parametrize("width", ["single", "double"])
@pytest.mark.parametrize("name", sorted(FIGURES))
def test_figures_name_each_series_once_in_readable_text(name, width):
    if name in PAGE_WIDE and width == "single":
        with pytest.raises(ValueError, match="need the page's width"):
            FIGURES[name](width=width)
        return
    fig = FIGURES[name](width=width)
    try:
        labels = common.legend_labels(fig)
        assert len(labels) == len(set(labels)), f"{name}: a legend repeats {labels}"
        assert fig.get_figwidth() == common.WIDTHS[width]
        small = {t.get_text() for t in _texts(fig) if t.get_fontsize() < common.SMALL}
        assert not small, f"{name}: text under {common.SMALL} pt: {sorted(small)[:5]}"
    finally:
        plt.close(fig)


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_bars_stand_on_zero_of_a_linear_axis(name):
    """A bar's length is its value only from 0 on a linear axis; values spanning decades are
    dots on a log axis instead."""
    fig = FIGURES[name]()
    try:
        for ax in fig.axes:
            for bars in (c for c in ax.containers if isinstance(c, matplotlib.container.BarContainer)):
                axis = ax.xaxis if bars.orientation == "horizontal" else ax.yaxis
                assert axis.get_scale() == "linear", f"{name}: bars on a {axis.get_scale()} axis"
                assert min(axis.get_view_interval()) <= 0, f"{name}: bars on an axis that starts above 0"
    finally:
        plt.close(fig)


def test_methods_vs_ceiling_shows_every_method_and_names_directions_by_what_moves():
    here = transfer_here()
    fig = transfer_ratios(here, LLAMA.name, 1024)
    measured = {r["method"] for r in here if r["status"] == "ok" and r["tokens"] == 1024 and r["target"] == "host"
                and r["model"] == LLAMA.name}
    assert "memcpy" in measured and measured <= set(common.legend_labels(fig))
    assert [ax.get_title() for ax in fig.axes] == ["offload: paged cache → host buffer",
                                                   "load: host buffer → paged cache"]
    on_gpu = transfer_ratios([{**r, "hardware": "cuda: NVIDIA H200"} for r in here], LLAMA.name, 1024)
    assert on_gpu.axes[0].get_title() == "offload: paged cache (cuda) → host buffer"
    plt.close("all")


def test_the_cost_model_states_its_misfit_per_method():
    import statistics

    predicted = cost_predictions()
    fig = cost_model_figure(predicted)
    labels = common.legend_labels(fig)
    for method in {r["method"] for r in predicted}:
        median = statistics.median(100 * abs(r["error"]) for r in predicted if r["method"] == method)
        assert any(label.startswith(f"{method} {median:.0f}% (") for label in labels), (method, labels)
    assert "\n" not in fig.axes[0].get_ylabel()
    plt.close(fig)


def test_time_to_first_token_is_dots_under_the_models_name():
    fig = FIGURES["ttft_figure"]()
    assert fig.get_suptitle().startswith("SmolLM2-135M-Instruct: time to first token")
    assert not fig.axes[0].patches and fig.axes[0].get_xscale() == "log"
    plt.close(fig)


AMD, XEON = "cpu: AMD EPYC (2 cores)", "cpu: Intel Xeon (2 cores)"


def test_a_figure_of_one_machine_draws_the_newest_run_and_one_comparing_them_names_each():
    """The committed results come from an AMD EPYC and an Intel Xeon: the break-even figure
    refuses fits of both (whose threshold is whose would be a guess), the layerwise figure
    draws the newest run, the hardware figure (a comparison by design) names each machine."""
    fits = [f for f in cost_fits() if f.method in ("segments", "gather")]
    assert {common.short_hardware(f.hardware) for f in fits} == {AMD, XEON}
    with pytest.raises(ValueError, match="2 machines"):
        break_even_figure(fits, LLAMA.num_layers)

    layers = load_results(sorted(committed_results_dir().glob("02_layerwise-*.jsonl")))
    fig = layerwise_figure([{**r, "hardware": "cuda: NVIDIA H200", "run_date": "2000-01-01"} for r in layers] + layers)
    assert fig.legends[0].get_title().get_text() == AMD and not any("H200" in label for label in common.legend_labels(fig))
    rows = transfer_rows()
    fig = hardware_figure(rows + [{**r, "hardware": "cuda: NVIDIA H200"} for r in rows if r["hardware"] == AMD],
                          LLAMA.name, 1024)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == [AMD, XEON, "cuda: H200"]
    plt.close("all")


def test_one_machine_is_named_in_the_legend_title():
    fig = break_even_figure([f for f in cost_fits() if f.method == "gather" and f.hardware == AMD], LLAMA.num_layers)
    assert fig.legends[0].get_title().get_text() == AMD
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


@pytest.mark.parametrize("name", ["break_even_figure", "ttft_figure", "transfer_ratios", "memory_map"])
def test_nothing_to_draw_is_a_clear_error(name):
    import kvlab.plotting

    extra = {"break_even_figure": (32,), "transfer_ratios": (LLAMA.name, 1024), "memory_map": (miniature(LLAMA),)}
    with pytest.raises(ValueError, match="nothing to draw"):
        getattr(kvlab.plotting, name)([], *extra.get(name, ()))
