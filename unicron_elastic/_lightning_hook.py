"""Register the ``unicron_megatron`` Lightning strategy whatever the import order.

Lightning resolves ``Trainer(strategy="unicron_megatron")`` in its
``StrategyRegistry``, filled when ``lightning.pytorch`` is imported; it has no
entry-point group for strategies. Importing Lightning from
``import unicron_elastic`` would make every agent and CLI process pay its
import time (~2 s), so instead:

- Lightning already imported: the strategy module is imported now (it
  registers itself);
- else a finder on ``sys.meta_path`` waits for ``lightning.pytorch`` and, once
  that package has *finished* executing (its registry is complete and its
  submodules importable), imports the strategy module. The finder then removes
  itself. The package's own loader is kept (only its ``exec_module`` is wrapped
  on that one loader instance), so nothing else about the import changes.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

#: The package after whose import the strategy registers.
TARGET = "lightning.pytorch"
#: The module whose import registers the strategy.
STRATEGY_MODULE = "unicron_elastic.strategy.lightning.megatron_strategy"


def _register() -> None:
    """Import the strategy module (it registers ``unicron_megatron``); a failure is a warning, not a crash.

    A broken optional dependency (e.g. megatron-core) must not break ``import lightning``: the
    warning says why ``Trainer(strategy="unicron_megatron")`` will then be refused.
    """
    try:
        __import__(STRATEGY_MODULE)
    except Exception as exc:  # noqa: BLE001 - reported, and Lightning's import goes on
        if _importing_ours():  # it imported Lightning at its top: it calls install() again at its end
            return
        warnings.warn(f"unicron_elastic: the 'unicron_megatron' strategy was not registered: "
                      f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2)


def _importing_ours() -> bool:
    """Whether a module of this package is being imported right now (its body has not finished).

    Importing one of the strategy's modules that imports Lightning at its top
    (``strategy/lightning/environment.py``) imports Lightning from inside it; the strategy
    module, which needs that module's names, cannot be imported until its body
    ends. That module calls :func:`install` as its last statement.
    """
    return any(getattr(getattr(module, "__spec__", None), "_initializing", False)
               for name, module in list(sys.modules.items()) if name.startswith("unicron_elastic."))


class RegisterAfterLightning(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder that registers the strategy right after ``lightning.pytorch`` is imported."""

    def find_spec(self, fullname: str, path, target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        """Find ``lightning.pytorch`` with the other finders and wrap its loader's ``exec_module``; None otherwise."""
        if fullname != TARGET:
            return None
        self.remove()
        spec = None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if find is not None and (spec := find(fullname, path, target)) is not None:
                break
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original(module)
            _register()

        loader.exec_module = exec_module  # this loader instance only: its type and other methods stay
        return spec

    def remove(self) -> None:
        """Take this finder off ``sys.meta_path`` (it fires once)."""
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


def install() -> None:
    """Register now if Lightning is imported, else once it is; idempotent."""
    if TARGET in sys.modules:
        _register()
        return
    if not any(isinstance(f, RegisterAfterLightning) for f in sys.meta_path):
        sys.meta_path.insert(0, RegisterAfterLightning())
