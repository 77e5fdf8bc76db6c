"""The old module paths of ``strategy/`` (before its three packages), served for one release.

``unicron_elastic.strategy.<module>`` of the flat layout is the *same* module object as its new
path (so an exception class imported by the old path is the one the engine raises); importing it
warns with a :class:`DeprecationWarning` naming the new path. Removed in 0.3.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

PREFIX = "unicron_elastic.strategy."
#: Old leaf -> new path under ``strategy/``. ``lightning`` and ``snapshots`` are packages now, which
#: export the public names of the old modules of those names.
MOVED: dict[str, str] = {
    "bootstrap": "engine.bootstrap", "effects": "engine.effects", "elastic_dp": "engine.elastic_dp",
    "engine_options": "engine.engine_options", "exchange": "engine.exchange", "gradients": "engine.gradients",
    "joining": "engine.joining", "membership": "engine.membership", "microbatch": "engine.microbatch",
    "pipeline": "engine.pipeline", "protocol": "engine.protocol", "replicas": "engine.replicas",
    "requests": "engine.requests", "stage_sums": "engine.stage_sums", "state_transfer": "engine.state_transfer",
    "tied": "engine.tied", "transport": "engine.transport", "watch": "engine.group_watch",
    "safe_state": "snapshots.safe_state", "snapshot_places": "snapshots.places", "snapshot_wire": "snapshots.wire",
    "snapshot_writer": "snapshots.writer", "shard_checkpoints": "snapshots.shard_checkpoints",
    "environment": "lightning.environment", "feed": "lightning.feed", "precision": "lightning.precision",
    "sigterm": "lightning.sigterm", "rng": "lightning.rng", "parallel": "lightning.parallel",
    "model_groups": "lightning.model_groups", "megatron_checks": "lightning.megatron_checks",
    "stages": "lightning.stages",
}


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module of its new path (imported now), with a deprecation warning."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        """The new path's module itself (its name and spec stay those of the new path)."""
        warnings.warn(f"{self.old} moved to {self.new}; the old path is removed in 0.3",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing: the module was executed under its new path."""


class OldPaths(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder for the old paths of :data:`MOVED` only."""

    def find_spec(self, fullname: str, path, target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        """An alias spec for an old path; None for any other name."""
        leaf = fullname.removeprefix(PREFIX)
        if leaf == fullname or leaf not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(fullname, PREFIX + MOVED[leaf]))


def install() -> None:
    """Put the finder first on ``sys.meta_path``; idempotent."""
    if not any(isinstance(finder, OldPaths) for finder in sys.meta_path):
        sys.meta_path.insert(0, OldPaths())
