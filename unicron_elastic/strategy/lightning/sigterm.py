"""SIGTERM under ``unicron_megatron``: carried in the step's last exchange instead of Lightning's own collectives.

Lightning 2.6 broadcasts a SIGTERM flag from rank 0 over the default group
before every batch (``_TrainingEpochLoop._broadcast_sigterm_tensor``: a
barrier of every rank, ~5 ms of a 220 ms TP=2 x DP=2 step on 2 cores), and
its signal handler broadcasts once more from inside the handler. Here the
handler only marks this rank; the engine sums the mark in the step's last
exchange, and every member stops after that step. This replaces two private
members of Lightning (``_SignalConnector._sigterm_notifier_fn`` and
``_TrainingEpochLoop._broadcast_sigterm_tensor``); a Lightning without them
keeps its own way, with a warning.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import structlog

log = structlog.get_logger(__name__)


class Stoppable(Protocol):
    """What the takeover uses of the strategy (:class:`~unicron_elastic.strategy.lightning.megatron_strategy.UnicronMegatronStrategy`)."""

    engine: Any  # the elastic engine (None before setup_distributed)
    env: Any  # its cluster environment (``launch_rank``)
    role: Any  # its rank's role (``role.local``: Lightning's collectives stay on this rank, no step to agree in)

    @property
    def lightning_module(self) -> Any:
        """The module being trained (None before the Trainer attached it)."""

    @property
    def worker(self) -> Any:
        """The worker's end of the agent channel."""


def _no_broadcast() -> None:
    """In place of Lightning's SIGTERM broadcast before each batch: the step's exchange carries SIGTERM."""


class SigtermTakeover:
    """The SIGTERM handling of one strategy's ``fit``.

    Args:
        strategy: The strategy whose engine carries the stop.

    Attributes:
        stopping: The members agreed to stop after the current step.
    """

    def __init__(self, strategy: Stoppable) -> None:
        self.strategy = strategy
        self.stopping = False

    def take_over(self, trainer: Any) -> None:
        """Replace Lightning's SIGTERM handler and per-batch broadcast (fit only; Lightning registers the handler
        after ``setup``, so it registers ours)."""
        connector = getattr(trainer, "_signal_connector", None)
        epoch_loop = trainer.fit_loop.epoch_loop
        if not (hasattr(connector, "_sigterm_notifier_fn") and hasattr(epoch_loop, "_broadcast_sigterm_tensor")):
            log.warning("lightning_sigterm_kept", reason="Lightning has no _SignalConnector._sigterm_notifier_fn or "
                        "_TrainingEpochLoop._broadcast_sigterm_tensor: its SIGTERM broadcast runs before every batch")
            return
        self.stopping = False
        connector._sigterm_notifier_fn = self.on_sigterm
        epoch_loop._broadcast_sigterm_tensor = _no_broadcast

    def on_sigterm(self, signum: int, frame: Any) -> None:
        """SIGTERM: every member stops after the step the engine's exchange agrees on.

        Outside a training step (validation, a joiner not admitted yet, a
        retired rank) there is no step to agree in: this rank stops at
        Lightning's next check, as Lightning does. Only flags are set and one
        line is written to stderr (no logger: see the body).
        """
        strategy = self.strategy
        module = strategy.lightning_module
        trainer = module.trainer if module is not None else None
        engine = strategy.engine
        if engine is not None:
            engine.request_stop()
        if trainer is not None and (engine is None or strategy.role.local or not trainer.training):
            trainer._signal_connector.received_sigterm = True
        # No logger here: structlog's (and print's) locks are not reentrant, and the main thread
        # may be inside one when the signal is handled. A raw write of one line takes no lock.
        try:
            os.write(2, f"unicron_megatron: sigterm_received rank={strategy.env.launch_rank} signal={signum}: "
                        "every rank stops after the step whose exchange carries it\n".encode())
        except OSError:
            pass

    def stop_if_agreed(self, step: int) -> None:
        """A member asked to stop (its SIGTERM, in this step's exchange): Lightning ends ``fit`` after this step.

        The rest of the step and the teardown are declared to the agent as a
        pause (as at the end of training): they are not a hang.
        """
        strategy = self.strategy
        if not strategy.engine.reduction.stop_agreed or self.stopping:
            return
        self.stopping = True
        log.info("stopping_on_sigterm", rank=strategy.env.launch_rank, step=step)
        strategy.worker.set_paused(True)
        strategy.engine.stopping(step)
        # Lightning raises SIGTERMException at the end of this batch
        strategy.lightning_module.trainer._signal_connector.received_sigterm = True
