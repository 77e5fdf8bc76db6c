"""The coordinator's state in the store (``coordinator/state``): what a standby reloads when it becomes leader."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from unicron_elastic.coordinator.api import ClusterPlan, TaskSpec
from unicron_elastic.coordinator.sizing import one_step_table
from unicron_elastic.coordinator.vocabulary import ClusterState, PolicyConfig


# -- the state's JSON form (``coordinator/state``) ---------------------------------------------------
def state_to_json(state: ClusterState, cursor: int, leader: str) -> str:
    """What a standby needs to take over (besides the plan and the specs).

    Args:
        state: The state.
        cursor: Sequence number of the last error event decided.
        leader: Who wrote it.
    """
    import json

    return json.dumps({"nodes": dict(state.nodes), "leases": dict(state.leases),
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
            leases={str(k): int(v) for k, v in doc.get("leases", {}).items()},
            failed=frozenset(str(t) for t in doc.get("failed", ())))
        return replace(state, table=one_step_table(state)), int(doc["cursor"])
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError, OverflowError) as exc:
        raise MalformedValueError(f"not a coordinator state document: {exc}") from None


def state_from_plan(plan: ClusterPlan, specs: Mapping[str, TaskSpec], config: PolicyConfig) -> ClusterState:
    """The state implied by a stored plan alone (when ``coordinator/state`` is gone or unreadable).

    The plan's generation goes on from there, so daemons keep following it.
    """
    state = ClusterState(nodes=dict(plan.nodes), tasks=tuple(specs[n] for n in plan.tasks if n in specs), plan=plan,
                         isolated=frozenset(plan.isolated), finished=frozenset(plan.finished), config=config,
                         failed=frozenset(plan.failed))
    return replace(state, table=one_step_table(state))
