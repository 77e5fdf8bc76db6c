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
* ``fresh-buffer``: a reduce buffer (and its per-parameter views) allocated
  afresh each step, instead of the one the engine keeps between steps.
* ``nan-check``: each rank's check of its own gradient sums for NaN and Inf
  before the step's last exchange (on without a loss scaler; without: skipped).

Benchmark-only: it patches classes, which production code never does.
"""

from __future__ import annotations

import runpy
import sys
from typing import Any, Callable

# (Lightning and the strategy are imported by the part that patches them: transition.py reads PARTS cheaply)

#: Steps per block; blocks with and without the part alternate.
BLOCK = 5


def with_part(step: int) -> bool:
    """Whether step ``step`` runs with the part (``transition.py`` classifies steps with this)."""
    return (step // BLOCK) % 2 == 0


def _sigterm() -> None:
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    from unicron_elastic.strategy.lightning.sigterm import SigtermTakeover

    lightning_broadcast = _TrainingEpochLoop._broadcast_sigterm_tensor
    take_over = SigtermTakeover.take_over

    def patched(sigterm: Any, trainer: Any) -> None:
        take_over(sigterm, trainer)
        loop = trainer.fit_loop.epoch_loop
        loop._broadcast_sigterm_tensor = (
            lambda: lightning_broadcast(loop) if with_part(trainer.global_step) else None)

    SigtermTakeover.take_over = patched


def _log() -> None:
    import lightning.pytorch as pl

    log = pl.LightningModule.log

    def patched(module: Any, *args: Any, **kwargs: Any) -> None:
        if with_part(module.trainer.global_step):
            log(module, *args, **kwargs)

    pl.LightningModule.log = patched


def _commit() -> None:
    from unicron_elastic.strategy.engine.reduction import StepReduction

    reduce = StepReduction.reduce

    def patched(reduction: Any, effect: Any) -> Any:
        last = reduction.committed and effect.bucket == len(reduction.gradients.bounds)
        if last and not with_part(reduction.protocol.next_step):
            return effect.local.new_zeros(0), list(reduction.protocol.members)
        return reduce(reduction, effect)

    StepReduction.reduce = patched


def _fresh_buffer() -> None:
    from unicron_elastic.strategy.engine.reduction import StepReduction

    reduce = StepReduction.reduce

    def patched(reduction: Any, effect: Any) -> Any:
        if effect.bucket == 0 and with_part(reduction.protocol.next_step):
            reduction.gradients.reduced = None  # (the next reduce_buffer allocates a new one and its views)
        return reduce(reduction, effect)

    StepReduction.reduce = patched


def _nan_check() -> None:
    from unicron_elastic.strategy.engine.reduction import StepReduction

    check = StepReduction._finds_non_finite

    def patched(reduction: Any, step: int, local: Any) -> bool:
        return check(reduction, step, local) if with_part(step) else False

    StepReduction._finds_non_finite = patched


#: Part -> (what it is, the patch that makes it alternate).
PARTS: dict[str, tuple[str, Callable[[], None]]] = {
    "sigterm": ("Lightning's SIGTERM broadcast before each batch, which the strategy replaces", _sigterm),
    "log": ("the module's self.log calls", _log),
    "commit": ("the step's commit over every rank", _commit),
    "fresh-buffer": ("a reduce buffer allocated afresh each step (the engine keeps one)", _fresh_buffer),
    "nan-check": ("each rank's NaN/Inf check of its gradient sums (no loss scaler)", _nan_check),
}


def main() -> None:
    part, script, sys.argv = sys.argv[1], sys.argv[2], sys.argv[2:]
    PARTS[part][1]()
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
