"""Prometheus metrics of the coordinator (``unicron-coordinator --metrics-port``)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from unicron_elastic.coordinator.api import ClusterPlan

#: Task states counted by ``unicron_tasks``.
TASK_STATES = ("running", "waiting", "finished", "failed")


@dataclass
class CoordinatorMetrics:
    """The coordinator's metrics in their own registry.

    Attributes:
        generation: ``unicron_plan_generation``, the plan's generation.
        replan: ``unicron_replan_seconds``, from reading the store to the plan written.
        waf: ``unicron_cluster_waf``, the plan's cluster WAF.
        tasks: ``unicron_tasks{state}``, tasks by state.
        events: ``unicron_coordinator_events_total{severity}``, events decided by severity.
    """

    registry: CollectorRegistry
    generation: Gauge
    replan: Histogram
    waf: Gauge
    tasks: Gauge
    events: Counter

    @classmethod
    def create(cls) -> CoordinatorMetrics:
        """Fresh metrics in a new registry."""
        r = CollectorRegistry()
        return cls(
            r,
            Gauge("unicron_plan_generation", "Generation of the current plan", registry=r),
            Histogram("unicron_replan_seconds", "Seconds from reading the store to the new plan written",
                      buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5), registry=r),
            Gauge("unicron_cluster_waf", "Cluster weighted achieved FLOP/s of the plan", registry=r),
            Gauge("unicron_tasks", "Tasks by state", ["state"], registry=r),
            Counter("unicron_coordinator_events_total", "Events decided, by severity", ["severity"], registry=r),
        )

    @classmethod
    def serve(cls, port: int) -> CoordinatorMetrics:
        """Fresh metrics served over HTTP on ``port``.

        Raises:
            OSError: The port is taken.
        """
        metrics = cls.create()
        start_http_server(port, registry=metrics.registry)
        return metrics

    def planned(self, plan: ClusterPlan, seconds: float, finished: int, failed: int = 0) -> None:
        """Record a plan written ``seconds`` after the store was read (``finished``: finished or cancelled)."""
        self.generation.set(plan.generation)
        self.replan.observe(seconds)
        self.waf.set(plan.waf)
        running = sum(1 for t in plan.tasks.values() if t.nodes)
        self.tasks.labels("running").set(running)
        self.tasks.labels("waiting").set(len(plan.tasks) - running)
        self.tasks.labels("finished").set(finished)
        self.tasks.labels("failed").set(failed)

    def decided(self, severity: str) -> None:
        """Count one decided event of ``severity`` (``SEV1``..``SEV3``, or ``none`` for joins and tasks)."""
        self.events.labels(severity).inc()
