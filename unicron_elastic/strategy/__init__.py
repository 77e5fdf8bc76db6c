"""Partial-iteration resumption, replica state reload and reconfiguration (paper section 6).

Importing this package registers the Lightning strategy ``unicron_megatron``
(when Lightning is installed); the torch-level pieces need only torch.
"""

from __future__ import annotations

try:
    from unicron_elastic.strategy.lightning import STRATEGY_NAME, UnicronMegatronStrategy
except ImportError as _error:  # Lightning is not installed: the torch-level engine still works
    if "lightning" not in str(_error):
        raise

__all__ = ["STRATEGY_NAME", "UnicronMegatronStrategy"]
