"""Lazy package attributes (PEP 562), so that importing a subpackage does not import SB3, triton or procgen."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, namespace: dict[str, Any], exports: dict[str, str]) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package`` whose ``exports`` map public names to submodules."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", package), name)
        namespace[name] = value  # cache: later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(namespace.get("__all__", ())))

    return __getattr__, __dir__
