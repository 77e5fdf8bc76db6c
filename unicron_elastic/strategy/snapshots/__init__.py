"""Where a job's state is kept besides its replicas: the safe format, in-memory snapshots, disk checkpoints.

- :mod:`.safe_state`: the state format (raw tensor bytes plus a JSON skeleton, never pickle);
- :mod:`.tiers`: :class:`MemorySnapshot` (on other nodes' agents) and :class:`DiskCheckpoints`;
- :mod:`.places`, :mod:`.wire`, :mod:`.writer`: where a snapshot goes, how it sits in a store, the
  process that sends it;
- :mod:`.shard_checkpoints`: Lightning checkpoints of a model with TP x PP > 1.

Names are imported lazily: the snapshot writer process imports :mod:`.writer` and nothing else.
"""

from __future__ import annotations

from unicron_elastic._lazy import lazy_exports

_EXPORTS = {
    "MemorySnapshot": "tiers",
    "DiskCheckpoints": "tiers",
    "dumps": "safe_state",
    "loads": "safe_state",
    "encode": "safe_state",
    "decode": "safe_state",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
