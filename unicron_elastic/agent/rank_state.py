"""The agent's record of one rank: its ladder history and what is pending for its worker (no I/O); what a node
asked to leave does.

The agent keeps one :class:`RankState` per global rank (under its lock): what
the worker said in its ``hello``, what the ladder has seen of the rank, and
what the agent must do when the worker's process exits.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from unicron_elastic.agent.ladder import RankHistory, Rung
from unicron_elastic.events import Classification


@dataclass
class RankState:
    """What the agent knows of one rank.

    Attributes:
        history: The ladder's state of the rank.
        reply: The worker's reply address (its ``hello``; empty until then and
            after a respawn).
        leavable: The worker can leave at a step boundary (its ``hello``).
        fatal: The classification of a fatal exception the worker reported,
            acted on when its process exits.
        expected_exit: The rung of a worker the agent killed (hung, or told to
            stop), executed when its process exits.
        rejoining: The reason the worker asked to rejoin (None: it did not);
            cleared when it is restarted, finishes, or a new round starts.
    """

    history: RankHistory = field(default_factory=RankHistory)
    reply: str = ""
    leavable: bool = False
    fatal: Classification | None = None
    expected_exit: Rung | None = None
    rejoining: str | None = None


#: Seconds a node asked to leave waits for its workers' ``hello`` (their start-up, a restart) before it stops them:
#: a worker that does not use the agent's channel (a plain torchrun script) never says it.
HELLO_GRACE_S = 30.0


class LeaveDecision(enum.Enum):
    """What a node asked to leave its task does now (:func:`leave_decision`)."""

    LEAVE = "leave"  # ask every worker to leave at the next step boundary
    WAIT = "wait"  # a worker has not said yet whether it can leave (starting, restarting): ask again later
    STOP = "stop"  # the workers cannot leave at a step boundary: stop them (as SIGTERM)


def leave_decision(meeting: bool, running: int, said: int, all_said_leavable: bool, waited_s: float,
                   grace_s: float = HELLO_GRACE_S) -> LeaveDecision:
    """What a node asked to leave (a SLURM drain, a plan without it) does at this monitor interval.

    Args:
        meeting: The node has a meeting store (where leave requests go).
        running: Its workers whose processes run.
        said: Those of them whose ``hello`` arrived.
        all_said_leavable: Every ``hello`` said the worker can leave at a step boundary.
        waited_s: Seconds since the node first waited for a ``hello``.
        grace_s: Seconds it waits at most (a worker that never says ``hello`` cannot leave).
    """
    if not meeting or (said and not all_said_leavable):
        return LeaveDecision.STOP
    if running and said == running:
        return LeaveDecision.LEAVE
    return LeaveDecision.WAIT if waited_s < grace_s else LeaveDecision.STOP
