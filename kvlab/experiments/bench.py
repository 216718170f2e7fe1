"""The benchmark harness, one import for the notebooks, the CLI and the tests: the transfer
sweep against the same-run copy ceiling (kvlab.experiments.sweep), the CPU targets judged
from its rows (kvlab.experiments.targets), and layerwise loading timed against
load-then-compute (kvlab.experiments.layerwise_timing), on the clock of
kvlab.experiments.timing. Each name lives in its own module; this one re-exports them.

Needs torch only (tqdm when present for progress bars: kvlab.runtime.progress).
"""

from __future__ import annotations

from kvlab.cache.devices import resolve_device
from kvlab.experiments.layerwise_timing import (
    attention_pipeline,
    overlap_timing,
    pipeline_timing,
    run_attention_sweep,
    run_pipeline_sweep,
)
from kvlab.experiments.sweep import (
    DIRECTIONS,
    MAX_SEGMENTS,
    NOISE_RATIO,
    PROFILES,
    Config,
    Setup,
    ceiling_copy,
    check_methods,
    check_profile,
    configs,
    format_rows,
    measure,
    ratio_spread,
    run_sweep,
)
from kvlab.experiments.targets import CPU_TARGETS, ceiling_targets, format_targets
from kvlab.experiments.timing import Clock, interleaved

__all__ = [
    "CPU_TARGETS", "DIRECTIONS", "MAX_SEGMENTS", "NOISE_RATIO", "PROFILES", "Clock", "Config", "Setup", "attention_pipeline",
    "ceiling_copy", "ceiling_targets", "check_methods", "check_profile", "configs", "format_rows", "format_targets",
    "interleaved", "measure", "overlap_timing", "pipeline_timing", "ratio_spread", "resolve_device",
    "run_attention_sweep", "run_pipeline_sweep", "run_sweep",
]
