"""Trace-driven simulation of a multi-task cluster under one recovery policy.

WAF is piecewise constant between events, so the simulation is exact event by
event: failures, repairs and the end of each task's downtime. Every policy
starts from the same initial plan (the solver's optimum, as in section 7.5).

Policies (numbers in :data:`POLICIES`, sources in docs/simulator.md):

* ``unicron``: in-band detection (Table exp-detection); SEV3 reattempt, SEV2
  process restart, SEV1 re-plan of *all* tasks with the cost-aware solver;
  a repaired node triggers a re-plan too.
* ``megatron``: no training on reduced resources: a task that lost a node
  waits for its repair, then resubmission, set-up and recomputation (9 + 14 +
  15 min, section 1); SEV2/SEV3 are noticed by the 30 min timeout.
* ``oobleck``/``bamboo``/``varuna``: a fraction of Megatron's throughput;
  only the task hit by a failure is reconfigured (to the best size it still
  fits), and a repaired node goes to the first task that lost one.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from unicron_elastic.api import lookup
from unicron_elastic.coordinator.sizing import plan_sizes
from unicron_elastic.planner.cost_model import CostModel, PlanTask
from unicron_elastic.planner.solver import Problem, solve
from unicron_elastic.sim.trace import Trace

MINUTE = 60.0


@dataclass(frozen=True)
class Policy:
    """How a system detects and recovers.

    Attributes:
        name: Display name.
        efficiency: Throughput as a fraction of Megatron's T(t, x).
        detect: Detection seconds per severity.
        transition: Seconds a task is down after detection, per severity.
        recovery: ``replan`` (Unicron), ``affected`` (reconfigure only the hit
            task) or ``wait`` (Megatron: wait for the node's repair).
        resume: For ``wait``: seconds from the repair to training again.
    """

    name: str
    efficiency: float
    detect: dict[str, float]
    transition: dict[str, float]
    recovery: str
    resume: float = 0.0


_TIMEOUT = 30 * MINUTE  # Megatron's D_timeout
_RESTART = (9 + 14 + 15) * MINUTE  # resubmission + set-up + recomputation (section 1)

POLICIES: dict[str, Policy] = {
    "unicron": Policy("Unicron", 1.0, {"sev1": 5.6, "sev2": 1.8, "sev3": 0.3},
                      {"sev1": 60.0, "sev2": 30.0, "sev3": 5.0}, "replan"),
    "megatron": Policy("Megatron", 1.0, {"sev1": 5.7, "sev2": _TIMEOUT, "sev3": _TIMEOUT},
                       {"sev1": 0.0, "sev2": _RESTART, "sev3": _RESTART}, "wait", resume=_RESTART),
    "oobleck": Policy("Oobleck", 0.30, {"sev1": 5.7, "sev2": _TIMEOUT, "sev3": _TIMEOUT},
                      {"sev1": 2 * MINUTE, "sev2": 2 * MINUTE, "sev3": 2 * MINUTE}, "affected"),
    "bamboo": Policy("Bamboo", 0.25, {"sev1": 5.7, "sev2": _TIMEOUT, "sev3": _TIMEOUT},
                     {"sev1": 3 * MINUTE, "sev2": 3 * MINUTE, "sev3": 3 * MINUTE}, "affected"),
    "varuna": Policy("Varuna", 0.22, {"sev1": 5.7, "sev2": _TIMEOUT, "sev3": _TIMEOUT},
                     {"sev1": 20 * MINUTE, "sev2": 20 * MINUTE, "sev3": 20 * MINUTE}, "affected"),
}


def policy(name: str) -> Policy:
    """Look up a policy.

    Raises:
        ConfigError: Unknown name.
    """
    return lookup(POLICIES, "policy", name)


@dataclass
class Result:
    """What one simulation produced.

    Attributes:
        policy: Policy name.
        times: Change points (s); WAF and GPUs hold from each until the next.
        waf: Cluster WAF (weighted FLOP/s) after each change point.
        gpus: Available GPUs after each change point.
        duration: Length of the trace (s).
    """

    policy: str
    times: list[float] = field(default_factory=list)
    waf: list[float] = field(default_factory=list)
    gpus: list[int] = field(default_factory=list)
    duration: float = 0.0

    def record(self, t: float, waf: float, gpus: int) -> None:
        """Append a change point (replacing one at the same time)."""
        if self.times and self.times[-1] == t:
            self.waf[-1], self.gpus[-1] = waf, gpus
        else:
            self.times.append(t)
            self.waf.append(waf)
            self.gpus.append(gpus)

    def accumulated(self) -> list[float]:
        """Accumulated WAF (weighted FLOPs) at each change point and at the end."""
        total, out = 0.0, [0.0]
        ends = self.times[1:] + [self.duration]
        for start, end, w in zip(self.times, ends, self.waf):
            total += w * (end - start)
            out.append(total)
        return out

    @property
    def total(self) -> float:
        """Accumulated WAF over the whole trace."""
        return self.accumulated()[-1]


def fit(cost: CostModel, task: PlanTask, gpus: int) -> int:
    """Largest size <= ``gpus`` at which ``task`` runs (0 if none)."""
    sizes = [k for k in cost.candidates(replace(task, current=0), max(gpus, 1)).tolist() if 0 < k <= gpus]
    return max(sizes, default=0)


class _Cluster:
    """Mutable state of one simulation run."""

    def __init__(self, trace: Trace, tasks: tuple[PlanTask, ...], cost: CostModel, pol: Policy) -> None:
        self.trace, self.cost, self.pol = trace, cost, pol
        self.g = trace.gpus_per_node
        self.tasks = {t.name: t for t in tasks}
        self.up = [True] * trace.nodes
        plan = solve(Problem(tasks, trace.gpus, cost))
        self.alloc = dict(plan.assignment)
        self.original = dict(plan.assignment)
        self.down_until = dict.fromkeys(self.tasks, 0.0)
        self.waiting: dict[str, set[int]] = {name: set() for name in self.tasks}
        self.queue: list[str] = []
        self.placement = self._pack()

    def _pack(self) -> list[dict[str, int]]:
        placement: list[dict[str, int]] = [{} for _ in self.up]
        slots = [n for n, ok in enumerate(self.up) for _ in range(self.g) if ok]
        i = 0
        for name, gpus in self.alloc.items():
            for node in slots[i : i + gpus]:
                placement[node][name] = placement[node].get(name, 0) + 1
            i += gpus
        return placement

    def gpus(self) -> int:
        return sum(self.up) * self.g

    def waf(self, t: float) -> float:
        total = 0.0
        for name, task in self.tasks.items():
            if self.down_until[name] > t or self.waiting[name]:
                continue
            size = fit(self.cost, task, self.alloc[name]) if self.pol.recovery == "affected" else self.alloc[name]
            total += self.cost.waf(task, size) * self.pol.efficiency
        return total

    def hold(self, name: str, until: float) -> None:
        self.down_until[name] = max(self.down_until[name], until)

    # -- policy reactions ------------------------------------------------------
    def replan(self, t: float, faulted: set[str], delay: float) -> None:
        tasks = tuple(replace(task, current=self.alloc[name], faulted=name in faulted)
                      for name, task in self.tasks.items())
        sizes = plan_sizes(Problem(tasks, self.gpus(), self.cost))  # the coordinator's re-planning code
        for name, size in sizes.items():
            if size != self.alloc[name] or name in faulted:
                self.hold(name, t + (delay if name in faulted else 0.0) + self.pol.transition["sev1"])
        self.alloc = sizes
        self.placement = self._pack()

    def on_failure(self, t: float, kind: str, node: int) -> None:
        hit = set(self.placement[node])
        if kind != "sev1":
            for name in hit:
                if not self.waiting[name]:
                    self.hold(name, t + self.pol.detect[kind] + self.pol.transition[kind])
            return
        lost = self.placement[node]
        self.up[node] = False
        self.placement[node] = {}
        if self.pol.recovery == "replan":
            self.replan(t, hit, self.pol.detect["sev1"])
        elif self.pol.recovery == "wait":
            for name in hit:
                self.waiting[name].add(node)
            self.placement[node] = lost  # the node is theirs again once repaired
        else:
            for name, gpus in lost.items():
                self.alloc[name] -= gpus
                self.hold(name, t + self.pol.detect["sev1"] + self.pol.transition["sev1"])
                if name not in self.queue:
                    self.queue.append(name)

    def on_repair(self, t: float, node: int) -> None:
        self.up[node] = True
        if self.pol.recovery == "replan":
            self.replan(t, set(), 0.0)
        elif self.pol.recovery == "wait":
            for name in self.placement[node]:
                self.waiting[name].discard(node)
                if not self.waiting[name]:
                    self.hold(name, t + self.pol.resume)
        elif self.queue:
            name = self.queue[0]
            self.alloc[name] += self.g
            self.placement[node] = {name: self.g}
            self.hold(name, t + self.pol.transition["sev1"])
            if self.alloc[name] >= self.original[name]:
                self.queue.pop(0)


def simulate(
    trace: Trace,
    tasks: tuple[PlanTask, ...],
    cost: CostModel,
    pol: Policy,
    progress: Callable[[int], None] | None = None,
) -> Result:
    """Replay ``trace`` on ``tasks`` under ``pol``.

    Args:
        trace: The failures.
        tasks: The tasks (their ``current`` is ignored: all start from the plan).
        cost: The cost model (T(t, x), failure rate, D_transition).
        pol: The policy.
        progress: Called with 1 after each trace event (for a progress bar).

    Returns:
        The WAF timeline.
    """
    cluster = _Cluster(trace, tuple(replace(t, current=0, faulted=False) for t in tasks), cost, pol)
    result = Result(pol.name, duration=trace.duration_s)
    seq = itertools.count()
    heap: list[tuple[float, int, str, int]] = []
    for e in trace.events:
        heapq.heappush(heap, (e.time_s, next(seq), e.kind, e.node))
        if e.kind == "sev1":
            heapq.heappush(heap, (e.time_s + (e.repair_s or 0.0), next(seq), "repair", e.node))
    result.record(0.0, cluster.waf(0.0), cluster.gpus())
    while heap:
        t, _, kind, node = heapq.heappop(heap)
        if t > trace.duration_s:
            break
        if kind == "repair":
            cluster.on_repair(t, node)
        elif kind != "resume":
            cluster.on_failure(t, kind, node)
            if progress is not None:
                progress(1)
        for name, until in cluster.down_until.items():
            if until > t:
                heapq.heappush(heap, (until, next(seq), "resume", -1))
        result.record(t, cluster.waf(t), cluster.gpus())
    return result
