"""One vocabulary for the paths compared: every label a committed results file holds names
one path (kvlab.plotting.common colours each path the same in every figure)."""

import json

import pytest

from kvlab.experiments.paths import Reuse
from kvlab.results import committed_results_dir

RESULTS = committed_results_dir()


def recorded_labels() -> set[str]:
    labels = set()
    for stem, key in (("03_ttft", "scenario"), ("04_accuracy", "path"), ("04_connectors", "connector")):
        for path in RESULTS.glob(f"{stem}-*.jsonl"):
            for line in path.read_text().splitlines():
                row = json.loads(line)
                if row.get("record") != "run" and key in row:
                    labels.add(row[key])
    return labels


def test_every_recorded_label_names_a_path():
    labels = recorded_labels()
    assert labels, "the committed results hold labelled rows"
    assert {label: Reuse.of(label) for label in labels if Reuse.of(label) is None} == {}


@pytest.mark.parametrize("label, path", [
    ("recompute", Reuse.RECOMPUTE), ("no connector", Reuse.RECOMPUTE),
    ("vLLM prefix hit", Reuse.VLLM_PREFIX_HIT), ("vLLM prefix-cache hit", Reuse.VLLM_PREFIX_HIT),
    ("KVLab whole-step, disk, new process", Reuse.KVLAB_WHOLE_STEP), ("KVLabConnector", Reuse.KVLAB_WHOLE_STEP),
    ("KVLab layerwise, memory", Reuse.KVLAB_LAYERWISE), ("LMCache", Reuse.LMCACHE),
    ("ExampleConnector", Reuse.EXAMPLE_CONNECTOR), ("something else", None),
])
def test_labels_name_their_path(label, path):
    assert Reuse.of(label) is path

