"""``Remedies``: the ladder's rungs carried out on one agent's ranks (the ladder itself, pure, is ``ladder.py``).

A reattempt is a verdict sent to the worker. A restart of a rank whose process still runs (hung, or told to
stop) kills its process tree and is carried out when the exit is seen. A restart of one rank respawns it
alone, or is left to torch's restart of the whole group where torch's process context cannot restart one
rank. A give-up is left pending for the agent's monitor, which raises ``NodeGaveUp``.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import structlog
from prometheus_client import Counter

from unicron_elastic.agent.api import LadderPolicy
from unicron_elastic.agent.channel import AgentChannel
from unicron_elastic.agent.ladder import LEFT_OUT, Remedy, Rung, climb
from unicron_elastic.agent.lifecycle import AgentState, Lifecycle
from unicron_elastic.agent.local_workers import LocalWorkers
from unicron_elastic.agent.publisher import EventPublisher
from unicron_elastic.agent.rank_state import RankTable
from unicron_elastic.events import ErrorEvent, Severity
from unicron_elastic.plugins.manager import call_isolated
from unicron_elastic.processes import signal_tree

log = structlog.get_logger(__name__)

ACTIONS = Counter("unicron_actions_total", "Actions taken by this agent", ["action"])


class Remedies:
    """What the ladder decides for one agent's ranks, carried out (the caller holds the agent's lock).

    Args:
        policy: The ladder's bounds.
        ranks: The agent's records of its ranks.
        workers: The node's worker processes.
        channel: The worker channel the verdicts go through.
        lifecycle: The agent's lifecycle: once it is closed, nothing is carried out.
        publisher: Builds the (unpublished) ``left_out`` event of a worker that asked to rejoin.
        pm: The plugin manager (its ``unicron_action`` hook gets every rung acted on).
        respawn: Restarts one local rank alone (the agent's: it announces the worker's new incarnation).

    Attributes:
        actions: ``(action, rank)`` of every rung carried out, oldest first.
        give_up: The pending give-up of the node (None: none).
    """

    def __init__(self, *, policy: LadderPolicy, ranks: RankTable, workers: LocalWorkers, channel: AgentChannel,
                 lifecycle: Lifecycle, publisher: EventPublisher, pm: Any, respawn: Callable[[int], None]) -> None:
        self._policy = policy
        self._ranks = ranks
        self._workers = workers
        self._channel = channel
        self._lifecycle = lifecycle
        self._publisher = publisher
        self._pm = pm
        self._respawn = respawn
        self.actions: list[tuple[str, int]] = []
        self.give_up: Rung | None = None

    def climb(self, rank: int, event: ErrorEvent, responsive: bool, step: int = -1) -> None:
        """Put ``rank`` on the rung ``event`` calls for and act on it.

        Args:
            rank: The global rank the event is about (-1: the node).
            event: The event.
            responsive: Whether the worker can still receive a verdict (not hung or dead).
            step: The training step of the event (reattempts are counted per step).
        """
        state = self._ranks.state(rank)
        decision = climb(self._policy, replace(state.history, responsive=responsive), event, step)
        state.history = decision.history
        self.act(rank, decision, event)

    def act(self, rank: int, decision: Rung, event: ErrorEvent) -> None:
        """Act on ``decision`` for ``rank``: a verdict, a kill whose exit carries it out, or at once.

        A shutdown that began is final: a closed agent logs the rung and does nothing.
        """
        if self._lifecycle.state is AgentState.CLOSED:
            log.info("agent_action_skipped", action=decision.action.value, rank=rank, reason="agent stopping")
            return
        log.info("agent_action", action=decision.action.value, rank=rank, reason=decision.reason)
        ACTIONS.labels(decision.action.value).inc()
        call_isolated(self._pm, "unicron_action", action=decision.action.value, event=event,
                      detail={"rank": rank, "reason": decision.reason})
        process = self._workers.process(rank)
        if decision.action is Remedy.REATTEMPT:
            self.actions.append((decision.action.value, rank))
            self._channel.send(self._ranks.peek(rank).reply, {"t": "verdict", "action": "reattempt"})
        elif process is not None and decision.action in (Remedy.RESTART_WORKER, Remedy.RESTART_ALL):
            # The worker still runs (hung, or told to stop). Its whole process tree is killed, since its
            # DataLoader workers (a deadlocked one included) would outlive it, and the rung is carried out
            # when its exit is seen.
            state = self._ranks.state(rank)
            state.expected_exit = decision
            self._channel.send(state.reply, {"t": "verdict", "action": "exit"})
            signal_tree(process.pid, signal.SIGKILL)
        else:
            self.execute(rank, decision, self._workers.local_rank(rank))

    def execute(self, rank: int, decision: Rung, local_rank: int | None) -> None:
        """Carry out ``decision`` for ``rank``, whose process has ended (nothing once the agent is closed).

        A restart of one rank respawns it where torch's process context allows it, and otherwise becomes a
        restart of the group: torch's monitor sees the failed process and restarts every worker. A give-up
        is left for the agent's monitor.

        Args:
            rank: The global rank.
            decision: The rung.
            local_rank: The rank's local rank (None: looked up now).
        """
        if self._lifecycle.state is AgentState.CLOSED:
            return
        self.actions.append((decision.action.value, rank))
        local_rank = self._workers.local_rank(rank) if local_rank is None else local_rank
        if decision.action is Remedy.RESTART_WORKER and local_rank is not None:
            if self._workers.can_restart_one():
                self._respawn(local_rank)
                return
            decision = replace(decision, action=Remedy.RESTART_ALL)
        if decision.action is Remedy.GIVE_UP:
            self.give_up = decision

    def worker_exited(self, rank: int, pid: int, exitcode: int, detected_at: float) -> None:
        """The process ``pid`` of ``rank`` failed with ``exitcode``, at ``detected_at`` (wall clock).

        A worker the agent killed carries out the rung decided then; one that asked to rejoin restarts as a
        joiner (or finished); any other exit is published, as a SEV2 ``exited_abnormally``, or as the SEV1
        of a fatal exception the worker reported before, and climbs the ladder.
        """
        state = self._ranks.state(rank)
        expected, state.expected_exit = state.expected_exit, None
        if expected is not None:
            self.execute(rank, expected, None)
            return
        if state.rejoining is not None and self.rejoin(rank, pid, exitcode, detected_at):
            return
        fatal, state.fatal = state.fatal, None
        severity = Severity.SEV1 if fatal and fatal.severity is Severity.SEV1 else Severity.SEV2
        kind = fatal.kind if severity is Severity.SEV1 else "exited_abnormally"
        event = self._publisher.event(severity, kind, "process", rank, f"pid {pid} exited with {exitcode}",
                                      detected_at, detected_at)
        self._publisher.publish(event)
        self.climb(rank, event, responsive=False)

    def rejoin(self, rank: int, pid: int, exitcode: int, detected_at: float) -> bool:
        """The worker of ``rank`` exited after asking to rejoin (this clears the request).

        Exit code 0: it finished, nothing to do. Otherwise the ladder decides on an unpublished
        ``left_out`` event: a restart as a joiner (counted in ``rejoins``, bounded by ``max_rejoins``) is
        no failure, so no event is published (nor passed to the ``unicron_event`` hook).

        Returns:
            Whether the exit is handled; False (a plain script, or ``max_rejoins`` used up): it is an
            ordinary exit for the caller to handle.
        """
        state = self._ranks.state(rank)
        reason, state.rejoining = state.rejoining or "", None
        if exitcode == 0:
            log.info("worker_finished_after_rejoin_request", rank=rank, pid=pid)
            return True
        event = self._publisher.event(Severity.SEV3, LEFT_OUT, "process", rank, f"pid {pid} left out: {reason}"[:500],
                                      detected_at, detected_at)
        history = replace(state.history, responsive=False)
        decision = climb(self._policy, history, event)
        if decision.history.rejoins == history.rejoins:
            # The ladder counted no rejoin.
            why = "worker not resumable" if not history.resumable else f"max_rejoins={self._policy.max_rejoins}"
            log.warning("rejoin_refused", rank=rank, reason=why, pid=pid, exitcode=exitcode)
            return False
        state.fatal = None
        log.info("worker_rejoining", rank=rank, reason=reason[:200], pid=pid, exitcode=exitcode)
        state.history = decision.history
        self.act(rank, decision, event)
        return True
