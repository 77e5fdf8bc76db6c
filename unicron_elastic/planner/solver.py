"""The dynamic program of paper section 5.2, exact and fast.

Recurrence (S(i, j): best total reward of the first i tasks using at most j
GPUs)::

    S(0, j) = 0                                   for all j >= 0
    S(i, j) = max_{k in K_i, k <= j} S(i-1, j-k) + G(t_i, k)
    answer  = S(m, n'),  assignment by following the back-pointers k*(i, j)

The paper takes K_i = {0, ..., j}: O(m n^2). We take K_i = the sizes where
F(t_i, k) > 0, plus 0 and the current size (see ``CostModel.candidates`` for
why no optimum is lost), and evaluate each row of S for all j at once with
numpy: O(m |K| n) with |K| typically a few dozen.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from unicron_elastic.planner.cost_model import CostModel, PlannerError, PlanTask


@dataclass(frozen=True)
class Problem:
    """One planning problem: tasks, the GPUs available after the event, the cost model.

    Raises:
        PlannerError: n' < 1 or duplicate task names.
    """

    tasks: tuple[PlanTask, ...]
    n: int
    cost: CostModel

    def __post_init__(self) -> None:
        if self.n < 1:
            raise PlannerError(f"no GPUs available (n'={self.n}): nothing to plan")
        names = [t.name for t in self.tasks]
        if len(set(names)) != len(names):
            raise PlannerError(f"task names must be unique: {names}")


@dataclass(frozen=True)
class Plan:
    """The solver's answer.

    Attributes:
        assignment: GPUs per task name.
        value: sum of G over the tasks (the objective).
    """

    assignment: dict[str, int]
    value: float

    @property
    def gpus_used(self) -> int:
        """Total GPUs assigned."""
        return sum(self.assignment.values())


def _rewards(problem: Problem, task: PlanTask, sizes: np.ndarray) -> np.ndarray:
    return np.array([problem.cost.reward(task, int(k), problem.n) for k in sizes])


def solve(problem: Problem) -> Plan:
    """Exact optimum of Eq. opt-simplified over candidate sizes (vectorised DP)."""
    n = problem.n
    columns = np.arange(n + 1)
    best = np.zeros(n + 1)  # S(0, j) = 0
    back: list[np.ndarray] = []
    for task in problem.tasks:
        sizes = problem.cost.candidates(task, n)
        # current size first: on ties argmax keeps the task where it is
        order = np.argsort(sizes != task.current, kind="stable")
        sizes = sizes[order]
        gains = _rewards(problem, task, sizes)
        table = np.full((len(sizes), n + 1), -np.inf)
        for row, (k, gain) in enumerate(zip(sizes, gains)):
            table[row, k:] = best[: n + 1 - k] + gain
        choice = np.argmax(table, axis=0)
        best = table[choice, columns]
        back.append(sizes[choice])
    assignment: dict[str, int] = {}
    j = n
    for task, pointers in zip(reversed(problem.tasks), reversed(back)):
        k = int(pointers[j])
        assignment[task.name] = k
        j -= k
    ordered = {t.name: assignment[t.name] for t in problem.tasks}
    return Plan(ordered, float(best[n]))


def solve_plain(problem: Problem) -> Plan:
    """The paper's DP as written: every k in 0..j for every (i, j), O(m n^2).

    Kept as the reference the benchmark compares against.
    """
    n = problem.n
    best = np.zeros(n + 1)
    back = []
    for task in problem.tasks:
        gains = _rewards(problem, task, np.arange(n + 1))
        new = np.empty(n + 1)
        pointers = np.empty(n + 1, dtype=np.int64)
        for j in range(n + 1):
            values = best[j::-1] + gains[: j + 1]  # k = 0..j: S(i-1, j-k) + G(t_i, k)
            k = int(np.argmax(values))
            new[j], pointers[j] = values[k], k
        best = new
        back.append(pointers)
    assignment = {}
    j = n
    for task, pointers in zip(reversed(problem.tasks), reversed(back)):
        assignment[task.name] = int(pointers[j])
        j -= assignment[task.name]
    return Plan({t.name: assignment[t.name] for t in problem.tasks}, float(best[n]))


def evaluate(problem: Problem, assignment: dict[str, int]) -> float:
    """Objective of an assignment, computed independently of the solvers.

    Raises:
        PlannerError: The assignment misses a task, has a negative size or
            uses more than n' GPUs.
    """
    total_gpus = 0
    value = 0.0
    for task in problem.tasks:
        if task.name not in assignment:
            raise PlannerError(f"assignment has no entry for task {task.name!r}")
        x = int(assignment[task.name])
        if x < 0:
            raise PlannerError(f"task {task.name!r}: negative size {x}")
        total_gpus += x
        f_new = task.weight * problem.cost.throughput.flops(task.model, x) if x >= max(1, task.min_gpus) else 0.0
        x_old = task.current
        f_old = (
            task.weight * problem.cost.throughput.flops(task.model, x_old) if x_old >= max(1, task.min_gpus) else 0.0
        )
        indicator = 1.0 if (x != x_old or task.faulted) else 0.0
        value += f_new / (problem.cost.failure_rate * problem.n) - f_old * indicator * problem.cost.d_transition
    if total_gpus > problem.n:
        raise PlannerError(f"assignment uses {total_gpus} GPUs but only {problem.n} are available")
    return value
