"""The seam through which the coordinator's plan decides who joins a rendezvous.

The default gate admits every node (plain torchrun behaviour). Under a node
daemon (``unicron node``), :class:`PlanGate` admits a node only while the
coordinator's plan gives it this run's task, and says when the plan wants the
run larger than its running round.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import structlog

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class JoinRequest:
    """What a node asks to join.

    Attributes:
        run_id: The rendezvous run id.
        task: Task the node trains.
        node: The node's address as the rendezvous sees it.
        round: The round the node is about to join (-1 if unknown).
    """

    run_id: str
    task: str
    node: str
    round: int


class JoinGate(ABC):
    """Decides whether a node may join the next rendezvous round."""

    @abstractmethod
    def admit(self, request: JoinRequest) -> None:
        """Return when the node may join.

        Raises:
            RendezvousClosedError: The plan gives this node no place in the run.
        """


    #: When the run should grow but its workers cannot admit joiners past their world: join the next
    #: round (torch's restart-all at the new size) instead of waiting for a lost node's place.
    restarts_to_grow: bool = False

    def grow(self, request: JoinRequest, nodes: int) -> bool:
        """Whether the run should have more nodes than the ``nodes`` alive in its running round.

        The handler then adds a place to the running round (its workers join
        at a step boundary; nobody restarts), up to ``--nnodes``' max.
        Default: False (wait for a lost node's place).
        """
        return False


class OpenGate(JoinGate):
    """Admits everyone: the behaviour of torchrun without a coordinator; an arriving node grows the run."""

    def admit(self, request: JoinRequest) -> None:
        """See base class."""
        return None

    def grow(self, request: JoinRequest, nodes: int) -> bool:
        """See base class: always (the handler stops at ``--nnodes``' max)."""
        return True


class PlanGate(JoinGate):
    """Admits this node into a task's rendezvous only as the coordinator's plan says.

    Args:
        store: The cluster's status store (the plan is read from it).
        node: This node's name in the plan (the daemon's ``--name``).
        timeout: Seconds between ``plan_gate_waiting`` warnings while :meth:`admit` waits.
        poll: Seconds between reads of the plan.
    """

    restarts_to_grow = True

    def __init__(self, store, node: str, timeout: float = 600.0, poll: float = 0.2) -> None:
        self.store = store
        self.node = node
        self.timeout = timeout
        self.poll = poll

    def _share(self, task: str):
        from unicron_elastic.api import MalformedValueError
        from unicron_elastic.coordinator.api import ClusterPlan

        kv = self.store.get(self.store.keys.plan())
        if kv is None:
            return None, None
        try:
            plan = ClusterPlan.from_json(kv.value)
        except MalformedValueError:
            return None, None
        return plan, plan.tasks.get(task)

    def admit(self, request: JoinRequest) -> None:
        """Wait until the plan gives this node ``request.task``.

        It never refuses: a launcher that raised a rendezvous error here would
        close the task's rendezvous for every node. A plan that gives the node
        another task makes its daemon stop this launcher (SIGTERM); a daemon
        that died makes it stop itself (a ``SignalException``, which closes nothing).

        Raises:
            SignalException: The node daemon that started this launcher is gone.
        """
        import os
        import signal
        import time

        from torch.distributed.elastic.multiprocessing.api import SignalException

        from unicron_elastic.env import daemon_pid

        waited_since = time.monotonic()
        while True:
            plan, share = self._share(request.task)
            if share is not None and self.node in share.nodes:
                return
            daemon = daemon_pid()
            if daemon is not None and os.getppid() != daemon:
                raise SignalException(f"node daemon {daemon} is gone", sigval=signal.SIGTERM)
            if time.monotonic() - waited_since > self.timeout:
                log.warning("plan_gate_waiting", node=self.node, task=request.task,
                            generation=None if plan is None else plan.generation)
                waited_since = time.monotonic()
            time.sleep(self.poll)

    def grow(self, request: JoinRequest, nodes: int) -> bool:
        """True when the plan gives the task more nodes than ``nodes`` and this node is one of them."""
        _, share = self._share(request.task)
        return share is not None and self.node in share.nodes and len(share.nodes) > nodes
