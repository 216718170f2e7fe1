"""One vocabulary for the ways a request's prefix KV can be had, which every experiment
compares: recompute, vLLM's own prefix-cache hit (the control), KVLabConnector whole-step
and layerwise, LMCache and vLLM's ExampleConnector.

Rows keep the display labels they were recorded with (committed results predate this
module, and some tables name a path with its store or phase, "KVLab whole-step, disk");
code classifies a row with :meth:`Reuse.of` and never compares display strings itself.
"""

from __future__ import annotations

from enum import Enum


class Reuse(Enum):
    """A way of having a prefix's KV: (label, engine connector). Figures colour each one
    the same everywhere (kvlab.plotting.common.PATH_COLOURS)."""

    RECOMPUTE = ("recompute", "none")
    VLLM_PREFIX_HIT = ("vLLM prefix-cache hit", "none")
    KVLAB_WHOLE_STEP = ("KVLab whole-step", "kvlab")
    KVLAB_LAYERWISE = ("KVLab layerwise", "kvlab")
    LMCACHE = ("LMCache", "lmcache")
    EXAMPLE_CONNECTOR = ("ExampleConnector", "example")

    def __init__(self, label: str, connector: str) -> None:
        self.label = label
        self.connector = connector

    @classmethod
    def of(cls, text: str) -> Reuse | None:
        """The path a recorded row's label names (its own label, the older names of the
        same path, or the label followed by a store or phase), else None."""
        for prefix, path in sorted(_NAMES.items(), key=lambda item: -len(item[0])):
            if text == prefix or text.startswith(prefix + ",") or text.startswith(prefix + " "):
                return path
        return None


# Older names of the same paths, as tables recorded them: the plain engine of the connector
# comparison, the floor of the TTFT table, KVLabConnector with its default (whole-step).
_NAMES = {path.label: path for path in Reuse} | {
    "no connector": Reuse.RECOMPUTE, "vLLM prefix hit": Reuse.VLLM_PREFIX_HIT, "KVLabConnector": Reuse.KVLAB_WHOLE_STEP,
}

