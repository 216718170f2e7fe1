"""The notebook runner names the notebooks it knows."""

import pytest

from kvlab.runtime.notebooks import notebook_paths


def test_unknown_notebook():
    with pytest.raises(ValueError, match="no notebook"):
        notebook_paths(["99_nothing"])
