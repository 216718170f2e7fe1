"""Every connector test starts and ends with no connector state in this process (stores and
counters are per process, by store name: kvlab.connector.stores)."""

import pytest


@pytest.fixture(autouse=True)
def _fresh_stores():
    vllm = pytest.importorskip("vllm")  # noqa: F841 (kvlab.connector imports vLLM)
    from kvlab.connector import reset_stores

    reset_stores()
    yield
    reset_stores()
