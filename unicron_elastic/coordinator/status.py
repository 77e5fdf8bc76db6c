"""What ``unicron status`` and ``unicron task list`` show of a coordinated cluster (read-only).

:func:`cluster_status` reads one consistent-enough picture (nodes, tasks, the
plan, the leader, recent events) as a JSON-ready dict; :func:`render_tasks`
and :func:`render_plan` turn it into fixed-width text for a person. Text from
the store is stripped of control characters; a malformed spec, plan or event
is shown as such and a status field of the wrong type is left out.
"""

from __future__ import annotations

import json
from typing import Any

from unicron_elastic.api import MalformedValueError
from unicron_elastic.coordinator.api import ClusterPlan, NodeRecord, SpecError, TaskSpec
from unicron_elastic.events import ErrorEvent


def _clean(text: object, width: int = 64) -> str:
    return "".join(c if c.isprintable() else "?" for c in str(text))[:width]


def _json(value: bytes) -> Any:
    try:
        return json.loads(value)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


def _checked_status(status: dict[str, Any]) -> dict[str, Any]:
    """The fields of a stored task status that have the right types (others are dropped)."""
    import math

    out: dict[str, Any] = {}
    if isinstance(status.get("state"), str):
        out["state"] = status["state"]
    nodes = status.get("nodes")
    if isinstance(nodes, list) and all(isinstance(n, str) for n in nodes):
        out["nodes"] = nodes
    for key, kind in (("workers", int), ("waf", (int, float))):
        value = status.get(key)
        if isinstance(value, kind) and not isinstance(value, bool) and math.isfinite(value):
            out[key] = value
    if isinstance(status.get("parallel"), str):
        out["parallel"] = status["parallel"]
    return out


def read_tasks(store) -> list[dict[str, Any]]:
    """Every task with its spec fields and status (``state`` ``malformed`` for a bad spec)."""
    keys = store.keys
    by_task: dict[str, dict[str, Any]] = {}
    for kv in sorted(store.get_prefix(keys.tasks()), key=lambda kv: kv.create_revision):
        name, _, rest = kv.key[len(keys.tasks()):].partition("/")
        entry = by_task.setdefault(name, {"name": name, "state": "submitted"})
        if rest == "spec":
            try:
                spec = TaskSpec.from_dict(_json(kv.value), check_command=False)
                entry.update(weight=spec.weight, min_workers=spec.min_workers, max_workers=spec.max_workers,
                             global_batch=spec.global_batch, command=list(spec.command))
            except SpecError as exc:
                entry.update(state="malformed", error=str(exc))
        elif rest == "status":
            status = _json(kv.value)
            if isinstance(status, dict) and entry["state"] != "malformed":
                entry.update(_checked_status(status))
        elif rest == "cancel" and entry["state"] not in ("finished", "failed", "malformed"):
            entry["state"] = "cancelling"
    return list(by_task.values())


def read_nodes(store) -> list[dict[str, Any]]:
    """Every node record: daemons' (with slots) and ``unicron-run`` agents' (without)."""
    out = []
    for kv in store.get_prefix(store.keys.nodes()):
        name = kv.key.rsplit("/", 1)[-1]
        try:
            record = NodeRecord.from_json(kv.value)
            doc = _json(kv.value) or {}
            out.append({"name": name, "slots": record.slots, "state": str(doc.get("state", "up"))})
        except MalformedValueError:
            doc = _json(kv.value)
            state = doc.get("state") if isinstance(doc, dict) else None
            out.append({"name": name, "slots": None, "state": state if isinstance(state, str) else "malformed"})
    return out


def read_events(store, limit: int) -> list[dict[str, Any]]:
    """The newest ``limit`` error events, oldest first (malformed ones as ``{"malformed": key}``)."""
    out = []
    for kv in reversed(store.get_prefix(store.keys.events(), limit=limit, descending=True)):
        try:
            e = ErrorEvent.from_json(kv.value)
            out.append({"severity": e.severity.name, "kind": str(e.kind), "node": str(e.node), "rank": e.rank,
                        "task": str(e.task), "message": str(e.message), "detected_at": e.detected_at})
        except (MalformedValueError, AttributeError):
            out.append({"malformed": kv.key})
    return out


def cluster_status(store, limit: int = 10) -> dict[str, Any]:
    """Nodes, tasks, plan, leader and the newest ``limit`` events, as one JSON-ready dict."""
    keys = store.keys
    plan_kv = store.get(keys.plan())
    plan: dict[str, Any] | None = None
    if plan_kv is not None:
        try:
            p = ClusterPlan.from_json(plan_kv.value)
            plan = {"generation": p.generation, "reason": p.reason, "waf": p.waf, "isolated": list(p.isolated),
                    "tasks": {n: {"nodes": list(t.nodes), "workers": t.workers, "waf": t.waf, "parallel": t.parallel}
                              for n, t in p.tasks.items()}}
        except MalformedValueError:
            plan = {"malformed": keys.plan()}
    leader = store.get(keys.leader())
    nodes = read_nodes(store)
    if plan and "tasks" in plan:
        for node in nodes:
            node["task"] = next((n for n, t in plan["tasks"].items() if node["name"] in t["nodes"]), None)
            if node["name"] in plan["isolated"]:
                node["state"] = "isolated"
    return {"cluster": store.config.cluster, "endpoint": store.config.endpoint,
            "leader": leader.value.decode(errors="replace") if leader else None,
            "plan": plan, "nodes": nodes, "tasks": read_tasks(store), "events": read_events(store, limit)}


def render_tasks(tasks: list[dict[str, Any]]) -> str:
    """The task table."""
    if not tasks:
        return "  (none)"
    lines = [f"  {'TASK':<20} {'STATE':<11} {'WEIGHT':>6} {'WORKERS':>9} {'WAF':>10}  {'PARALLEL':<14} NODES"]
    for t in tasks:
        span = f"{t.get('workers', 0)}/{t.get('min_workers', '?')}-{t.get('max_workers', '?')}"
        waf = t.get("waf")
        lines.append(f"  {_clean(t['name'], 20):<20} {_clean(t['state'], 11):<11} {t.get('weight', 0):>6.2f} "
                     f"{span:>9} {'' if waf is None else f'{waf:.3g}':>10}  {_clean(t.get('parallel', ''), 14):<14} "
                     f"{','.join(_clean(n, 32) for n in t.get('nodes', []))}")
    return "\n".join(lines)


def render_plan(status: dict[str, Any]) -> str:
    """Leader, plan and tasks, as text (the nodes and events come from ``render_status``)."""
    plan = status["plan"]
    lines = [f"coordinator: {_clean(status['leader']) if status['leader'] else '(no leader)'}"]
    if plan is None:
        lines.append("plan: (none yet)")
    elif "malformed" in plan:
        lines.append(f"plan: (malformed value at {_clean(plan['malformed'])})")
    else:
        lines.append(f"plan: generation {plan['generation']}, cluster WAF {plan['waf']:.4g} "
                     f"({_clean(plan['reason'], 80)})")
        if plan["isolated"]:
            lines.append(f"isolated nodes: {', '.join(_clean(n) for n in plan['isolated'])}")
    lines += ["", "tasks:", render_tasks(status["tasks"])]
    return "\n".join(lines)
