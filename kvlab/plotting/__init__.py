"""Figures, one module per notebook (atlas and segment_figures: 01, transfer and gpu_model: 02,
connector: 03 and 04, scaling: 04 and 05, accuracy: 06), the diagrams of the connector's
machinery (machinery: 01 and 03) plus what they share (common) and how they are saved
(saving); drawn from kvlab's data and committed results, never from a
notebook's private state, so every one regenerates with the same call."""

from kvlab.plotting.accuracy import accuracy_figure, comparison_figure
from kvlab.plotting.atlas import (
    COLOUR_BY,
    atlas,
    draw_memory_map,
    memory_map,
    miniature,
)
from kvlab.plotting.common import human_bytes
from kvlab.plotting.gpu_model import answer_markdown, citations, fit_markdown, layout_question_figure, published_figure
from kvlab.plotting.hybrid_maps import hybrid_map
from kvlab.plotting.machinery import prefix_hit_figure, step_calls_figure
from kvlab.plotting.saving import save_figure
from kvlab.plotting.connector import (
    deployed_figure,
    engine_layouts_figure,
    hooks_timeline,
    network_tier_figure,
    registration_figure,
    ttft_figure,
)
from kvlab.plotting.scaling import (
    concurrency_figure,
    costs_by_length_figure,
    lookup_scaling_figure,
    scale_prediction_figure,
)
from kvlab.plotting.segment_figures import segment_scaling, segments_by_layout
from kvlab.plotting.transfer import (
    bandwidth_vs_tokens,
    break_even_figure,
    cost_model_figure,
    hardware_figure,
    layerwise_figure,
    transfer_ratios,
)

__all__ = [
    "human_bytes", "save_figure", "COLOUR_BY", "miniature", "draw_memory_map", "memory_map", "hybrid_map", "segment_scaling",
    "segments_by_layout", "atlas", "transfer_ratios", "bandwidth_vs_tokens", "cost_model_figure",
    "break_even_figure", "layerwise_figure", "hardware_figure", "hooks_timeline", "ttft_figure",
    "registration_figure", "engine_layouts_figure", "deployed_figure", "network_tier_figure", "accuracy_figure", "comparison_figure",
    "costs_by_length_figure", "lookup_scaling_figure", "concurrency_figure", "scale_prediction_figure",
    "published_figure", "layout_question_figure", "citations", "fit_markdown", "answer_markdown",
    "prefix_hit_figure", "step_calls_figure",
]
