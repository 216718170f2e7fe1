"""The house: no module of kvlab imports itself through others, the subpackages import only
those before them, the lazy public API resolves every name it lists, and a copy method is
one registration away from the engine, the bench and the figures."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvlab

PACKAGE = Path(kvlab.__file__).parent
# Dependency order: each may import only itself and those before it.
ORDER = ["cache", "transfer", "store", "hooks", "connector", "runtime", "harness", "results", "experiments", "plotting", "cli"]


def imports() -> dict[str, set[str]]:
    """Every kvlab module and the kvlab modules it imports anywhere (lazy imports too)."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("kvlab"):
                deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("kvlab"))
        graph[name] = deps
    return graph


def test_no_import_cycle():
    graph = imports()

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), list(graph.get(start, ()))
        while todo:
            module = todo.pop()
            if module == goal:
                return True
            if module not in seen:
                seen.add(module)
                todo += graph.get(module, ())
        return False

    assert [m for m in graph if reaches(m, m)] == []


def test_subpackages_import_only_those_before_them():
    def rank(module: str) -> int | None:
        part = module.split(".")[1] if module.count(".") else None
        return ORDER.index(part) if part in ORDER else None

    wrong = [(module, dep) for module, deps in imports().items() for dep in deps
             if rank(module) is not None and rank(dep) is not None and rank(dep) > rank(module)]
    assert wrong == []


def test_lazy_public_api():
    for name in kvlab.__all__:
        assert getattr(kvlab, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        kvlab.nothing  # noqa: B018


def test_lazy_connector_api():
    """kvlab.connector loads each name's module on first use (its worker side needs torch
    alone); vLLM finds KVLabConnector by getattr, as every other name."""
    import kvlab.connector

    for name in kvlab.connector.__all__:
        assert getattr(kvlab.connector, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        kvlab.connector.nothing  # noqa: B018


def test_import_kvlab_loads_no_engine():
    code = ("import sys, kvlab; kvlab.Transfer; kvlab.KVStore; kvlab.TinyAttentionStack;"
            "bad = [m for m in ('vllm', 'lmcache', 'transformers', 'matplotlib') if m in sys.modules];"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_registered_method_is_everywhere():
    """One registration: the engine runs it, the status, the bench and the figures know it."""
    from kvlab.experiments import bench
    from kvlab.transfer import (
        ALL_METHODS,
        METHODS,
        CopyMethod,
        Transfer,
        host_buffer,
        method_colours,
        register,
        unregister,
    )
    from kvlab.transfer.methods.segments import copy_segments

    calls = []

    def counted(t):
        calls.append(t.plan.segments)
        copy_segments(t)

    register(CopyMethod("counted", counted, colour="#000000", rank=11))  # segments is 10, memcpy 15
    try:
        assert list(METHODS)[:3] == ["segments", "counted", "memcpy"] and "counted" in ALL_METHODS
        assert method_colours()["counted"] == "#000000"
        cache = kvlab.allocate("BLHNC", kvlab.preset("smollm2-135m", block_size=16), 8, fill="arange")
        buffer = host_buffer(cache, 2)
        Transfer(cache, [3, 5], buffer, method="counted").run()
        assert calls == [2] and torch.equal(buffer.storage[0][1], cache.storage[0][5])
        full = bench.configs({**bench.PROFILES["quick"], "methods": ALL_METHODS})
        assert "counted" in {c.method for c in full}
        with pytest.raises(ValueError, match="registered already"):
            register(CopyMethod("counted", counted, colour="#000000"))
    finally:
        unregister("counted")
    assert "counted" not in METHODS
    with pytest.raises(ValueError, match="unknown method 'counted'"):
        Transfer(cache, [3], buffer, method="counted")
