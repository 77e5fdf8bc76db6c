"""The multi-task comparison of section 7.4: Unicron's plan vs equally/weighted/sized.

The baselines split the n GPUs in proportion to 1 (equally), the weight
(weighted) or the parameter count (sized); shares are rounded to whole GPUs by
largest remainder, then each task runs at the largest size <= its share that
Megatron can use (T > 0). Unicron's plan is the solver's optimum of WAF.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from unicron_elastic.planner.cost_model import CostModel, PlanTask
from unicron_elastic.planner.solver import Problem, solve
from unicron_elastic.sim.engine import fit

BASELINES = ("equally", "weighted", "sized")


def proportional(n: int, shares: list[float]) -> list[int]:
    """Split n into integers proportional to ``shares`` (largest remainder)."""
    total = sum(shares)
    exact = [n * s / total for s in shares]
    out = [math.floor(e) for e in exact]
    order = sorted(range(len(shares)), key=lambda i: exact[i] - out[i], reverse=True)
    for i in order[: n - sum(out)]:
        out[i] += 1
    return out


def baseline_allocation(kind: str, tasks: tuple[PlanTask, ...], n: int, cost: CostModel) -> dict[str, int]:
    """GPUs per task under a baseline.

    Raises:
        ValueError: Unknown baseline.
    """
    if kind == "equally":
        shares = [1.0] * len(tasks)
    elif kind == "weighted":
        shares = [t.weight for t in tasks]
    elif kind == "sized":
        shares = [t.model.parameters for t in tasks]
    else:
        raise ValueError(f"unknown baseline {kind!r}; known: {', '.join(BASELINES)}")
    return {t.name: fit(cost, t, k) for t, k in zip(tasks, proportional(n, shares))}


def cluster_waf(tasks: tuple[PlanTask, ...], allocation: dict[str, int], cost: CostModel) -> float:
    """Sum of F(t, x) over the tasks."""
    return sum(cost.waf(t, allocation[t.name]) for t in tasks)


@dataclass(frozen=True)
class Comparison:
    """WAF of Unicron's plan and of each baseline for one case."""

    case: int
    unicron: float
    baselines: dict[str, float]
    allocations: dict[str, dict[str, int]]


def compare(case: int, tasks: tuple[PlanTask, ...], n: int, cost: CostModel) -> Comparison:
    """WAF of all allocation strategies for ``tasks`` on n GPUs (no failures)."""
    plan = solve(Problem(tasks, n, cost))
    allocations = {"unicron": plan.assignment}
    for kind in BASELINES:
        allocations[kind] = baseline_allocation(kind, tasks, n, cost)
    return Comparison(
        case,
        cluster_waf(tasks, plan.assignment, cost),
        {kind: cluster_waf(tasks, allocations[kind], cost) for kind in BASELINES},
        allocations,
    )
