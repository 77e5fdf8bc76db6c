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

from unicron_elastic._lazy import lazy_exports

_EXPORTS = {
    "UnicronMegatronStrategy": "megatron_strategy",
    "STRATEGY_NAME": "megatron_strategy",
    "UnicronEnvironment": "environment",
    "run_forward_step": "stages",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
