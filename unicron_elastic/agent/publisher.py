"""``EventPublisher``: every error event of one agent, kept, counted, logged, stored in etcd and passed to the hook."""

from __future__ import annotations

import time
from typing import Any

import structlog
from prometheus_client import Counter, Histogram

from unicron_elastic.agent.seam import status_store, task_of
from unicron_elastic.api import StoreError
from unicron_elastic.events import ErrorEvent, Severity
from unicron_elastic.plugins.manager import call_isolated
from unicron_elastic.store.client import StatusStore

log = structlog.get_logger(__name__)

EVENTS = Counter("unicron_events_total", "Error events detected by this agent", ["severity", "kind", "detector"])
DETECTION = Histogram("unicron_detection_latency_seconds", "From failure to detection", ["detector"],
                      buckets=(0.01, 0.05, 0.1, 0.3, 1, 3, 10, 60))


class EventPublisher:
    """One agent's error events.

    Args:
        node: This node's name (the node of the events it builds).
        pm: The plugin manager (its ``unicron_event`` hook gets every published event).
        handler: The rendezvous handler: the ``unicron`` one gives the status store the events go to and
            the task; with another backend there is no store and the task is the run id.

    Attributes:
        events: Every published event, oldest first.
    """

    def __init__(self, node: str, pm: Any, handler: Any) -> None:
        self.node = node
        self.events: list[ErrorEvent] = []
        self._pm = pm
        self._handler = handler

    @property
    def store(self) -> StatusStore | None:
        """The etcd status store of the ``unicron`` rendezvous, if that is the backend."""
        return status_store(self._handler)

    @property
    def task(self) -> str:
        """The task the events belong to (the run id when the rendezvous names none)."""
        return task_of(self._handler)

    def publish(self, event: ErrorEvent) -> None:
        """Record, log, store and announce one event.

        The store keeps its newest ``event_retention`` events; a store error is logged, not raised.
        """
        self.events.append(event)
        EVENTS.labels(event.severity.name, event.kind, event.detector).inc()
        DETECTION.labels(event.detector).observe(max(0.0, event.latency))
        log.warning("error_event", severity=event.severity.name, kind=event.kind, detector=event.detector,
                    rank=event.rank, detected_at=event.detected_at, message=event.message[:200])
        store = self.store
        if store is not None:
            try:
                store.append_event(event.to_json())
            except StoreError as exc:
                log.error("event_publish_failed", error=str(exc))
        call_isolated(self._pm, "unicron_event", event=event)

    def event(self, severity: Severity, kind: str, detector: str, rank: int, message: str, occurred: float,
              detected: float | None = None) -> ErrorEvent:
        """An event of this node's task about ``rank`` (not published).

        Args:
            severity: Its severity.
            kind: What happened.
            detector: Who saw it.
            rank: The global rank it is about.
            message: The details.
            occurred: When it happened (wall clock).
            detected: When it was seen (default: now).

        Returns:
            The event.
        """
        return ErrorEvent(severity, kind, detector, self.node, rank=rank, task=self.task, message=message,
                          occurred_at=occurred, detected_at=time.time() if detected is None else detected)
