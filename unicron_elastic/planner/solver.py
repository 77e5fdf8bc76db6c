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
from unicron_elastic.planner.throughput import MAX_GPUS


@dataclass(frozen=True)
class Problem:
    """One planning problem: tasks, the GPUs available after the event, the cost model.

    n' = 0 (every node down) is a valid problem: its plan is empty (every task
    gets 0 GPUs), see :mod:`~unicron_elastic.planner.cost_model`.

    Raises:
        PlannerError: n' < 0, n' > :data:`MAX_GPUS` or duplicate task names.
    """

    tasks: tuple[PlanTask, ...]
    n: int
    cost: CostModel

    def __post_init__(self) -> None:
        if self.n < 0:
            raise PlannerError(f"n'={self.n} GPUs: the number of available GPUs must be >= 0")
        if self.n > MAX_GPUS:
            raise PlannerError(f"n'={self.n} GPUs: at most {MAX_GPUS} can be planned")
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


def _all_rewards(problem: Problem, task: PlanTask) -> np.ndarray:
    """G(t, k) for every k in 0..n' (vectorised, so the plain DP times only its recurrence)."""
    sizes, gains = problem.cost.rewards(task, problem.n)
    everything = np.full(problem.n + 1, gains[sizes == 0][0])  # F = 0 and k != x: same as k = 0
    everything[sizes] = gains
    return everything


def solve(problem: Problem) -> Plan:
    """Exact optimum of Eq. opt-simplified over candidate sizes (vectorised DP).

    The forward pass keeps only a running maximum per row (two numpy operations
    per candidate size); the back-pointer k*(i, j) is recovered while tracing
    back as the first candidate (current size first, so ties keep a task where
    it is) whose ``S(i-1, j-k) + G(t_i, k)`` equals ``S(i, j)`` - the same
    floating-point sum the forward pass took the maximum of.
    """
    n = problem.n
    rows = [np.zeros(n + 1)]  # S(0, j) = 0
    options = []
    scratch = np.empty(n + 1)
    for task in problem.tasks:
        sizes, gains = problem.cost.rewards(task, n)
        keep = sizes <= n
        sizes, gains = sizes[keep], gains[keep]
        best, new = rows[-1], np.full(n + 1, -np.inf)
        for k, gain in zip(sizes.tolist(), gains.tolist()):
            width = n + 1 - k
            np.add(best[:width], gain, out=scratch[:width])  # S(i-1, j-k) + G(t_i, k), j = k..n
            np.maximum(new[k:], scratch[:width], out=new[k:])
        rows.append(new)
        options.append((sizes, gains))
    assignment: dict[str, int] = {}
    j = n
    for i in range(len(problem.tasks), 0, -1):
        sizes, gains = options[i - 1]
        fits = sizes <= j
        totals = rows[i - 1][j - sizes[fits]] + gains[fits]
        k = int(sizes[fits][np.flatnonzero(totals == rows[i][j])[0]])
        assignment[problem.tasks[i - 1].name] = k
        j -= k
    ordered = {t.name: assignment[t.name] for t in problem.tasks}
    return Plan(ordered, float(rows[-1][n]))


#: Entries of ``S(i-1, j-k) + G(t_i, k)`` that :func:`solve_plain` forms at once (1 MiB of
#: float64: a block stays in cache between the sum and the argmax).
_PLAIN_BLOCK = 1 << 17


def solve_plain(problem: Problem) -> Plan:
    """The paper's DP as written: every k in 0..j for every (i, j), O(m n^2), vectorised.

    For each task the table ``S(i-1, j-k) + G(t_i, k)`` over (j, k) is formed
    with numpy, a block of rows j at a time (k > j gives -inf), and reduced
    with ``argmax`` over k: the paper's O(m n^2) work with no Python loop over
    j or k. Ties take the smallest k. The honest baseline of
    ``benchmarks/planner.py``, and a second reference for the tests.
    """
    n = problem.n
    best = np.zeros(n + 1)
    padded = np.full(2 * n + 1, -np.inf)  # padded[n + j - k] = S(i-1, j-k); -inf for k > j
    windows = np.lib.stride_tricks.sliding_window_view(padded, n + 1)  # [j, n - k] = padded[n + j - k]
    rows = max(1, _PLAIN_BLOCK // (n + 1))
    scratch = np.empty(rows * (n + 1))
    back = []
    for task in problem.tasks:
        gains = _all_rewards(problem, task)
        padded[n:] = best
        new = np.empty(n + 1)
        pointers = np.empty(n + 1, dtype=np.int64)
        for lo in range(0, n + 1, rows):
            hi = min(n + 1, lo + rows)  # rows j = lo..hi-1 need k = 0..hi-1 only
            values = scratch[: (hi - lo) * hi].reshape(hi - lo, hi)
            np.add(windows[lo:hi, n + 1 - hi :][:, ::-1], gains[:hi], out=values)  # [j - lo, k]
            pointers[lo:hi] = np.argmax(values, axis=1)
            new[lo:hi] = values[np.arange(hi - lo), pointers[lo:hi]]
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
    sizes = {}
    for task in problem.tasks:
        if task.name not in assignment:
            raise PlannerError(f"assignment has no entry for task {task.name!r}")
        sizes[task.name] = int(assignment[task.name])
        if sizes[task.name] < 0:
            raise PlannerError(f"task {task.name!r}: negative size {sizes[task.name]}")
    total_gpus = sum(sizes.values())
    if total_gpus > problem.n:
        raise PlannerError(f"assignment uses {total_gpus} GPUs but only {problem.n} are available")
    value = 0.0
    for task in problem.tasks:
        x = sizes[task.name]
        f_new = task.weight * problem.cost.throughput.flops(task.model, x) if x >= max(1, task.min_gpus) else 0.0
        x_old = task.current
        f_old = (
            task.weight * problem.cost.throughput.flops(task.model, x_old) if x_old >= max(1, task.min_gpus) else 0.0
        )
        indicator = 1.0 if (x != x_old or task.faulted) else 0.0
        running = f_new / (problem.cost.failure_rate * problem.n) if f_new else 0.0  # n' = 0: nothing runs
        value += running - f_old * indicator * problem.cost.d_transition
    return value
