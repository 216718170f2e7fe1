"""LMCache's server mode without starting a server: importing loads neither vLLM nor
LMCache, configs bind the server's dtype, bad chunk sizes and ports, LMCacheConnectorV1's
config refused without CUDA, a missing command and a taken port fail before starting."""

from __future__ import annotations

import importlib.resources
import importlib.util
import socket
import subprocess
import sys

import pytest

if importlib.util.find_spec("lmcache") is None:
    pytest.skip("lmcache is not installed", allow_module_level=True)

from kvlab.runtime.configs import kv_transfer_config
from kvlab.runtime.lmcache import LMCacheError, LMCacheServer, v1_config  # noqa: E402


# ---- nothing started ------------------------------------------------------------------------
def test_import_loads_neither_vllm_nor_lmcache():
    code = "import sys, kvlab.runtime.lmcache; print(sorted({'vllm', 'lmcache'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_configs_bind_the_servers_dtype():
    server = LMCacheServer(port=5555)  # not started: a port given is all a config needs
    transfer = server.kv_transfer_config("model-a", "fp32")
    assert transfer == {
        "kv_connector": "LMCacheMPConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 5555,
                                      "lmcache.mp.mq_timeout": 10.0}}
    assert server.engine_extra("model-b", "float32") == {"port": 5555}
    assert (server.dtype, server.models) == ("float32", ["model-a", "model-b"])
    with pytest.raises(LMCacheError, match="One server per dtype"):
        server.engine_extra("model-a", "bfloat16")
    assert server.dtype == "float32"


def test_bad_chunk_sizes_and_a_missing_port():
    with pytest.raises(ValueError, match="chunk_size"):
        LMCacheServer(chunk_size=0)
    with pytest.raises(LMCacheError, match="not a multiple of the engine's block size 32"):
        LMCacheServer(chunk_size=48, port=5555).engine_extra("m", "bf16")
    with pytest.raises(LMCacheError, match="start the lmcache server first"):
        LMCacheServer().engine_extra("m", "bf16")
    with pytest.raises(ValueError, match="needs the LMCache server's port"):
        kv_transfer_config("lmcache", {})
    assert kv_transfer_config("lmcache", {"port": 1, "mq_timeout": 2})["kv_connector_extra_config"] == {
        "lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 1, "lmcache.mp.mq_timeout": 2}


def test_v1_config_is_refused_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    with pytest.raises(LMCacheError, match="needs CUDA.*zero hits.*server mode"):
        v1_config()


def test_v1_config_shape(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert v1_config() == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"lmcache.chunk_size": 256, "lmcache.use_layerwise": False}}
    extra = v1_config(64, layerwise=True, cross_layers=True, max_local_cpu_size=2)["kv_connector_extra_config"]
    assert extra == {"lmcache.chunk_size": 64, "lmcache.use_layerwise": True, "lmcache.max_local_cpu_size": 2,
                     "enable_cross_layers_blocks": True}


def test_missing_command_fails_before_starting(tmp_path, monkeypatch):
    server = LMCacheServer(executable=tmp_path / "lmcache")
    with pytest.raises(LMCacheError, match="no lmcache command at"):
        server.start()
    assert server.process is None
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LMCacheError, match="nor on PATH"):
        LMCacheServer().start()


@pytest.mark.parametrize("which", ["port", "http_port"])
def test_taken_port_fails_before_starting(which):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = LMCacheServer(**{which: taken.getsockname()[1]})
        with pytest.raises(LMCacheError, match="is taken"):
            server.start()
    assert server.process is None


# ---- engines on a server --------------------------------------------------------------------
def hits(result: dict, phase: str) -> list[int]:
    return [row["cached_tokens"] for row in result["phases"][phase]]
