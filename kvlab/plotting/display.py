"""How the notebooks show tables and numbers: a count as an integer (a column of counts with
a missing value is still counts), a long float to four significant digits, and a table wider
than ``MAX_COLUMNS`` whole, scrolling sideways, never cut."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

MAX_COLUMNS = 10  # a wider table scrolls sideways
SCROLLING = '<div class="kvlab-wide-table" style="overflow-x: auto; max-width: 100%;">{}</div>'


def readable_number(value: float) -> str:
    """A float as a reader wants it: a whole number without ``.0``, else four significant digits."""
    if not math.isfinite(value):
        return repr(value)
    if value == int(value) and abs(value) < 1e15:
        return f"{int(value)}"
    return f"{value:.1f}" if abs(value) >= 1e4 else f"{value:.4g}"


def whole_columns(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with every float column whose values are all whole numbers (or missing) as integers."""
    if not frame.columns.is_unique:
        return frame
    whole = [column for column, kind in frame.dtypes.items() if pd.api.types.is_float_dtype(kind)
             and frame[column].notna().any()
             and all(float(v).is_integer() and abs(v) < 2**53 for v in frame[column].dropna())]
    return frame.astype({column: "Int64" for column in whole}) if whole else frame


def frame_html(frame: pd.DataFrame) -> str | None:
    """A table's HTML with its counts as integers, in a box that scrolls sideways when it is wide."""
    html = whole_columns(frame)._repr_html_()
    return SCROLLING.format(html) if html and len(frame.columns) > MAX_COLUMNS else html


def _pretty_float(value: float, printer: Any, cycle: bool) -> None:
    printer.text(readable_number(value))


def _pretty_frame(frame: pd.DataFrame, printer: Any, cycle: bool) -> None:
    printer.text(repr(whole_columns(frame)))


def readable_outputs() -> None:
    """In a notebook: show every table and number this way from now on (pandas shows every
    column, the box scrolls); elsewhere nothing changes."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None:
        return
    pd.set_option("display.max_columns", None)
    formatters = shell.display_formatter.formatters
    formatters["text/html"].for_type(pd.DataFrame, frame_html)
    formatters["text/plain"].for_type(pd.DataFrame, _pretty_frame)
    formatters["text/plain"].for_type(float, _pretty_float)

