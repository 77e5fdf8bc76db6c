"""A package's names imported from their modules on first use (PEP 562's module ``__getattr__``).

So that importing a package (``unicron_elastic.rendezvous``, ``unicron_elastic.strategy.engine``, ...)
imports none of its heavier modules until one of its names is used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package``: each name of ``exports`` from its module (imported then).

    Args:
        package: The package's ``__name__``.
        exports: Each exported name -> the module under ``package`` that defines it.

    Returns:
        A function to assign to the package's ``__getattr__``; it raises AttributeError for another name.
    """

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)

    return __getattr__
