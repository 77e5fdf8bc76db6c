"""The Lightning strategy ``unicron_megatron`` and what it does around a megatron-core model.

- :mod:`.megatron_strategy`: :class:`UnicronMegatronStrategy` (its import registers the strategy);
- :mod:`.environment`: :class:`UnicronEnvironment`, the cluster environment whose world changes;
- :mod:`.feed`, :mod:`.precision`, :mod:`.sigterm`, :mod:`.rng`: the step's micro-batches, loss scaling,
  SIGTERM and random streams;
- :mod:`.parallel`, :mod:`.model_groups`, :mod:`.megatron_checks`, :mod:`.stages`: the world and
  megatron-core's groups, and what is checked and run of the user's model.

Names are imported lazily, so the torch-level modules import without Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "UnicronMegatronStrategy": "megatron_strategy",
    "STRATEGY_NAME": "megatron_strategy",
    "UnicronEnvironment": "environment",
    "run_forward_step": "stages",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """A name of :data:`_EXPORTS`, from its module (imported now).

    Raises:
        AttributeError: Another name.
    """
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
