"""What changed in the store, as the policy's events: a store read (:class:`Observed`) against the state (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from unicron_elastic.coordinator.api import TaskSpec
from unicron_elastic.events import ErrorEvent
from unicron_elastic.coordinator.vocabulary import (
    ClusterState,
    Failure,
    NodeJoined,
    NodeLeft,
    NodeLost,
    PolicyEvent,
    Replan,
    TaskFinished,
    TaskSubmitted,
)


# -- what changed in the store ---------------------------------------------------------------------
@dataclass(frozen=True)
class Observed:
    """One read of the store by the coordinator.

    Attributes:
        nodes: Registered nodes and their slots.
        specs: Stored task specs, oldest first.
        cancelled: Tasks with a cancel request.
        done: Per task, the nodes that reported it completed (their launcher exited 0).
        events: Error events after the coordinator's cursor, oldest first, with their etcd revisions.
        leases: Per node, the lease its record is attached to.
        cursor: The newest error event's revision read (malformed ones included).
        leaving: Nodes whose daemon marked its record ``leaving`` (not in ``nodes``).
    """

    nodes: Mapping[str, int] = field(default_factory=dict)
    specs: tuple[TaskSpec, ...] = ()
    cancelled: frozenset[str] = frozenset()
    done: Mapping[str, frozenset[str]] = field(default_factory=dict)
    events: tuple[tuple[int, ErrorEvent], ...] = ()
    leases: Mapping[str, int] = field(default_factory=dict)
    cursor: int = 0
    leaving: frozenset[str] = frozenset()


def changes(state: ClusterState, seen: Observed) -> list[PolicyEvent]:
    """The events that turn ``state`` into what the store shows, worst first.

    Nodes lost or left, then nodes joined, tasks finished or cancelled, tasks
    submitted, error events; :class:`Replan` if there is no plan yet.
    """
    def restarted(n: str) -> bool:  # the same name, another daemon (a new lease): lost, then joined again
        known, now = state.leases.get(n), seen.leases.get(n)
        return n in seen.nodes and known is not None and now is not None and known != now

    out: list[PolicyEvent] = [NodeLeft(n) if n in seen.leaving and n not in seen.nodes else NodeLost(n)
                              for n in sorted(state.nodes) if n not in seen.nodes or restarted(n)]
    out += [NodeJoined(n, k, seen.leases.get(n, 0)) for n, k in sorted(seen.nodes.items())
            if state.nodes.get(n) != k or restarted(n)]
    active = {t.name for t in state.tasks}
    out += [TaskFinished(name, cancelled=name in seen.cancelled) for name in sorted(active)
            if name in seen.cancelled or _completed(state, name, seen.done.get(name, frozenset()))]
    out += [TaskSubmitted(spec) for spec in seen.specs
            if spec.name not in active and spec.name not in state.finished
            and spec.name not in seen.cancelled and spec.name not in seen.done]
    out += [Failure(e) for _, e in seen.events]
    if state.plan is None and not any(isinstance(e, (NodeJoined, NodeLost, TaskSubmitted)) for e in out):
        out.append(Replan("first plan"))
    return out


def _completed(state: ClusterState, task: str, done: frozenset[str]) -> bool:
    """Whether every node the plan gives ``task`` reported it completed (any report when it has none).

    One node's report is not enough: its launcher may have ended alone (e.g.
    its rendezvous closed) while the task trains on elsewhere.
    """
    if not done:
        return False
    share = state.plan.tasks.get(task) if state.plan is not None else None
    return share is None or not share.nodes or set(share.nodes) <= done
