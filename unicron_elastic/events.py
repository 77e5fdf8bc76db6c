"""Typed error events (paper Table 1) and their JSON form in etcd."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from enum import IntEnum
from typing import Any

from unicron_elastic.api import MalformedValueError


class Severity(IntEnum):
    """Severity of a failure; lower is worse (paper section 4).

    SEV1 needs a reconfiguration (the node is unusable), SEV2 a restart of the
    failed process, SEV3 a reattempt in place.
    """

    SEV1 = 1
    SEV2 = 2
    SEV3 = 3


@dataclass(frozen=True)
class Classification:
    """What the severity table says of one exception.

    Attributes:
        severity: The severity.
        kind: Short name of the error status (``connection_reset``, ``ecc`` ...).
    """

    severity: Severity
    kind: str


@dataclass(frozen=True)
class ErrorEvent:
    """One detection, as published to ``/unicron/<cluster>/events/<seq>``.

    Attributes:
        severity: The severity.
        kind: Error status (Table 1), e.g. ``exited_abnormally``, ``task_hang``.
        detector: Name of the detector that saw it.
        node: Node name.
        rank: Global rank concerned (-1 for the node as a whole).
        task: Task (run) name.
        message: Human-readable detail.
        occurred_at: Wall-clock time the failure happened (or was last known fine).
        detected_at: Wall-clock time it was detected.
    """

    severity: Severity
    kind: str
    detector: str
    node: str
    rank: int = -1
    task: str = ""
    message: str = ""
    occurred_at: float = field(default_factory=time.time)
    detected_at: float = field(default_factory=time.time)

    @property
    def latency(self) -> float:
        """Seconds from occurrence to detection."""
        return self.detected_at - self.occurred_at

    def to_json(self) -> str:
        """The JSON document stored in etcd."""
        doc = asdict(self)
        doc["severity"] = self.severity.name
        return json.dumps(doc, sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> ErrorEvent:
        """Parse a stored event.

        Raises:
            MalformedValueError: Not an event document.
        """
        try:
            doc: dict[str, Any] = json.loads(raw)
            doc["severity"] = Severity[doc["severity"]]
            return cls(**doc)
        except (ValueError, KeyError, TypeError) as exc:
            raise MalformedValueError(f"not an ErrorEvent document: {raw[:80]!r}") from exc
