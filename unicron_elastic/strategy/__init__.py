"""Partial-iteration resumption, replica state reload and reconfiguration (paper section 6).

``UnicronMegatronStrategy`` (the Lightning strategy ``unicron_megatron``) is
imported from here on first use, so the torch-level pieces (and the snapshot
writer process) start without Lightning's import time. ``import
unicron_elastic`` registers the strategy with Lightning whatever the import
order (:mod:`unicron_elastic._lightning_hook`).

Three packages:

- :mod:`~unicron_elastic.strategy.engine`: the elastic data-parallel engine (no Lightning, no megatron-core);
- :mod:`~unicron_elastic.strategy.snapshots`: the state format, in-memory snapshots and disk checkpoints;
- :mod:`~unicron_elastic.strategy.lightning`: the Lightning strategy and what it does around a megatron-core model.
"""

from __future__ import annotations

from typing import Any

from unicron_elastic.strategy.lightning.stages import run_forward_step

__all__ = ["STRATEGY_NAME", "UnicronMegatronStrategy", "run_forward_step"]


def __getattr__(name: str) -> Any:
    """``STRATEGY_NAME`` and ``UnicronMegatronStrategy``, from the Lightning module (imported now).

    Raises:
        AttributeError: Another name.
    """
    if name in ("STRATEGY_NAME", "UnicronMegatronStrategy"):
        from unicron_elastic.strategy.lightning import megatron_strategy

        return getattr(megatron_strategy, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
