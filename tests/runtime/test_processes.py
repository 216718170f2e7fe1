"""kvlab.runtime.processes: a failed child is summed up by the last line it printed."""

from kvlab.runtime.processes import failure_line


def test_failure_line_is_the_exception_a_failed_engine_raised() -> None:
    error = RuntimeError("engine none on /m failed (exit 1):\n[rank0]:   File \"x.py\", line 3\n"
                         "[rank0]: TypeError: 'function' object is not subscriptable\n\n")
    assert failure_line(error) == "TypeError: 'function' object is not subscriptable"
    assert failure_line(RuntimeError("")) == "RuntimeError"
