"""The coordinator's I/O: leader election, reading the cluster from etcd, executing decisions.

Level-triggered: whenever something changes under ``nodes/``, ``tasks/`` or
``events/`` (and at least once a second), the leader reads the store,
derives the events that happened since its state (:func:`~.policy.changes`),
decides them (:func:`~.policy.fold`) and writes the new plan, the per-node
commands, the task statuses and its own state in **one fenced transaction**.
A standby that takes over reads that state and the plan back; an event the
old leader had not decided is still in the store (error events are tracked by
their etcd revision), so it is decided then. What can be lost: alerts of a
decision whose leader died right after writing it, and error events trimmed by
the store's retention before any leader read them.
A deposed leader's transaction fails its fencing comparison
(:class:`~unicron_elastic.api.NotLeaderError`); it then campaigns again.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable

import structlog

from unicron_elastic.api import MalformedValueError, NotLeaderError, StoreError
from unicron_elastic.coordinator.api import ClusterPlan, NodeRecord
from unicron_elastic.coordinator.metrics import CoordinatorMetrics
from unicron_elastic.coordinator.observe import Observed, changes
from unicron_elastic.coordinator.policy import fold
from unicron_elastic.coordinator.records import read_plan, read_specs
from unicron_elastic.coordinator.sizing import DeferredTable
from unicron_elastic.coordinator.standby import state_from_json, state_from_plan, state_to_json
from unicron_elastic.coordinator.vocabulary import (
    Alert,
    ClusterState,
    Decision,
    Failure,
    NodeLost,
    PolicyConfig,
    PolicyEvent,
    WritePlan,
)
from unicron_elastic.events import ErrorEvent
from unicron_elastic.store.client import StatusStore
from unicron_elastic.store.election import LeaderElection
from unicron_elastic.store.watch import PrefixWatch

log = structlog.get_logger(__name__)


#: Most operations the coordinator puts in one etcd transaction (etcd's default limit is 128).
MAX_TXN_OPS = 120

def _event_ok(e: ErrorEvent) -> bool:
    """The fields the policy reads have the right types (``from_json`` checks only the shape)."""
    import math

    number = (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))
    return all(isinstance(getattr(e, f), str) for f in ("kind", "node", "task", "detector")) and number(e.detected_at)


def _nodes(store: StatusStore) -> tuple[dict[str, int], dict[str, int], frozenset[str]]:
    """Daemon node records: slots and lease (the record's etcd lease) of those up, and those leaving."""
    slots, leases, leaving = {}, {}, set()
    for kv in store.get_prefix(store.keys.nodes()):
        try:
            doc = json.loads(kv.value)
            record = NodeRecord.from_doc(doc, kv.value)
            state = doc.get("state", "up")
        except (MalformedValueError, ValueError, AttributeError, RecursionError):
            log.debug("not_a_daemon_node_record", key=kv.key)  # e.g. a unicron-run agent's record
            continue
        name = kv.key.rsplit("/", 1)[-1]
        if state == "up":
            slots[name], leases[name] = record.slots, kv.lease
        elif state == "leaving":
            leaving.add(name)
    return slots, leases, frozenset(leaving)


def observe(store: StatusStore, cursor: int) -> Observed:
    """Read what the policy needs from the store: error events created after revision ``cursor``.

    Events are ordered and tracked by their etcd ``create_revision`` (not by the
    writer's clock in their key), so a late or clock-skewed event is not skipped.
    A malformed event is logged and passed over.
    """
    keys = store.keys
    nodes, leases, leaving = _nodes(store)
    task_keys = [kv.key[len(keys.tasks()):] for kv in store.get_prefix(keys.tasks())]
    cancelled = frozenset(k.split("/")[0] for k in task_keys if k.endswith("/cancel"))
    done: dict[str, set[str]] = {}
    for k in task_keys:
        if "/done/" in k:
            done.setdefault(k.split("/")[0], set()).add(k.rsplit("/", 1)[-1])
    events, newest = [], cursor
    for kv in sorted(store.get_prefix(keys.events()), key=lambda kv: kv.create_revision):
        if kv.create_revision <= cursor:
            continue
        newest = max(newest, kv.create_revision)
        try:
            event = ErrorEvent.from_json(kv.value)
        except (MalformedValueError, RecursionError):
            event = None
        if event is None or not _event_ok(event):
            log.warning("malformed_event_skipped", key=kv.key)
            continue
        events.append((kv.create_revision, event))
    return Observed(nodes, tuple(read_specs(store).values()), cancelled,
                    {task: frozenset(names) for task, names in done.items()}, tuple(events), leases, newest,
                    leaving)


def task_status(state: ClusterState, name: str) -> dict:
    """The status document of one task under ``state``'s plan."""
    share = state.plan.tasks.get(name) if state.plan else None
    if name in state.finished:
        return {"state": "failed" if name in state.failed else "finished",
                "generation": state.plan.generation if state.plan else -1}
    if share is None or not share.nodes:
        return {"state": "waiting", "nodes": [], "workers": 0, "generation": state.plan.generation if state.plan else -1}
    return {"state": "running", "nodes": list(share.nodes), "workers": share.workers, "waf": share.waf,
            "parallel": share.parallel, "generation": state.plan.generation}


class Coordinator:
    """One coordinator process: a candidate for leadership, the leader's loop once elected.

    Args:
        store: The status store of the cluster.
        config: The policy's knobs.
        ttl: Lease TTL of the leader key (a dead leader is replaced within about this).
        candidate: Identity in the leader key; default ``host:pid``.
        alert: Called for every :class:`~.policy.Alert` (default: the ``unicron_alert`` hook).
        on_plan: Called after a plan was written, with the plan and the seconds from reading the store.
        metrics: Prometheus metrics to keep (None: none).
    """

    def __init__(self, store: StatusStore, config: PolicyConfig | None = None, ttl: int = 5,
                 candidate: str | None = None, alert: Callable[[Alert], None] | None = None,
                 on_plan: Callable[[ClusterPlan, float], None] | None = None,
                 metrics: CoordinatorMetrics | None = None) -> None:
        import os

        self.store = store
        self.config = config or PolicyConfig()
        self.candidate = candidate or f"{socket.gethostname()}:{os.getpid()}"
        self.election = LeaderElection(store, self.candidate, ttl=ttl)
        self.alert = alert or _hook_alert()
        self.on_plan = on_plan
        self.metrics = metrics
        self.stopped = threading.Event()
        self._wake = threading.Event()
        self.state: ClusterState | None = None
        self.cursor = 0

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> None:
        """Campaign, lead until deposed, campaign again; until :meth:`stop`."""
        while not self.stopped.is_set():
            try:
                self.election.campaign(timeout=1.0)
            except TimeoutError:
                continue
            except StoreError as exc:
                log.warning("campaign_failed", error=str(exc))
                self.stopped.wait(0.5)
                continue
            try:
                self.lead()
            except NotLeaderError as exc:
                log.warning("deposed", candidate=self.candidate, error=str(exc))
            except StoreError as exc:
                log.warning("leader_store_error", error=str(exc))
            except Exception:  # noqa: BLE001 - a bug or a value nobody foresaw must not end the coordinator
                log.exception("leader_loop_failed", candidate=self.candidate)
                self.stopped.wait(1.0)
        self.election.resign()

    def stop(self) -> None:
        """Ask :meth:`run` to return (it resigns leadership)."""
        self.stopped.set()
        self._wake.set()

    def lead(self) -> None:
        """The leader's loop: load the state, then decide whatever changes until leadership is lost.

        Raises:
            NotLeaderError: A write was refused: another leader took over.
            StoreError: etcd unreachable for longer than the store's reconnect timeout.
        """
        self.load()
        watches = [PrefixWatch(self.store, p, lambda _e: self._wake.set())
                   for p in (self.store.keys.nodes(), self.store.keys.tasks(), self.store.keys.events())]
        try:
            while not self.stopped.is_set():
                if not self.election.holds_lease():
                    raise NotLeaderError(f"{self.candidate}: the leader lease was lost")
                self._wake.clear()
                self.step()
                self._wake.wait(1.0)
        finally:
            for w in watches:
                w.cancel()

    def load(self) -> None:
        """Read the state the last leader left (or start empty, skipping older error events)."""
        specs = read_specs(self.store)
        plan = read_plan(self.store)
        kv = self.store.get(self.store.keys.coordinator_state())
        state = None
        if kv is not None:
            try:
                state, self.cursor = state_from_json(kv.value, plan, specs, self.config)
            except MalformedValueError as exc:
                log.error("malformed_coordinator_state_ignored", error=str(exc))
        if state is None:  # first leader ever, or its state is gone: older error events are history
            self.cursor = self.store.revision()
            state = ClusterState(config=self.config) if plan is None else state_from_plan(plan, specs, self.config)
        self.state = state
        self._prepare_table()
        log.info("leading", candidate=self.candidate, token=self.election.token,
                 generation=plan.generation if plan else None, tasks=[t.name for t in state.tasks])

    def step(self) -> Decision | None:
        """Read the store once and execute what the policy decides.

        Returns:
            The decision, or None if nothing changed.

        Raises:
            NotLeaderError: The write was refused.
        """
        started = time.perf_counter()
        seen = observe(self.store, self.cursor)
        events = changes(self.state, seen)
        if not events:
            return None
        decision = fold(self.state, events)
        cursor = max(self.cursor, seen.cursor)
        self.execute(decision, cursor, self.state)
        self.state, self.cursor = decision.state, cursor
        self._prepare_table()
        elapsed = time.perf_counter() - started
        for action in decision.actions:
            if isinstance(action, Alert):
                self.alert(action)
                continue
            if self.on_plan is not None:
                self.on_plan(action.plan, elapsed)
            if self.metrics is not None:
                self.metrics.planned(action.plan, elapsed, len(decision.state.finished - decision.state.failed),
                                     len(decision.state.failed))
        if self.metrics is not None:
            for event in events:
                self.metrics.decided(_severity(event))
        return decision

    def _prepare_table(self) -> None:
        """Build the one-step table of the state's plan in a thread (the plan is already written)."""
        table = self.state.table if self.state is not None else None
        if isinstance(table, DeferredTable):
            table.build_in_background()

    def execute(self, decision: Decision, cursor: int, before: ClusterState | None = None) -> None:
        """Write the decision fenced: plan, commands, changed task statuses and the state in one transaction.

        A decision of more than :data:`MAX_TXN_OPS` writes (a first plan for a
        very large cluster) goes in several fenced transactions, the plan first:
        etcd refuses larger ones (``--max-txn-ops``, default 128).

        Raises:
            NotLeaderError: This candidate is no longer the leader.
        """
        keys = self.store.keys
        state = decision.state
        puts = {keys.coordinator_state(): state_to_json(state, cursor, self.candidate)}
        commands: dict[str, str] = {}
        forget: tuple[str, ...] = ()
        for action in decision.actions:
            if isinstance(action, WritePlan):
                puts[keys.plan()] = action.plan.to_json()
                commands = {keys.command(c.node, c.generation): c.to_json() for c in action.commands}
                forget = action.forget
                for name in {t.name for t in state.tasks} | set(state.finished):
                    status = task_status(state, name)
                    if before is None or _sans_generation(task_status(before, name)) != _sans_generation(status):
                        puts[keys.task_status(name)] = json.dumps(status, sort_keys=True)
                log.info("plan_written", generation=action.plan.generation, reason=action.plan.reason,
                         tasks={n: list(t.nodes) for n, t in action.plan.tasks.items()},
                         commands=[(c.node, c.task) for c in action.commands])
        prefixes = tuple(keys.commands(n) for n in forget)
        for chunk_puts, chunk_prefixes in _chunks(list(puts.items()), prefixes, list(commands.items())):
            self.election.fenced_txn(chunk_puts, delete_prefixes=chunk_prefixes)


def _chunks(puts: list[tuple[str, str]], prefixes: tuple[str, ...],
            commands: list[tuple[str, str]]) -> list[tuple[dict[str, str], tuple[str, ...]]]:
    """The writes of one decision as transactions of at most :data:`MAX_TXN_OPS` operations each, in order.

    The state and the plan first (``puts`` begins with them), then task statuses, the forgotten nodes'
    commands deleted, the new commands: one transaction when they all fit.
    """
    ops: list[tuple[str, str | None]] = [*puts, *((p, None) for p in prefixes), *commands]
    out = []
    for i in range(0, len(ops), MAX_TXN_OPS):
        chunk = ops[i:i + MAX_TXN_OPS]
        out.append(({k: v for k, v in chunk if v is not None}, tuple(k for k, v in chunk if v is None)))
    return out


def _sans_generation(status: dict) -> dict:
    return {k: v for k, v in status.items() if k != "generation"}


def _severity(event: PolicyEvent) -> str:
    if isinstance(event, Failure):
        return event.event.severity.name
    return "SEV1" if isinstance(event, NodeLost) else "none"


def _hook_alert() -> Callable[[Alert], None]:
    """Alerts go to the ``unicron_alert`` hook of the loaded plugins."""
    from unicron_elastic.plugins.manager import call_isolated, plugin_manager

    pm = plugin_manager()

    def alert(a: Alert) -> None:
        call_isolated(pm, "unicron_alert", severity=a.severity.name, message=a.message, node=a.node, task=a.task)

    return alert
