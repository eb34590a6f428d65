"""Exports imported on first use (PEP 562), for packages whose modules import heavy or
optional dependencies.

In the package's ``__init__.py``::

    __all__ = ["EnergyCallback"]
    __getattr__ = lazy_exports(__name__, {"EnergyCallback": "lightning"})
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, modules: Mapping[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` that imports an exported name's module on first use.

    The value is then kept in the package's namespace, so later lookups are plain
    attribute reads.

    Args:
        package: the package's ``__name__``.
        modules: exported name -> the submodule (relative to ``package``) that defines it.

    Returns:
        The function to assign to the package's ``__getattr__``. It raises
        ``AttributeError`` for any other name, so ``from package import submodule`` still
        imports the submodule.
    """

    def __getattr__(name: str) -> Any:
        module = modules.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
