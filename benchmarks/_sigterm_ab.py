"""Run ``lightning_gpt.py`` with Lightning's per-batch SIGTERM broadcast back in every other block of steps.

``python _sigterm_ab.py SCRIPT ARGS...`` (``transition.py --sigterm-ab``): the
strategy replaces Lightning's ``_TrainingEpochLoop._broadcast_sigterm_tensor``
(the step's exchange carries SIGTERM); here steps ``s`` with ``(s // BLOCK) % 2
== 0`` run Lightning's broadcast again, the others do not, so one run measures
what the broadcast cost side by side, free of the noise between runs on a
shared machine. Every rank decides from the same ``global_step``, so the
broadcast stays matched. Benchmark-only: it patches classes, which production
code never does.
"""

from __future__ import annotations

import runpy
import sys
from typing import Any

from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

from unicron_elastic.strategy.lightning import UnicronMegatronStrategy

#: Steps per block; blocks with and without Lightning's broadcast alternate.
BLOCK = 5


def with_broadcast(step: int) -> bool:
    """Whether step ``step`` runs Lightning's broadcast (``transition.py`` classifies steps with this)."""
    return (step // BLOCK) % 2 == 0


def _alternate() -> None:
    lightning_broadcast = _TrainingEpochLoop._broadcast_sigterm_tensor
    take_over = UnicronMegatronStrategy._take_over_sigterm

    def patched(strategy: UnicronMegatronStrategy, trainer: Any) -> None:
        take_over(strategy, trainer)
        loop = trainer.fit_loop.epoch_loop
        loop._broadcast_sigterm_tensor = (
            lambda: lightning_broadcast(loop) if with_broadcast(trainer.global_step) else None)

    UnicronMegatronStrategy._take_over_sigterm = patched


def main() -> None:
    script, sys.argv = sys.argv[1], sys.argv[1:]
    _alternate()
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
