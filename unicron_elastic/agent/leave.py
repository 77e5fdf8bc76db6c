"""``NodeLeave``: a node asked to leave its task (SIGUSR2: a SLURM drain, a plan without it), as its agent does it.

The workers leave the data-parallel group at a step boundary when every running one said it can; the pure
decision at each monitor interval is :func:`~unicron_elastic.agent.rank_state.leave_decision`.
"""

from __future__ import annotations

import os
import signal
import time

import structlog
from torch.distributed.elastic.multiprocessing import SignalException

from unicron_elastic.agent.lifecycle import Lifecycle
from unicron_elastic.agent.meeting_point import MeetingPoint
from unicron_elastic.agent.rank_state import HELLO_GRACE_S, LeaveDecision, RankState, leave_decision
from unicron_elastic.api import StoreError

log = structlog.get_logger(__name__)


class NodeLeave:
    """This node's leave from its task.

    Args:
        lifecycle: The agent's lifecycle: its departure becomes ``LEAVING`` once the workers are asked to leave.
    """

    def __init__(self, lifecycle: Lifecycle) -> None:
        self._lifecycle = lifecycle
        self._waiting_since: float | None = None

    def decide(self, meeting: bool, ranks: list[int], said: list[RankState]) -> LeaveDecision:
        """What the node does at this monitor interval (the caller holds the agent's lock).

        Args:
            meeting: The node has a meeting store (where leave requests go).
            ranks: The global ranks whose process runs.
            said: The records of those of them whose worker said ``hello``.

        Returns:
            The decision; on ``LEAVE`` the node counts as leaving from now on, so that a worker started
            for one of these ranks is asked to leave too.
        """
        waited = 0.0 if self._waiting_since is None else time.monotonic() - self._waiting_since
        decision = leave_decision(meeting, len(ranks), len(said), all(s.leavable for s in said), waited)
        if decision is LeaveDecision.LEAVE:
            self._lifecycle.leave()
        return decision

    def carry_out(self, decision: LeaveDecision, ranks: list[int], meeting: MeetingPoint | None) -> None:
        """Wait for the workers' hellos, stop the workers, or ask them to leave, as ``decision`` says.

        Called outside the agent's lock: the etcd requests may take a while, and exits and detections are
        handled meanwhile.

        Args:
            decision: What :meth:`decide` returned.
            ranks: The global ranks whose process runs.
            meeting: The round's meeting point (None: the node has no meeting store).

        Raises:
            SignalException: (as SIGTERM) The workers cannot leave at a step boundary, or their leave
                requests could not be written: they are stopped instead.
        """
        if decision is LeaveDecision.WAIT:
            if self._waiting_since is None:
                log.info("leave_deferred", ranks=ranks, reason="a worker has not said yet whether it can leave",
                         at_most_s=HELLO_GRACE_S)
                self._waiting_since = time.monotonic()
            return
        if decision is LeaveDecision.STOP or meeting is None:
            log.warning("leave_by_stopping", ranks=ranks,
                        reason="no meeting store" if meeting is None else "workers cannot leave at a step boundary "
                        f"(one said so, or none said within {HELLO_GRACE_S:g} s)")
            raise SignalException(f"Process {os.getpid()}: asked to leave; the workers cannot leave at a step "
                                  "boundary", sigval=signal.SIGTERM)
        try:
            meeting.ask_to_leave(ranks)
        except StoreError as exc:
            log.error("leave_by_stopping", ranks=ranks, reason=f"leave requests not written: {exc}"[:300])
            raise SignalException(f"Process {os.getpid()}: asked to leave; the requests could not be written",
                                  sigval=signal.SIGTERM) from None
        log.info("leaving_task", ranks=ranks)
