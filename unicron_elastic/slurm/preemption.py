"""A Lightning callback for preemption and walltime: a checkpoint of the step a stop ends at.

Under ``unicron_megatron`` a stop (SIGTERM to the workers: ``unicron-run``
stopping on SLURM's SIGUSR1 warning, on SIGTERM, or a ``scancel``) rides in a
step's last exchange, and every member ends ``fit`` after that same step
(docs/strategy.md). :class:`PreemptionCheckpoint` writes a Lightning
checkpoint at the end of that step (``trainer.save_checkpoint``: every member
takes part, one writes; written to a temporary name, then renamed), unless
training finished with that step. The job's batch script then requeues the
job (``unicron slurm requeue``, examples/slurm/train.sbatch); the requeued
job passes :attr:`PreemptionCheckpoint.resume_path` to ``fit(ckpt_path=...)``
and its first step is the one after the checkpoint::

    preempted = PreemptionCheckpoint("/shared/ckpt/preempted.ckpt")
    trainer = pl.Trainer(strategy="unicron_megatron", callbacks=[preempted], max_steps=...)
    trainer.fit(model, data, ckpt_path=preempted.resume_path)
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import structlog

log = structlog.get_logger(__name__)


def _replace(tmp: Path, path: Path) -> None:
    """Put the complete checkpoint ``tmp`` (a file, or a directory of shards) at ``path``."""
    if tmp.is_dir() and path.exists():
        old = path.with_name(path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)  # a file: atomic


class PreemptionCheckpoint(pl.Callback):
    """The step a stop ends at, on disk, for the run that resumes it.

    Args:
        path: Where the checkpoint goes (a file; with tensor x pipeline
            parallelism Lightning's checkpoint is a directory of shards). On a
            file system every node sees (the requeued job may run elsewhere).

    Attributes:
        saved_step: The first step still to train after the checkpoint this
            run wrote (None: none written).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.saved_step: int | None = None

    @property
    def resume_path(self) -> str | None:
        """The checkpoint of a previous run's stop, for ``fit(ckpt_path=...)`` (None: start afresh)."""
        return str(self.path) if self.path.exists() else None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.resume_path is not None and trainer.is_global_zero:
            log.info("resuming_from_preemption_checkpoint", path=str(self.path), step=trainer.global_step)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        """At the end of the step every member agreed to stop after: the checkpoint."""
        if not trainer.received_sigterm or self.saved_step is not None:
            return
        if trainer.max_steps >= 0 and trainer.global_step >= trainer.max_steps:
            log.info("stopped_after_training_finished", step=trainer.global_step)  # nothing left to requeue for
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        trainer.save_checkpoint(tmp)  # every member takes part; returns once it is written (a barrier)
        self.saved_step = trainer.global_step
        if not trainer.is_global_zero:
            return
        _replace(tmp, self.path)
        log.warning("preemption_checkpoint_saved", path=str(self.path), next_step=trainer.global_step)
