"""Plans for every one-step event, computed ahead so that reacting is a lookup.

From the current state (tasks with their sizes, n GPUs in nodes of g GPUs) the
next event is one of: a node is lost (n' = n - g; the tasks that had GPUs on it
are faulted), a node joins (n' = n + g), a task finishes (removed), or a
queued task is launched (added). Node losses are keyed by the set of tasks on
the node, so the table holds at most (tasks + 1) loss plans, not one per node.
"""

from __future__ import annotations

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

    Args:
        problem: The current problem (tasks with their ``current`` sizes, n).
        gpus_per_node: GPUs per node (the unit of loss and join).
        queued: Tasks that may be launched next.

    Raises:
        PlannerError: ``gpus_per_node`` < 1.
    """

    def __init__(self, problem: Problem, gpus_per_node: int, queued: tuple[PlanTask, ...] = ()) -> None:
        if gpus_per_node < 1:
            raise PlannerError(f"gpus_per_node={gpus_per_node} must be >= 1")
        self.problem = problem
        self.gpus_per_node = gpus_per_node
        assignment = {t.name: t.current for t in problem.tasks}
        self.owners = node_owners(assignment, gpus_per_node)
        self._plans: dict[Event, Plan] = {}
        self._build(queued)

    def _solve(self, tasks: tuple[PlanTask, ...], n: int) -> Plan | None:
        if not 1 <= n <= MAX_GPUS:
            return None
        return solve(Problem(tasks, n, self.problem.cost))

    def _build(self, queued: tuple[PlanTask, ...]) -> None:
        tasks, n, g = self.problem.tasks, self.problem.n, self.gpus_per_node
        for owner in set(self.owners) | {frozenset()}:
            faulted = tuple(replace(t, faulted=t.faulted or t.name in owner) for t in tasks)
            plan = self._solve(faulted, n - g)
            if plan is not None:
                self._plans[Event("node_lost", owner)] = plan
        joined = self._solve(tasks, n + g)
        if joined is not None:  # None only past MAX_GPUS: no node can join a full-size cluster
            self._plans[Event("node_joined")] = joined
        for task in tasks:
            rest = tuple(t for t in tasks if t.name != task.name)
            self._plans[Event("task_finished", frozenset({task.name}))] = self._solve(rest, n)  # type: ignore[assignment]
        for task in queued:
            added = (*tasks, replace(task, current=0))
            self._plans[Event("task_launched", frozenset({task.name}))] = self._solve(added, n)  # type: ignore[assignment]

    def __len__(self) -> int:
        return len(self._plans)

    def lookup(self, event: Event) -> Plan:
        """The plan for ``event``.

        Raises:
            KeyError: The event was not precomputed (e.g. a loss that leaves no GPU).
        """
        return self._plans[event]

    def on_node_lost(self, node: int) -> Plan:
        """The plan after losing node number ``node`` (in packing order).

        Raises:
            KeyError: No such node, or the loss leaves no GPU.
        """
        owner = self.owners[node] if node < len(self.owners) else frozenset()
        return self._plans[Event("node_lost", owner)]
