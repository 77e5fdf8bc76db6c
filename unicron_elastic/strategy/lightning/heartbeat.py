"""What the agent hears from a training rank: a heartbeat per optimizer step, and progress at the engine's points.

A heartbeat carries the step's duration (iteration to iteration, Lightning's
callbacks included) and its busy time: the duration less the time the
engine waited on its groups, which the straggler detector compares across a
node's ranks. The engine's points of a step (each micro-batch, each bucket,
around the optimizer step) are progress for the hang detector, and where a
fault planned in ``$UNICRON_FAULTS`` fires.
"""

from __future__ import annotations

import time
from typing import Any

from unicron_elastic.faults import maybe_fail

__all__ = ["Heartbeat"]


class Heartbeat:
    """This rank's heartbeats and progress points.

    Args:
        worker: This worker's end of the agent channel (:func:`~unicron_elastic.worker.get_worker`).
    """

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self._last: float | None = None
        #: The engine's waits (seconds) at the last heartbeat: busy time = duration - the waits since.
        self._waited = 0.0

    def start(self, waited: float) -> None:
        """(At the first step) start timing iterations; later calls do nothing.

        Args:
            waited: The engine's waits so far (seconds).
        """
        if self._last is None:
            self._last, self._waited = time.monotonic(), waited

    def beat(self, step: int, waited: float) -> None:
        """Send the heartbeat of ``step``, which just ended.

        Args:
            step: The step.
            waited: The engine's waits so far (seconds).
        """
        now = time.monotonic()
        duration = now - self._last
        self.worker.heartbeat(step, duration, busy=duration - (waited - self._waited))
        self._last, self._waited = now, waited

    def restart(self, waited: float | None) -> None:
        """Time the next iteration from now (after validation, which is not part of a step).

        Args:
            waited: The engine's waits so far (seconds); None: no engine.
        """
        self._last = time.monotonic()
        if waited is not None:
            self._waited = waited

    def point(self, rank: int, step: int, micro_batch: int | None = None, bucket: int | None = None,
              at: str | None = None) -> None:
        """One of the engine's points of a step: progress for the hang detector, then the fault planned there.

        Args:
            rank: This launch rank.
            step: The step.
            micro_batch: The micro-batch about to be computed, if any.
            bucket: The bucket about to be reduced, if any.
            at: A named point (``"before_optimizer_step"``, ``"after_optimizer_step"``, ...), if any.
        """
        self.worker.progress(step, micro_batch or 0)
        maybe_fail(rank, step, micro_batch=micro_batch, bucket=bucket, at=at, waiting=self.worker.waiting)
