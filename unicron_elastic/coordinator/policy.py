"""The coordinator's decisions, pure: ``decide(state, event) -> Decision``.

No I/O, no clock (events carry their time). The service feeds it what it
reads from etcd and executes the actions (one fenced transaction per plan);
the simulator sizes its plans through :func:`plan_sizes` too (the code
:func:`replan` sizes with), so ``unicron simulate`` and a live cluster choose
sizes with the same code.

Planning unit: a whole node. A task runs ``k`` nodes of ``s`` workers, where
``s`` is the smallest slot count of the usable nodes, so T(t, k) is the task's
throughput on ``k * s`` workers (its calibration table, else the analytic
Megatron model), zero outside ``min_workers..max_workers``, with more
data-parallel replicas than ``global_batch``, or when ``k * s`` is not a whole
number of replicas of ``model_parallel`` (TP x PP) workers
(:func:`replica_sizes`). Handling (paper section 4.2):

- node lost (SEV1, its lease expired): re-plan without it, its task faulted;
- node left (its daemon stopped cleanly and marked its record ``leaving``):
  re-plan without it, no alert;
- a SEV1 error event (e.g. ECC): isolate the node, re-plan, alert;
- SEV2/SEV3 error events: the node's agent handles them in place; the
  ``escalate_after``-th within ``window_s`` on one node isolates it (SEV1),
  unless the same task also failed on another node within the window: then
  the task, not the node, is suspect (an alert, no isolation: a crashing
  task must not take the cluster's nodes out one after another); the second
  and later ones raise an alert;
- node joined, task submitted, task finished or cancelled: re-plan.

One-step events (a node lost or joined, a task finished) are answered from a
:class:`~unicron_elastic.planner.OneStepTable` computed with the previous plan.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Union

from unicron_elastic.coordinator.api import ClusterPlan, Command, TaskPlan, TaskSpec
from unicron_elastic.events import ErrorEvent, Severity
from unicron_elastic.planner.cost_model import CostModel, PlanTask
from unicron_elastic.planner.onestep import Event as TableEvent
from unicron_elastic.planner.onestep import OneStepTable
from unicron_elastic.planner.solver import MAX_GPUS, Problem, solve
from unicron_elastic.planner.throughput import (
    GpuType,
    GptModel,
    TabulatedThroughput,
    estimate,
    gpu_type,
)


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of the policy.

    Attributes:
        gpu: GPU type of the analytic throughput model (tasks without calibration).
        failure_rate: lambda of the cost model, failures per GPU per second.
        d_transition: D_transition of the cost model, seconds.
        escalate_after: SEV2/SEV3 events on one node within ``window_s`` that isolate it.
        window_s: The escalation window.
    """

    gpu: str = "A800-80GB"
    failure_rate: float = 1.0 / (128 * 7 * 86400 / 4)
    d_transition: float = 60.0
    escalate_after: int = 3
    window_s: float = 600.0


# -- events ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeJoined:
    """A node daemon registered (``nodes/<node>`` appeared; ``incarnation``: its lease)."""

    node: str
    slots: int
    incarnation: int = 0


@dataclass(frozen=True)
class NodeLost:
    """A node's lease expired or its daemon left (SEV1)."""

    node: str


@dataclass(frozen=True)
class NodeLeft:
    """A node daemon that stops cleanly marked its record ``leaving`` (drained: no failure, no alert)."""

    node: str


@dataclass(frozen=True)
class TaskSubmitted:
    """A task spec was stored."""

    spec: TaskSpec


@dataclass(frozen=True)
class TaskFinished:
    """A task's workers completed (``cancelled``: the user cancelled it)."""

    task: str
    cancelled: bool = False


@dataclass(frozen=True)
class Failure:
    """An error event an agent published."""

    event: ErrorEvent


@dataclass(frozen=True)
class Replan:
    """Re-plan from the current state (a new leader, or no plan yet)."""

    reason: str = "replan"


PolicyEvent = Union[NodeJoined, NodeLost, NodeLeft, TaskSubmitted, TaskFinished, Failure, Replan]


# -- actions -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WritePlan:
    """Store ``plan`` and ``commands`` in one fenced transaction; delete the commands of ``forget``."""

    plan: ClusterPlan
    commands: tuple[Command, ...]
    forget: tuple[str, ...] = ()


@dataclass(frozen=True)
class Alert:
    """Call the ``unicron_alert`` hook."""

    severity: Severity
    message: str
    node: str = ""
    task: str = ""


Action = Union[WritePlan, Alert]


