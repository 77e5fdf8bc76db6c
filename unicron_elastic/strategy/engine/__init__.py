"""The elastic data-parallel engine: no Lightning, no megatron-core.

- :mod:`.protocol` (the recovery protocol, sans I/O) and :mod:`.effects` (its vocabulary), executed by
  :mod:`.elastic_dp` (:class:`ElasticDataParallel`, built with :mod:`.engine_options`);
- the pure decisions: :mod:`.membership`, :mod:`.replicas` (TP x PP), :mod:`.microbatch`;
- a step's parts: :mod:`.exchange`, :mod:`.requests`, :mod:`.joining`, :mod:`.gradients`,
  :mod:`.pipeline`, :mod:`.stage_sums`, :mod:`.tied`, :mod:`.state_transfer`;
- its groups: :mod:`.transport`, :mod:`.group_watch`, :mod:`.bootstrap`.

Names are imported lazily.
"""

from __future__ import annotations

from unicron_elastic._lazy import lazy_exports

_EXPORTS = {
    "ElasticDataParallel": "elastic_dp",
    "EngineOptions": "engine_options",
    "EngineHooks": "engine_options",
    "Excluded": "effects",
    "Retired": "effects",
    "ReplicaBroken": "effects",
    "StepReport": "effects",
    "GlobalBatchPlan": "microbatch",
    "ModelParallel": "replicas",
    "Protocol": "protocol",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
