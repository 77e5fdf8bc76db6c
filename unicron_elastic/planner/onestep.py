"""Plans for every one-step event, computed ahead so that reacting is a lookup.

From the current state (tasks with their sizes, n GPUs in nodes of g GPUs) the
next event is one of: a node is lost (n' = n - g; the tasks that had GPUs on it
are faulted), a node joins (n' = n + g), a task finishes (removed), or a
queued task is launched (added). Node losses are keyed by the set of tasks on
the node, so the table holds at most (tasks + 1) loss plans, not one per node.
Losing the last node gives the empty plan (n' = 0), not a missing entry.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace

from unicron_elastic.planner.cost_model import PlannerError, PlanTask
from unicron_elastic.planner.solver import MAX_GPUS, Plan, Problem, solve


@dataclass(frozen=True)
class Event:
    """A one-step change of the cluster.

    Attributes:
        kind: ``node_lost``, ``node_joined``, ``task_finished`` or ``task_launched``.
        tasks: For ``node_lost`` the tasks with GPUs on the node; for
            ``task_finished``/``task_launched`` the task; empty for ``node_joined``.
    """

    kind: str
    tasks: frozenset[str] = frozenset()


class UnknownNodeError(PlannerError):
    """A node number that is not a node of the table's cluster (names the node and the valid range)."""


def node_owners(assignment: dict[str, int], gpus_per_node: int) -> list[frozenset[str]]:
    """Which tasks use each node when tasks are packed onto nodes in order."""
    owners: list[set[str]] = []
    slot = 0
    for name, gpus in assignment.items():
        for _ in range(gpus):
            if slot % gpus_per_node == 0:
                owners.append(set())
            owners[-1].add(name)
            slot += 1
    return [frozenset(o) for o in owners]


class OneStepTable:
    """Precomputed plans for all one-step events from the current state.

    The cluster has ``problem.n // gpus_per_node`` nodes, numbered from 0 in
    packing order: tasks fill nodes in the order of ``problem.tasks``, and the
    nodes after the last used one are idle.

    Args:
        problem: The current problem (tasks with their ``current`` sizes, n).
        gpus_per_node: GPUs per node (the unit of loss and join).
        queued: Tasks that may be launched next.

    Raises:
        PlannerError: ``gpus_per_node`` < 1, n not a multiple of it, or the
            tasks' current sizes add up to more than n.
    """

    def __init__(self, problem: Problem, gpus_per_node: int, queued: tuple[PlanTask, ...] = ()) -> None:
        if gpus_per_node < 1:
            raise PlannerError(f"gpus_per_node={gpus_per_node} must be >= 1")
        if problem.n % gpus_per_node:
            raise PlannerError(f"n={problem.n} GPUs is not a whole number of nodes of {gpus_per_node} GPUs")
        held = sum(t.current for t in problem.tasks)
        if held > problem.n:
            raise PlannerError(f"the tasks hold {held} GPUs but the cluster has n={problem.n}")
        self.problem = problem
        self.gpus_per_node = gpus_per_node
        self.nodes = problem.n // gpus_per_node
        assignment = {t.name: t.current for t in problem.tasks}
        used = node_owners(assignment, gpus_per_node)
        #: The tasks on each node, idle nodes (empty sets) included: ``len(owners) == nodes``.
        self.owners = used + [frozenset()] * (self.nodes - len(used))
        self._plans: dict[Event, Plan] = {}
        self._build(queued)

    def _solve(self, tasks: tuple[PlanTask, ...], n: int) -> Plan | None:
        if not 0 <= n <= MAX_GPUS:
            return None
        return solve(Problem(tasks, n, self.problem.cost))

    def _put(self, event: Event, plan: Plan | None) -> None:
        if plan is not None:
            self._plans[event] = plan

    def _build(self, queued: tuple[PlanTask, ...]) -> None:
        tasks, n, g = self.problem.tasks, self.problem.n, self.gpus_per_node
        for owner in set(self.owners):
            faulted = tuple(replace(t, faulted=t.faulted or t.name in owner) for t in tasks)
            self._put(Event("node_lost", owner), self._solve(faulted, n - g))
        self._put(Event("node_joined"), self._solve(tasks, n + g))  # none past MAX_GPUS: a full-size cluster
        for task in tasks:
            rest = tuple(t for t in tasks if t.name != task.name)
            self._put(Event("task_finished", frozenset({task.name})), self._solve(rest, n))
        for task in queued:
            added = (*tasks, replace(task, current=0))
            self._put(Event("task_launched", frozenset({task.name})), self._solve(added, n))

    def __len__(self) -> int:
        return len(self._plans)

    def lookup(self, event: Event) -> Plan:
        """The plan for ``event``.

        Raises:
            KeyError: The event was not precomputed: a task the table neither
                holds nor queues, a ``node_lost`` set of tasks that no node
                holds (or any loss when the cluster has no node), or a node
                joining when n + g would exceed :data:`MAX_GPUS`.
        """
        try:
            return self._plans[event]
        except KeyError:
            raise KeyError(f"no precomputed plan for {event}") from None

    def on_node_lost(self, node: int) -> Plan:
        """The plan after losing node number ``node`` (in packing order; idle nodes included).

        Raises:
            UnknownNodeError: ``node`` is not a whole number in 0..``nodes - 1``
                (negative numbers do not count from the end); a
                :class:`PlannerError`, so a ``ValueError``.
        """
        try:
            index = operator.index(node)
        except TypeError:
            index = None
        if index is None or isinstance(node, bool) or not 0 <= index < self.nodes:
            span = f"0..{self.nodes - 1}" if self.nodes else "none: the cluster has no node"
            raise UnknownNodeError(f"node {node!r} is not a node of this cluster (valid: {span})")
        return self._plans[Event("node_lost", self.owners[index])]
