"""The agent's lifecycle as one value (``AgentState``), and how the node's part in its task ends (``Departure``).

torch's agent keeps the state of its workers in one ``WorkerState``; these two values are the agent's own.
Each check of the agent reads one of them from its :class:`Lifecycle`, and each transition is one method
of it. No I/O.
"""

from __future__ import annotations

import enum


class AgentState(enum.Enum):
    """Where the agent is in its life.

    A run goes from ``STARTING`` to ``RUNNING``; each restart of the whole group passes through
    ``RESTARTING`` and ``STOPPING`` back to ``RUNNING``; every run ends in ``CLOSED``.

    Attributes:
        STARTING: No rendezvous has completed yet, so the detectors have not started.
        RUNNING: The workers run (or are about to start), and an exit of one of them is a failure to act on.
        RESTARTING: torch stops the workers before a restart of the group (``_stop_workers``); it is not the
            final stop.
        STOPPING: torch stops or has stopped the whole group (after a restart's stop, on its monitor's
            verdict, or because the node gives up): the workers' exits are not failures until the next start.
        CLOSED: The agent stops for good (a signal, an error, the end of the run): it never acts or
            respawns a worker again.
    """

    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    CLOSED = "closed"

    @property
    def stopping(self) -> bool:
        """Whether torch is stopping the workers, so that their exits are not failures."""
        return self in (AgentState.RESTARTING, AgentState.STOPPING, AgentState.CLOSED)


class Departure(enum.Enum):
    """How this node's part in its task ends.

    It is independent of :class:`AgentState`: a node that leaves may still restart a worker (which is then
    asked to leave too), and its agent stops for good like any other.

    Attributes:
        STAYING: The node trains until the task ends or fails.
        LEAVING: The node was asked to leave: its workers leave the data-parallel group at a step boundary,
            and the node does not wait in the exit barrier.
        FINISHED: Every worker of the node succeeded while the node stayed (torch's exit barrier comes only
            then).
    """

    STAYING = "staying"
    LEAVING = "leaving"
    FINISHED = "finished"


class Lifecycle:
    """The agent's two lifecycle values and their transitions.

    The agent makes a transition under its lock wherever another of its threads (a detector's, the
    channel's) may act on the value meanwhile; its main thread alone makes the others.

    Attributes:
        state: Where the agent is in its life.
        departure: How the node's part in its task ends.
    """

    def __init__(self) -> None:
        self.state = AgentState.STARTING
        self.departure = Departure.STAYING

    def first_rendezvous(self) -> bool:
        """Leave ``STARTING`` once a rendezvous completed.

        Returns:
            Whether this was the first rendezvous (the detectors start then).
        """
        if self.state is not AgentState.STARTING:
            return False
        self.state = AgentState.RUNNING
        return True

    def workers_started(self) -> None:
        """torch started the round's workers: their exits are failures from now on, unless the agent is closed."""
        if self.state is not AgentState.CLOSED:
            self.state = AgentState.RUNNING

    def restart_begins(self) -> None:
        """torch stops the workers before a restart of the group."""
        if self.state is not AgentState.CLOSED:
            self.state = AgentState.RESTARTING

    def restart_stopped(self) -> None:
        """The stop before a restart is over; the exits stay no failures until the workers start again."""
        if self.state is AgentState.RESTARTING:
            self.state = AgentState.STOPPING

    def group_stopping(self) -> None:
        """torch closes the whole group, or the node gives up: the exits that follow are not failures."""
        if self.state in (AgentState.STARTING, AgentState.RUNNING):
            self.state = AgentState.STOPPING

    def close(self) -> bool:
        """Stop for good.

        Returns:
            Whether the agent was not closed before.
        """
        was_open = self.state is not AgentState.CLOSED
        self.state = AgentState.CLOSED
        return was_open

    def leave(self) -> None:
        """The node leaves its task: its workers leave at a step boundary."""
        self.departure = Departure.LEAVING

    def exit_barrier_reached(self) -> None:
        """Every worker succeeded: the node finished its part, unless it left."""
        if self.departure is not Departure.LEAVING:
            self.departure = Departure.FINISHED
