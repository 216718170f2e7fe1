"""How the notebooks show tables and numbers (kvlab.plotting.display): counts as integers,
long floats rounded, and wide tables whole in a box that scrolls."""

import math

import pandas as pd

from kvlab.plotting.display import MAX_COLUMNS, frame_html, readable_number, whole_columns


def test_a_column_of_counts_with_a_gap_prints_as_integers():
    frame = pd.DataFrame({"cached_tokens": [992.0, None], "ratio": [0.324003752557, 1.0], "name": ["a", "b"]})
    shown = whole_columns(frame)
    assert str(shown["cached_tokens"].dtype) == "Int64" and shown["ratio"].dtype == float
    assert "992.0" not in repr(shown) and "992" in repr(shown)
    assert "992.0" in repr(frame), "the planted defect: pandas alone prints the count as a float"


def test_numbers_read_as_a_reader_wants_them():
    assert [readable_number(x) for x in (992.0, 0.32400375255700203, 1.021465147683287, 12345.678, math.inf)] == [
        "992", "0.324", "1.021", "12345.7", "inf"]


def test_a_wide_table_scrolls_and_a_narrow_one_does_not():
    wide = pd.DataFrame([list(range(MAX_COLUMNS + 1))], columns=[f"c{i}" for i in range(MAX_COLUMNS + 1)])
    assert "overflow-x: auto" in frame_html(wide) and "c10" in frame_html(wide)
    assert "overflow-x" not in frame_html(wide.iloc[:, :MAX_COLUMNS])


def test_duplicate_column_names_are_left_alone():
    frame = pd.DataFrame([[1.0, 2.0]], columns=["a", "a"])
    assert whole_columns(frame) is frame
