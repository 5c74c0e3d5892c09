"""Names a package exports but imports only when first used (PEP 562 module ``__getattr__``), so importing the
package stays light: ``mesh`` for the SDK on a device, ``topology`` for an agent that never parses YAML."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, lazy: Mapping[str, str], namespace: dict[str, Any]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``lazy`` maps each exported name to the module defining it;
    a name is imported on first access and then kept in ``namespace`` (the package's ``globals()``)."""

    def getattr_(name: str) -> Any:
        module = lazy.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *lazy})

    return getattr_, dir_
