"""The default plugin: built-in behaviour, registered like any other plugin."""

from __future__ import annotations

from typing import TYPE_CHECKING

from unicron_elastic.detection.severity import classify
from unicron_elastic.events import Classification
from unicron_elastic.plugins import hookimpl

if TYPE_CHECKING:
    from unicron_elastic.agent.api import AgentConfig, Detector


@hookimpl(trylast=True)
def unicron_classify_exception(exc_type: str, message: str, traceback: str) -> Classification:
    """The severity table of paper Table 1 (see ``detection/severity.py``)."""
    return classify(exc_type, message)


@hookimpl
def unicron_detectors(config: AgentConfig) -> list[Detector]:
    """The built-in detectors of paper Table 1 plus NVML."""
    from unicron_elastic.agent.detectors import (
        ExceptionDetector,
        HangDetector,
        NodeHealthDetector,
        NvmlDetector,
        ProcessDetector,
    )

    return [
        NodeHealthDetector(ttl=config.node_ttl),
        ProcessDetector(),
        ExceptionDetector(),
        HangDetector(config.hang),
        NvmlDetector(),
    ]


@hookimpl
def unicron_alert(severity: str, message: str, node: str, task: str) -> None:
    """Log the alert (``alert`` at warning level, logger ``unicron_elastic.plugins.builtin``)."""
    import structlog

    structlog.get_logger(__name__).warning("alert", severity=severity, message=message, node=node, task=task)
