"""The cost model of paper section 5.1 (WAF and reward G), apart from the solver.

    F(t, x)   = w(t) * T(t, x)   if x meets t's minimum requirement, else 0
    G(t, x')  = F(t, x') * D_running(n')
                - F(t, x) * 1(t, x -> x') * D_transition
    1(t, x -> x') = 1 if x != x' or a worker of t faulted, else 0
    D_running(n') = 1 / (lambda * n')       expected time to the next failure
                                            of n' GPUs with failure rate lambda

With no GPU up (n' = 0) D_running is infinite and every task gets x' = 0, so
F(t, 0) * D_running is taken as 0 (a task that does not run earns nothing):
G(t, 0) is minus the transition penalty, and the plan is empty, not an error.

Units: FLOP/s for F, seconds for D, so G is in (weighted) FLOPs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from unicron_elastic.api import MAX_TIMEOUT_S, ConfigError, finite_positive
from unicron_elastic.planner.throughput import GptModel, ThroughputModel


class PlannerError(ConfigError):
    """The planning problem is malformed (a ValueError naming the culprit)."""


#: Largest task weight w(t) (the paper recommends 0.5 to 2.0).
MAX_WEIGHT = 1e6
#: Bounds of the failure rate lambda, failures per GPU per second: from one per
#: 3e12 GPU-years to one per GPU-second. Outside them D_running or G overflow.
MIN_FAILURE_RATE = 1e-20
MAX_FAILURE_RATE = 1.0


def _checked(name: str, value: object, maximum: float, **kwargs: bool) -> float | int:
    """:func:`~unicron_elastic.api.finite_positive`, raising :class:`PlannerError`.

    Raises:
        PlannerError: ``value`` is not a finite number in range; names ``name``.
    """
    try:
        return finite_positive(name, value, maximum, **kwargs)
    except PlannerError:
        raise
    except ConfigError as exc:
        raise PlannerError(str(exc)) from None


@dataclass(frozen=True)
class PlanTask:
    """A task as the planner sees it.

    Attributes:
        name: Unique task name.
        model: The GPT model it trains.
        weight: w(t), the priority or price of its FLOP/s (finite, > 0, at
            most :data:`MAX_WEIGHT`; the paper recommends 0.5 to 2.0).
        min_gpus: T_necessary as a number of GPUs: below it, F = 0.
        current: x, the GPUs it holds now.
        faulted: A worker of this task faulted (forces the indicator to 1).
    """

    name: str
    model: GptModel
    weight: float = 1.0
    min_gpus: int = 1
    current: int = 0
    faulted: bool = False

    def __post_init__(self) -> None:
        if not self.name:
            raise PlannerError("task name must not be empty")
        _checked(f"task {self.name!r}: weight", self.weight, MAX_WEIGHT)
        if self.min_gpus < 0 or self.current < 0:
            raise PlannerError(f"task {self.name!r}: min_gpus and current must be >= 0")


@dataclass(frozen=True)
class CostModel:
    """F and G for one cluster.

    Attributes:
        throughput: T(t, x).
        failure_rate: lambda, failures per GPU per second (finite, in
            :data:`MIN_FAILURE_RATE` .. :data:`MAX_FAILURE_RATE`).
        d_transition: Seconds a reconfigured task loses (D_transition; finite,
            >= 0, at most one year).

    Raises:
        PlannerError: A parameter is NaN, infinite or out of range.
    """

    throughput: ThroughputModel
    failure_rate: float = 1.0 / (128 * 7 * 86400 / 4)  # 4 failures a week on 128 GPUs
    d_transition: float = 60.0
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        _checked("failure_rate", self.failure_rate, MAX_FAILURE_RATE)
        if self.failure_rate < MIN_FAILURE_RATE:
            raise PlannerError(f"failure_rate={self.failure_rate!r} must be at least {MIN_FAILURE_RATE}")
        _checked("d_transition", self.d_transition, MAX_TIMEOUT_S, allow_zero=True)

    def waf(self, task: PlanTask, x: int) -> float:
        """F(t, x): weighted achieved FLOP/s, 0 below the minimum requirement."""
        if x < max(1, task.min_gpus):
            return 0.0
        return task.weight * self.throughput.flops(task.model, x)

    def d_running(self, n: int) -> float:
        """D_running(n'): expected seconds until one of n' GPUs fails.

        Infinite for n' = 0: with no GPU up, none can fail.

        Raises:
            PlannerError: n' < 0.
        """
        if n < 0:
            raise PlannerError(f"n'={n} GPUs: the number of available GPUs must be >= 0")
        return math.inf if n == 0 else 1.0 / (self.failure_rate * n)

    def running(self, waf: float, n: int) -> float:
        """F * D_running(n'): weighted FLOPs until the next failure, 0 for a task that does not run.

        Raises:
            PlannerError: n' < 0.
        """
        d = self.d_running(n)
        return 0.0 if waf == 0 else waf * d

    def reward(self, task: PlanTask, x_new: int, n: int) -> float:
        """G(t, x'): reward of giving ``x_new`` GPUs to ``task`` in a cluster of n' GPUs.

        Raises:
            PlannerError: n' < 0, or ``x_new`` not in 0..n'.
        """
        self.d_running(n)  # refuses n' < 0
        if not 0 <= x_new <= n:
            raise PlannerError(f"task {task.name!r}: size {x_new} not in 0..{n} (n'={n} GPUs)")
        changed = x_new != task.current or task.faulted
        penalty = self.waf(task, task.current) * self.d_transition if changed else 0.0
        return self.running(self.waf(task, x_new), n) - penalty

    def _feasible(self, task: PlanTask, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Sizes <= n with F > 0 for the task's model and minimum, and T at them (cached)."""
        key = (task.model, task.min_gpus, n)
        hit = self._cache.get(key)
        if hit is None:
            sizes = [k for k in self.throughput.candidates(task.model, n) if k >= max(1, task.min_gpus)]
            flops = [self.throughput.flops(task.model, k) for k in sizes]
            hit = self._cache[key] = (np.array(sizes, dtype=np.int64), np.array(flops, dtype=np.float64))
        return hit

    def candidates(self, task: PlanTask, n: int) -> np.ndarray:
        """Sizes worth considering for ``task`` in a cluster of n' GPUs.

        Only sizes where F > 0, plus 0 and the current size: any other k has
        F(t, k) = 0 and the same penalty as k = 0, so k = 0 dominates it (same
        reward, fewer GPUs). This is what makes the solver exact while only
        looking at a few sizes per task.
        """
        return self.rewards(task, n)[0]

    def rewards(self, task: PlanTask, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Candidate sizes of ``task`` and G(t, k) at each, vectorised.

        Returns:
            ``(sizes, gains)``: the current size first (if it is a candidate),
            then 0, then the feasible sizes ascending. For n' = 0 only size 0.

        Raises:
            PlannerError: n' < 0.
        """
        d_running = self.d_running(n)
        sizes, flops = self._feasible(task, n)
        head = [task.current] if 0 < task.current <= n else []
        head_flops = [self.waf(task, task.current) / task.weight] if head else []
        head += [0]
        head_flops += [0.0]
        rest = sizes != task.current
        all_sizes = np.concatenate([np.array(head, dtype=np.int64), sizes[rest]])
        all_flops = np.concatenate([np.array(head_flops), flops[rest]])
        changed = (all_sizes != task.current) | task.faulted
        penalty = self.waf(task, task.current) * self.d_transition
        running = task.weight * all_flops * d_running if n > 0 else np.zeros(len(all_sizes))  # n' = 0: only k = 0
        gains = running - changed * penalty
        return all_sizes, gains