# -- state -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClusterState:
    """What the coordinator knows.

    Attributes:
        nodes: Registered nodes and their slots.
        tasks: Active tasks in submission order.
        plan: The current plan (None before the first).
        isolated: Nodes out of service.
        finished: Tasks finished, cancelled or failed.
        failed: The tasks of ``finished`` that failed (a task failing on several nodes within the window).
        failures: Per node, the times of recent SEV2/SEV3 events.
        task_failures: Per task, the (time, node) of its recent SEV2/SEV3 events.
        table: Plans for the one-step events from ``plan`` (None: none computed).
        config: The policy's knobs.
        incarnations: Per node, the lease of the daemon that registered it (a
            restarted daemon is a node lost and joined again, which ends an isolation).
    """

    nodes: Mapping[str, int] = field(default_factory=dict)
    tasks: tuple[TaskSpec, ...] = ()
    plan: ClusterPlan | None = None
    isolated: frozenset[str] = frozenset()
    finished: frozenset[str] = frozenset()
    failures: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    task_failures: Mapping[str, tuple[tuple[float, str], ...]] = field(default_factory=dict)
    table: OneStepTable | None = field(default=None, compare=False, repr=False)
    config: PolicyConfig = PolicyConfig()
    incarnations: Mapping[str, int] = field(default_factory=dict)
    failed: frozenset[str] = frozenset()

    def usable(self) -> list[str]:
        """Registered nodes not isolated, sorted."""
        return sorted(n for n in self.nodes if n not in self.isolated)

    def slots(self) -> int:
        """Workers per node in plans: the smallest slot count of the usable nodes (0 if none)."""
        return min((self.nodes[n] for n in self.usable()), default=0)


@dataclass(frozen=True)
class Decision:
    """The new state and what to do."""

    state: ClusterState
    actions: tuple[Action, ...] = ()


# -- planning ----------------------------------------------------------------------------------------
def _model(spec: TaskSpec) -> GptModel:
    if isinstance(spec.model, str):
        from unicron_elastic.planner.throughput import model

        return model(spec.model)
    if isinstance(spec.model, dict) and "calibration" not in spec.model:
        doc = dict(spec.model)
        return GptModel(name=str(doc.pop("name", spec.name)), **doc)
    return GptModel(spec.name, 1, 1, 1)


