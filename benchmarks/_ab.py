"""Run ``lightning_gpt.py`` with one part of the step on in every other block of steps (``transition.py --ab``).

``python _ab.py PART SCRIPT ARGS...``: steps ``s`` with ``(s // BLOCK) % 2 == 0``
run with PART, the others without it, so one run measures what PART costs
side by side, free of the noise between runs on a shared machine. Every rank
decides from the same step, so collectives stay matched. The parts:

* ``sigterm``: Lightning's per-batch SIGTERM broadcast, which the strategy
  replaces (the step's exchange carries SIGTERM): put back in.
* ``log``: the LightningModule's ``self.log`` calls (a no-op without).
* ``commit``: the step's commit over every rank with TP/PP (without: skipped,
  each rank keeps its members; sound in a failure-free run without resizes
  only).

Benchmark-only: it patches classes, which production code never does.
"""

from __future__ import annotations

import runpy
import sys
from typing import Any, Callable

import lightning.pytorch as pl
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

from unicron_elastic.strategy.elastic_dp import ElasticDataParallel
from unicron_elastic.strategy.lightning import UnicronMegatronStrategy

#: Steps per block; blocks with and without the part alternate.
BLOCK = 5


def with_part(step: int) -> bool:
    """Whether step ``step`` runs with the part (``transition.py`` classifies steps with this)."""
    return (step // BLOCK) % 2 == 0


def _sigterm() -> None:
    lightning_broadcast = _TrainingEpochLoop._broadcast_sigterm_tensor
    take_over = UnicronMegatronStrategy._take_over_sigterm

    def patched(strategy: UnicronMegatronStrategy, trainer: Any) -> None:
        take_over(strategy, trainer)
        loop = trainer.fit_loop.epoch_loop
        loop._broadcast_sigterm_tensor = (
            lambda: lightning_broadcast(loop) if with_part(trainer.global_step) else None)

    UnicronMegatronStrategy._take_over_sigterm = patched


def _log() -> None:
    log = pl.LightningModule.log

    def patched(module: pl.LightningModule, *args: Any, **kwargs: Any) -> None:
        if with_part(module.trainer.global_step):
            log(module, *args, **kwargs)

    pl.LightningModule.log = patched


def _commit() -> None:
    reduce = ElasticDataParallel._reduce

    def patched(engine: ElasticDataParallel, effect: Any) -> Any:
        if engine.committed and effect.bucket == len(engine.bounds) and not with_part(engine.next_step):
            return effect.local.new_zeros(0), list(engine.protocol.members)
        return reduce(engine, effect)

    ElasticDataParallel._reduce = patched


PARTS: dict[str, Callable[[], None]] = {"sigterm": _sigterm, "log": _log, "commit": _commit}


def main() -> None:
    part, script, sys.argv = sys.argv[1], sys.argv[2], sys.argv[2:]
    PARTS[part]()
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
