"""Names a package loads from their modules on first use: ``import kvlab`` stays cheap, and
``kvlab.connector``'s worker side imports without vLLM."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_names(package: str, where: dict[str, str], namespace: dict[str, Any]) -> tuple[Callable, Callable]:
    """A package's ``__getattr__`` and ``__dir__`` for ``where`` (name -> module); a loaded
    name is kept in the package's ``namespace``."""
    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(where))

    return __getattr__, __dir__
