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
and its first step is the one after the checkpoint. The checkpoint records the
SLURM job that wrote it (an array task as ``<array job>_<task>``, each task
being a job of its own) and the run; only that job resumes it (a requeued job
keeps its id): another job or array task given it is refused with
:class:`~unicron_elastic.slurm.api.ForeignCheckpoint`, as is a file at the
path that records no job::

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
from typing_extensions import override

from unicron_elastic.slurm.api import ForeignCheckpoint, job_of_environment

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
            One path per job: an array's tasks each need their own.
        job: The job that owns the checkpoint (default: this process's SLURM
            job, :func:`~unicron_elastic.slurm.api.job_of_environment`; None
            outside SLURM).

    Attributes:
        saved_step: The first step still to train after the checkpoint this
            run wrote (None: none written).
    """

    def __init__(self, path: str | os.PathLike[str], job: str | None = None) -> None:
        self.path = Path(path)
        self.job = job if job is not None else job_of_environment(os.environ)
        self.saved_step: int | None = None

    @override
    def state_dict(self) -> dict[str, Any]:
        """What the checkpoint records of its writer: the job (which alone may resume it) and the run."""
        return {"job": self.job, "run": os.environ.get("TORCHELASTIC_RUN_ID")}

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        """Resume from this callback's file only the checkpoint this job wrote.

        Only a resume from :attr:`path` (``fit(ckpt_path=...)``) is checked:
        the state a rank that rejoins takes from a healthy replica is the
        run's own (a node that comes back may be another SLURM job).

        Raises:
            ForeignCheckpoint: The file was written by another job or array
                task, or records no job (it cannot be told to be ours).
        """
        resumed = getattr(trainer, "ckpt_path", None)
        if resumed is None or Path(resumed).resolve() != self.path.resolve():
            return
        writer = checkpoint.get("callbacks", {}).get(self.state_key)
        if writer is None:
            raise ForeignCheckpoint(f"the checkpoint {self.path} records no job that wrote it (not written by "
                                    "PreemptionCheckpoint): refusing to resume it as this job's")
        if writer.get("job") != self.job:
            raise ForeignCheckpoint(
                f"the checkpoint {self.path} was written by SLURM job {writer.get('job')} (run {writer.get('run')}), "
                f"not by this job {self.job}: only the job that wrote a preemption checkpoint resumes it (give "
                "each job and array task its own path, e.g. %A_%a)")

    @property
    def resume_path(self) -> str | None:
        """The checkpoint of a previous run's stop, for ``fit(ckpt_path=...)`` (None: start afresh)."""
        return str(self.path) if self.path.exists() else None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.resume_path is not None and trainer.is_global_zero:
            log.info("resuming_from_preemption_checkpoint", path=str(self.path), step=trainer.global_step)

    @override
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
