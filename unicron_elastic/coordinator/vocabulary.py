"""The coordinator policy's vocabulary, pure data: its knobs, the cluster state it folds, the events it takes,
the actions it returns (:mod:`~unicron_elastic.coordinator.policy` decides)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, Union

from unicron_elastic.coordinator.api import ClusterPlan, Command, TaskSpec
from unicron_elastic.events import ErrorEvent, Severity
from unicron_elastic.planner.onestep import Event as TableEvent
from unicron_elastic.planner.solver import Plan


class OneStepLookup(Protocol):
    """What the policy asks of a one-step table (a :class:`~unicron_elastic.planner.OneStepTable`, or the
    coordinator's :class:`~unicron_elastic.coordinator.sizing.DeferredTable`)."""

    def lookup(self, event: TableEvent) -> Plan:
        """The precomputed plan for ``event``.

        Raises:
            KeyError: None is at hand: the caller solves.
        """


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
    """A node daemon registered (``nodes/<node>`` appeared; ``lease``: its lease)."""

    node: str
    slots: int
    lease: int = 0


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
        leases: Per node, the lease of the daemon that registered it (a
            restarted daemon is a node lost and joined again, which ends an isolation).
    """

    nodes: Mapping[str, int] = field(default_factory=dict)
    tasks: tuple[TaskSpec, ...] = ()
    plan: ClusterPlan | None = None
    isolated: frozenset[str] = frozenset()
    finished: frozenset[str] = frozenset()
    failures: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    task_failures: Mapping[str, tuple[tuple[float, str], ...]] = field(default_factory=dict)
    table: OneStepLookup | None = field(default=None, compare=False, repr=False)
    config: PolicyConfig = PolicyConfig()
    leases: Mapping[str, int] = field(default_factory=dict)
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