def replica_sizes(slots: int, model_parallel: int, low: int, high: int) -> tuple[int, ...]:
    """The node counts ``k`` in ``low..high`` (k >= 1) whose ``k * slots`` workers are whole replicas.

    A data-parallel replica is ``model_parallel`` (TP x PP) workers and may span
    nodes, so ``k`` must be a multiple of lcm(slots, model_parallel) / slots:
    any ``k`` when ``model_parallel`` divides ``slots``,
    ``model_parallel / slots`` when ``slots`` divides ``model_parallel``.

    Args:
        slots: Workers per node (0: no usable node, no size).
        model_parallel: Workers per replica.
        low: Fewest nodes.
        high: Most nodes.

    Returns:
        The node counts, ascending.

    Raises:
        ValueError: ``model_parallel`` below 1 or ``slots`` negative.
    """
    if model_parallel < 1 or slots < 0:
        raise ValueError(f"need model_parallel >= 1 and slots >= 0 (got {model_parallel}, {slots})")
    if slots == 0:
        return ()
    step = model_parallel // math.gcd(slots, model_parallel)
    first = -(-max(low, 1) // step) * step
    return tuple(range(first, high + 1, step))


def _throughput_at(spec: TaskSpec, workers: int, gpu: str) -> tuple[float, str]:
    """T(t) on ``workers`` workers (a whole number of replicas) and the parallel config shown for it.

    A calibration table says nothing of TP and PP: with ``model_parallel`` > 1
    the config shows their product (``tp*pp=4 dp=2``). The analytic model picks
    TP and PP itself when ``model_parallel`` is 1, else splits ``model_parallel``.
    """
    unit = spec.model_parallel
    calibration = spec.calibration
    if calibration is not None:
        shown = f"dp={workers}" if unit == 1 else f"tp*pp={unit} dp={workers // unit}"
        return calibration.get(workers, 0.0), shown
    m, g = _model(spec), gpu_type(gpu)
    est = estimate(m, g, workers, 0 if unit == 1 else unit)
    return est.flops, "" if est.config is None else f"tp={est.config.tp} pp={est.config.pp} dp={est.config.dp}"


def task_throughput(spec: TaskSpec, slots: int, nodes: int, gpu: str) -> tuple[dict[int, float], dict[int, str]]:
    """T(t, k) for k = 1..``nodes`` nodes of ``slots`` workers, and the parallel config at each.

    Only node counts of whole replicas (:func:`replica_sizes`) are tabulated:
    T is zero at the others, outside ``min_workers..max_workers`` and with
    more replicas than ``global_batch``.
    """
    table, configs = {}, {}
    for k in replica_sizes(slots, spec.model_parallel, 1, nodes):
        workers = k * slots
        if not spec.min_workers <= workers <= spec.max_workers or workers // spec.model_parallel > spec.global_batch:
            continue
        flops, config = _throughput_at(spec, workers, gpu)
        if flops > 0:
            table[k], configs[k] = flops, config
    return table, configs


def _problem(state: ClusterState, tasks: tuple[TaskSpec, ...], n: int, faulted: frozenset[str],
             horizon: int | None = None) -> Problem:
    """The planning problem in node units; x of each task is its node count under the current plan.

    Args:
        horizon: Largest node count T is tabulated for (default ``n``).
    """
    slots = state.slots()
    held = {} if state.plan is None else {name: len(share.nodes) for name, share in state.plan.tasks.items()}
    table = {t.name: task_throughput(t, slots, max(horizon or n, 1), state.config.gpu)[0] for t in tasks}
    cost = CostModel(TabulatedThroughput(table), state.config.failure_rate, state.config.d_transition)
    plan_tasks = tuple(
        PlanTask(t.name, GptModel(t.name, 1, 1, 1), t.weight, 1, held.get(t.name, 0), t.name in faulted)
        for t in tasks
    )
    return Problem(plan_tasks, min(n, MAX_GPUS), cost)


def _current_nodes(state: ClusterState) -> dict[str, tuple[str, ...]]:
    """Each task's nodes under the current plan that are still usable."""
    if state.plan is None:
        return {}
    usable = set(state.usable())
    return {name: tuple(n for n in share.nodes if n in usable) for name, share in state.plan.tasks.items()}


def place(counts: Mapping[str, int], current: Mapping[str, tuple[str, ...]], usable: list[str]) -> dict[str, tuple[str, ...]]:
    """Put each task on ``counts[task]`` nodes, keeping it where it runs.

    A task keeps its first current nodes (sorted) up to its count; the free
    nodes (sorted) then fill the remaining counts in task order.

    Raises:
        ValueError: The counts need more nodes than ``usable`` has.
    """
    if sum(counts.values()) > len(usable):
        raise ValueError(f"the plan needs {sum(counts.values())} nodes but only {len(usable)} are usable")
    kept = {name: tuple(sorted(n for n in current.get(name, ()) if n in usable))[:k] for name, k in counts.items()}
    taken = {n for nodes in kept.values() for n in nodes}
    free = [n for n in usable if n not in taken]
    out = {}
    for name, k in counts.items():
        extra, free = free[: k - len(kept[name])], free[k - len(kept[name]):]
        out[name] = tuple(sorted(kept[name] + tuple(extra)))
    return out


def plan_sizes(problem: Problem, table: OneStepTable | None = None, event: TableEvent | None = None) -> dict[str, int]:
    """The planner's sizes for ``problem``: from the one-step table when it holds ``event``, else solved.

    The coordinator (node units) and the simulator (GPU units) both re-plan through this.
    """
    if event is not None and table is not None:
        try:
            counts = dict(table.lookup(event).assignment)
        except KeyError:
            counts = None
        if counts is not None and set(counts) == {t.name for t in problem.tasks}:
            return counts
    return dict(solve(problem).assignment)


def replan(state: ClusterState, faulted: frozenset[str] = frozenset(), reason: str = "replan",
           lookup: TableEvent | None = None) -> ClusterState:
    """The state with a new plan (generation + 1) for its nodes and tasks.

    Args:
        state: The state after the event (nodes, tasks, isolation updated).
        faulted: Tasks that lost workers (the transition indicator is 1).
        reason: Recorded in the plan, for people.
        lookup: The one-step event, if it is one: the plan comes from the table.

    Returns:
        The state with the new plan and a fresh one-step table.
    """
    usable = state.usable()
    counts = plan_sizes(_problem(state, state.tasks, len(usable), faulted), state.table, lookup)
    nodes = place(counts, _current_nodes(state), usable)
    slots = state.slots()
    shares = {}
    for spec in state.tasks:
        k = counts[spec.name]
        flops, configs = task_throughput(spec, slots, max(k, 1), state.config.gpu)
        shares[spec.name] = TaskPlan(nodes[spec.name], k * slots, spec.weight * flops.get(k, 0.0) if k else 0.0,
                                     configs.get(k, "") if k else "")
    generation = 0 if state.plan is None else state.plan.generation + 1
    plan = ClusterPlan(generation, shares, {u: state.nodes[u] for u in usable}, tuple(sorted(state.isolated)),
                       tuple(sorted(state.finished)), reason, tuple(sorted(state.failed)))
    planned = replace(state, plan=plan, table=None)
    return replace(planned, table=_table(planned))


def _table(state: ClusterState) -> OneStepTable | None:
    """The one-step table from ``state``'s plan, in node units (T tabulated up to one node more)."""
    if state.plan is None:
        return None
    n = len(state.usable())
    return OneStepTable(_problem(state, state.tasks, n, frozenset(), horizon=n + 1), 1)


def commands(old: ClusterPlan | None, new: ClusterPlan, nodes: list[str]) -> tuple[Command, ...]:
    """A command for every node whose task changes between ``old`` and ``new`` (and every node of a first plan)."""
    out = []
    for node in nodes:
        task = new.task_of(node)
        if old is not None and old.task_of(node) == task:
            continue
        share = new.tasks.get(task) if task else None
        out.append(Command(node, new.generation, task, len(share.nodes) if share else 0, share.workers if share else 0))
    return tuple(out)


def _write(old: ClusterState, new: ClusterState) -> WritePlan:
    """The plan of ``new`` with commands for the registered nodes whose task changed since ``old``."""
    cmds = commands(old.plan, new.plan, sorted(new.nodes))
    return WritePlan(new.plan, cmds, tuple(sorted(set(old.nodes) - set(new.nodes))))


def _with_plan(state: ClusterState, new: ClusterState, *alerts: Alert) -> Decision:
    return Decision(new, (*alerts, _write(state, new)))


# -- decide ------------------------------------------------------------------------------------------
def _owners(state: ClusterState, node: str) -> frozenset[str]:
    task = state.plan.task_of(node) if state.plan else None
    return frozenset({task}) if task else frozenset()


def _isolate(state: ClusterState, node: str, why: str, alerts: tuple[Alert, ...]) -> Decision:
    hit = _owners(state, node)
    after = replace(state, isolated=state.isolated | {node}, failures={k: v for k, v in state.failures.items() if k != node},
                    task_failures={t: tuple(f for f in v if f[1] != node) for t, v in state.task_failures.items()})
    new = replan(after, hit, f"isolated {node}: {why}")
    return _with_plan(state, new, *alerts, Alert(Severity.SEV1, f"node {node} isolated: {why}", node, ",".join(hit)))


def _fail_task(state: ClusterState, task: str, why: str) -> Decision:
    """Take ``task`` out: failed (never planned again, like a finished one), its nodes to the others, an alert.

    No node is isolated: a script that crashes must not take the cluster's nodes out one after another.
    """
    rest = tuple(t for t in state.tasks if t.name != task)
    explained = {(t, n) for t, n in state.task_failures.get(task, ())}  # the task's failures, not the nodes'
    failures = {n: tuple(t for t in times if (t, n) not in explained) for n, times in state.failures.items()}
    after = replace(state, tasks=rest, finished=state.finished | {task}, failed=state.failed | {task},
                    failures={n: times for n, times in failures.items() if times},
                    task_failures={k: v for k, v in state.task_failures.items() if k != task})
    new = replan(after, reason=f"task {task} failed", lookup=TableEvent("task_finished", frozenset({task})))
    return _with_plan(state, new, Alert(Severity.SEV1, f"task {task} failed: {why}", "", task))


def _on_failure(state: ClusterState, e: ErrorEvent) -> Decision:
    if e.node not in state.nodes or e.node in state.isolated or e.kind == "lost_connection":
        return Decision(state)  # node loss comes from the node registry itself (NodeLost)
    if e.task and e.task in state.finished:
        return Decision(state)  # a late event of a task that finished or failed: explained by it
    if e.severity == Severity.SEV1:
        return _isolate(state, e.node, f"{e.kind} ({e.message})", ())
    cfg = state.config
    recent = tuple(t for t in state.failures.get(e.node, ()) if e.detected_at - t < cfg.window_s) + (e.detected_at,)
    by_task = dict(state.task_failures)
    if e.task:
        by_task[e.task] = tuple(f for f in by_task.get(e.task, ()) if e.detected_at - f[0] < cfg.window_s) + (
            (e.detected_at, e.node),)
    after = replace(state, failures={**state.failures, e.node: recent}, task_failures=by_task)
    if len(recent) >= cfg.escalate_after:
        elsewhere = sorted({n for _, n in by_task.get(e.task, ()) if n != e.node}) if e.task else []
        if elsewhere:
            return _fail_task(after, e.task, f"failures on nodes {e.node}, {', '.join(elsewhere)} within "
                                             f"{cfg.window_s:g} s (last: {e.kind}): the task, not a node, is suspect")
        why = f"{len(recent)} failures within {cfg.window_s:g} s (last: {e.kind})"
        return _isolate(after, e.node, why, ())  # (its failures are explained: forgotten with it)
    if len(recent) >= 2:
        return Decision(after, (Alert(e.severity, f"node {e.node}: {len(recent)} failures within {cfg.window_s:g} s "
                                      f"(last: {e.kind})", e.node, e.task),))
    return Decision(after)


def decide(state: ClusterState, event: PolicyEvent) -> Decision:
    """The coordinator's reaction to one event.

    Args:
        state: What the coordinator knows.
        event: What happened.

    Returns:
        The new state and the actions (a :class:`WritePlan` when the plan changes).

    Raises:
        TypeError: ``event`` is not a policy event.
    """
    if isinstance(event, NodeJoined):
        if state.nodes.get(event.node) == event.slots:
            return Decision(state)
        after = replace(state, nodes={**state.nodes, event.node: event.slots},
                        incarnations={**state.incarnations, event.node: event.incarnation})
        one_step = event.node not in state.nodes and after.slots() == state.slots()  # the table is in these units
        new = replan(after, reason=f"node {event.node} joined", lookup=TableEvent("node_joined") if one_step else None)
        return _with_plan(state, new)
    if isinstance(event, (NodeLost, NodeLeft)):
        return _without_node(state, event.node, lost=isinstance(event, NodeLost))
    if isinstance(event, TaskSubmitted):
        if any(t.name == event.spec.name for t in state.tasks) or event.spec.name in state.finished:
            return Decision(state)
        new = replan(replace(state, tasks=(*state.tasks, event.spec)), reason=f"task {event.spec.name} submitted")
        return _with_plan(state, new)
    if isinstance(event, TaskFinished):
        if not any(t.name == event.task for t in state.tasks):
            return Decision(state)
        rest = tuple(t for t in state.tasks if t.name != event.task)
        word = "cancelled" if event.cancelled else "finished"
        new = replan(replace(state, tasks=rest, finished=state.finished | {event.task}), reason=f"task {event.task} {word}",
                     lookup=TableEvent("task_finished", frozenset({event.task})))
        return _with_plan(state, new)
    if isinstance(event, Failure):
        return _on_failure(state, event.event)
    if isinstance(event, Replan):
        return _with_plan(state, replan(state, reason=event.reason))
    raise TypeError(f"not a policy event: {event!r}")


def _without_node(state: ClusterState, node: str, lost: bool) -> Decision:
    """Re-plan without ``node``: lost (SEV1, an alert) or left (drained by its daemon, no alert)."""
    if node not in state.nodes:
        return Decision(state)
    hit = _owners(state, node)
    rest = {k: v for k, v in state.nodes.items() if k != node}
    after = replace(state, nodes=rest, isolated=state.isolated - {node},
                    incarnations={k: v for k, v in state.incarnations.items() if k != node})
    one_step = node not in state.isolated and after.slots() == state.slots()
    reason = f"node {node} lost (SEV1)" if lost else f"node {node} left"
    new = replan(after, hit, reason, TableEvent("node_lost", hit) if one_step else None)
    if not lost:
        return _with_plan(state, new)
    return _with_plan(state, new, Alert(Severity.SEV1, f"node {node} lost", node, ",".join(hit)))


def fold(state: ClusterState, events: list[PolicyEvent]) -> Decision:
    """Decide a batch of events: every alert, and one :class:`WritePlan` from ``state``'s plan to the last one.

    Raises:
        TypeError: An event is not a policy event.
    """
    current, alerts = state, []
    for event in events:
        decision = decide(current, event)
        alerts += [a for a in decision.actions if isinstance(a, Alert)]
        current = decision.state
    if current.plan is not state.plan:
        generation = 0 if state.plan is None else state.plan.generation + 1  # one generation per plan written
        current = replace(current, plan=replace(current.plan, generation=generation))
        return Decision(current, (*alerts, _write(state, current)))
    return Decision(current, tuple(alerts))


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
        incarnations: Per node, the lease its record is attached to.
        cursor: The newest error event's revision read (malformed ones included).
        leaving: Nodes whose daemon marked its record ``leaving`` (not in ``nodes``).
    """

    nodes: Mapping[str, int] = field(default_factory=dict)
    specs: tuple[TaskSpec, ...] = ()
    cancelled: frozenset[str] = frozenset()
    done: Mapping[str, frozenset[str]] = field(default_factory=dict)
    events: tuple[tuple[int, ErrorEvent], ...] = ()
    incarnations: Mapping[str, int] = field(default_factory=dict)
    cursor: int = 0
    leaving: frozenset[str] = frozenset()


def changes(state: ClusterState, seen: Observed) -> list[PolicyEvent]:
    """The events that turn ``state`` into what the store shows, worst first.

    Nodes lost or left, then nodes joined, tasks finished or cancelled, tasks
    submitted, error events; :class:`Replan` if there is no plan yet.
    """
    def restarted(n: str) -> bool:  # the same name, another daemon (a new lease): lost, then joined again
        known, now = state.incarnations.get(n), seen.incarnations.get(n)
        return n in seen.nodes and known is not None and now is not None and known != now

    out: list[PolicyEvent] = [NodeLeft(n) if n in seen.leaving and n not in seen.nodes else NodeLost(n)
                              for n in sorted(state.nodes) if n not in seen.nodes or restarted(n)]
    out += [NodeJoined(n, k, seen.incarnations.get(n, 0)) for n, k in sorted(seen.nodes.items())
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


# -- the state's JSON form (``coordinator/state``) ---------------------------------------------------
def state_to_json(state: ClusterState, cursor: int, leader: str) -> str:
    """What a standby needs to take over (besides the plan and the specs).

    Args:
        state: The state.
        cursor: Sequence number of the last error event decided.
        leader: Who wrote it.
    """
    import json

    return json.dumps({"nodes": dict(state.nodes), "incarnations": dict(state.incarnations),
                       "tasks": [t.name for t in state.tasks],
                       "isolated": sorted(state.isolated), "finished": sorted(state.finished),
                       "failed": sorted(state.failed),
                       "failures": {k: list(v) for k, v in state.failures.items()},
                       "task_failures": {k: [list(f) for f in v] for k, v in state.task_failures.items()},
                       "cursor": cursor,
                       "leader": leader, "generation": state.plan.generation if state.plan else -1}, sort_keys=True)


def state_from_json(raw: str | bytes, plan: ClusterPlan | None, specs: Mapping[str, TaskSpec],
                    config: PolicyConfig) -> tuple[ClusterState, int]:
    """The state a leader wrote, and its event cursor; tasks whose spec is gone are dropped.

    Raises:
        MalformedValueError: Wrong shape.
    """
    import json

    from unicron_elastic.api import MalformedValueError

    try:
        doc = json.loads(raw)
        state = ClusterState(
            nodes={str(k): int(v) for k, v in doc["nodes"].items()},
            tasks=tuple(specs[name] for name in doc["tasks"] if name in specs),
            plan=plan, isolated=frozenset(doc["isolated"]), finished=frozenset(doc["finished"]),
            failures={str(k): tuple(float(t) for t in v) for k, v in doc["failures"].items()}, config=config,
            task_failures={str(k): tuple((float(t), str(n)) for t, n in v)
                           for k, v in doc.get("task_failures", {}).items()},
            incarnations={str(k): int(v) for k, v in doc.get("incarnations", {}).items()},
            failed=frozenset(str(t) for t in doc.get("failed", ())))
        return replace(state, table=_table(state)), int(doc["cursor"])
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError, OverflowError) as exc:
        raise MalformedValueError(f"not a coordinator state document: {exc}") from None


def state_from_plan(plan: ClusterPlan, specs: Mapping[str, TaskSpec], config: PolicyConfig) -> ClusterState:
    """The state implied by a stored plan alone (when ``coordinator/state`` is gone or unreadable).

    The plan's generation goes on from there, so daemons keep following it.
    """
    state = ClusterState(nodes=dict(plan.nodes), tasks=tuple(specs[n] for n in plan.tasks if n in specs), plan=plan,
                         isolated=frozenset(plan.isolated), finished=frozenset(plan.finished), config=config,
                         failed=frozenset(plan.failed))
    return replace(state, table=_table(state))
