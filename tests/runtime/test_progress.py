"""Progress bars show where someone watches and hide in a notebook run headless."""

import os

from kvlab.runtime.progress import HIDDEN, headless_progress, progress


def test_bars_hide_inside_headless_progress_and_come_back_after(monkeypatch):
    monkeypatch.delenv(HIDDEN, raising=False)
    items = [1, 2, 3]
    shown = progress(items, "sweep", leave=False)
    assert shown is not items and list(shown) == items  # a tqdm bar over the items
    with headless_progress():
        assert os.environ[HIDDEN] == "1"  # what the kernel papermill starts inherits
        assert progress(items, "sweep") is items
    assert HIDDEN not in os.environ


def test_headless_progress_keeps_an_outer_setting(monkeypatch):
    monkeypatch.setenv(HIDDEN, "0")
    with headless_progress():
        assert os.environ[HIDDEN] == "1"
    assert os.environ[HIDDEN] == "0"
