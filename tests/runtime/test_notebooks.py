"""The notebook runner names the notebooks it knows."""

import pytest

from kvlab.runtime.notebooks import notebook_paths


def test_unknown_notebook():
    with pytest.raises(ValueError, match="no notebook"):
        notebook_paths(["99_nothing"])


def test_last_duration_only_from_a_run_of_the_same_kind(tmp_path):
    """The per-notebook estimate comes from the last run made the same way, else none."""
    import json

    from kvlab.runtime.notebooks import last_duration

    executed = tmp_path / "02.ipynb"
    assert last_duration(executed, quick=False, measure=True) is None  # never ran
    executed.write_text(json.dumps({"metadata": {"papermill": {"duration": 90.0,
                                                                "parameters": {"quick": False, "measure": True}}}}))
    assert last_duration(executed, quick=False, measure=True) == 90.0
    assert last_duration(executed, quick=True, measure=True) is None
    assert last_duration(executed, quick=False, measure=False) is None
    executed.write_text("not json")
    assert last_duration(executed, quick=False, measure=True) is None
