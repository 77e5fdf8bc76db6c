"""The default plugin: built-in behaviour, registered like any other plugin.

The agent's built-in detectors are a plugin of the agent's own (:mod:`unicron_elastic.agent.detectors`,
registered by the agent through ``plugin_manager(builtins=...)``): plugins stay below the agent.
"""

from __future__ import annotations

from unicron_elastic.detection.severity import classify
from unicron_elastic.events import Classification
from unicron_elastic.plugins import hookimpl


@hookimpl(trylast=True)
def unicron_classify_exception(exc_type: str, message: str, traceback: str) -> Classification:
    """The severity table of paper Table 1 (see ``detection/severity.py``)."""
    return classify(exc_type, message)


@hookimpl
def unicron_alert(severity: str, message: str, node: str, task: str) -> None:
    """Log the alert (``alert`` at warning level, logger ``unicron_elastic.plugins.builtin``)."""
    import structlog

    structlog.get_logger(__name__).warning("alert", severity=severity, message=message, node=node, task=task)
