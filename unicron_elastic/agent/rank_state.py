"""The agent's record of each rank: its ladder history and what is pending for its worker (no I/O); what a node
asked to leave does.

The agent keeps one :class:`RankState` per global rank in its :class:`RankTable` (under its lock): what
the worker said in its ``hello``, what the ladder has seen of the rank, and
what the agent must do when the worker's process exits.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any

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


class RankTable:
    """What the agent knows of its ranks, and which worker exits it handled (the caller holds the agent's lock).

    Args:
        states: The records to start with (default: none).

    Attributes:
        handled_pids: The processes whose exit the agent handled, or that finished with code 0.
    """

    def __init__(self, states: dict[int, RankState] | None = None) -> None:
        self._states: dict[int, RankState] = dict(states or {})
        self.handled_pids: set[int] = set()

    def state(self, rank: int) -> RankState:
        """The record of ``rank``, made on its first write."""
        return self._states.setdefault(rank, RankState())

    def peek(self, rank: int) -> RankState:
        """The record of ``rank`` to read: a fresh one, not kept, for a rank never written."""
        return self._states.get(rank, RankState())

    def hello(self, rank: int, msg: dict[str, Any]) -> None:
        """The worker of ``rank`` said ``hello``: its reply address, and whether it can leave and be restarted alone."""
        state = self.state(rank)
        state.reply, state.leavable = str(msg["reply"]), msg.get("leavable") is True
        state.history = replace(state.history, resumable=bool(msg["resumable"]))

    def said_hello(self, ranks: list[int]) -> list[RankState]:
        """The records of those of ``ranks`` whose worker said ``hello``."""
        return [self._states[r] for r in ranks if r in self._states and self._states[r].reply]

    def finished(self, rank: int) -> None:
        """The worker of ``rank`` finished with code 0: a rejoin it asked for is void."""
        if rank in self._states:
            self._states[rank].rejoining = None

    def new_round(self) -> None:
        """The workers of a new round started: the previous processes' rejoin requests are void."""
        for state in self._states.values():
            state.rejoining = None


#: Seconds a node asked to leave waits for its workers' ``hello`` (their start-up, a restart) before it stops them:
#: a worker that does not use the agent's channel (a plain torchrun script) never says it.
HELLO_GRACE_S = 30.0


class LeaveDecision(enum.Enum):
    """What a node asked to leave its task does now (:func:`leave_decision`).

    Attributes:
        LEAVE: Ask every worker to leave at the next step boundary.
        WAIT: A worker has not said yet whether it can leave (it is starting or restarting): ask again later.
        STOP: The workers cannot leave at a step boundary: stop them (as SIGTERM would).
    """

    LEAVE = "leave"
    WAIT = "wait"
    STOP = "stop"


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
