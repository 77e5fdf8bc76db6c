"""The coordinator's decisions, pure: ``decide(state, event) -> Decision``.

No I/O, no clock (events carry their time). The service feeds it what it
reads from etcd and executes the actions (one fenced transaction per plan);
the simulator sizes its plans with the same code as :func:`replan`
(:func:`~unicron_elastic.coordinator.sizing.plan_sizes`).

Sizes and placement are :mod:`~unicron_elastic.coordinator.sizing`'s (in
whole nodes), the events come from :mod:`~unicron_elastic.coordinator.observe`,
the vocabulary is :mod:`~unicron_elastic.coordinator.vocabulary`. Handling
(paper section 4.2):

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

from dataclasses import replace

from unicron_elastic.coordinator.api import ClusterPlan, TaskPlan
from unicron_elastic.events import ErrorEvent, Severity
from unicron_elastic.planner.onestep import Event as TableEvent
from unicron_elastic.coordinator.sizing import (
    current_nodes,
    one_step_table,
    place,
    plan_sizes,
    problem_of,
    task_throughput,
)
from unicron_elastic.coordinator.transition import commands
from unicron_elastic.coordinator.vocabulary import (
    Alert,
    ClusterState,
    Decision,
    Failure,
    NodeJoined,
    NodeLeft,
    NodeLost,
    PolicyEvent,
    Replan,
    TaskFinished,
    TaskSubmitted,
    WritePlan,
)


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
    counts = plan_sizes(problem_of(state, state.tasks, len(usable), faulted), state.table, lookup)
    nodes = place(counts, current_nodes(state), usable)
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
    return replace(planned, table=one_step_table(planned))


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
                        leases={**state.leases, event.node: event.lease})
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
                    leases={k: v for k, v in state.leases.items() if k != node})
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
