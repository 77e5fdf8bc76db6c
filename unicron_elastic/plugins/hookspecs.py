"""Every pluggy hook of unicron_elastic (hooks are named ``unicron_*``).

Third-party plugins register through the entry-point group ``unicron_elastic``
and implement any of these with ``@unicron_elastic.plugins.hookimpl``. Every
hook is documented in docs/hooks.md (a test enforces it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from unicron_elastic.agent.api import AgentConfig, Detector
    from unicron_elastic.events import Classification, ErrorEvent

PROJECT = "unicron_elastic"
hookspec = pluggy.HookspecMarker(PROJECT)


@hookspec(firstresult=True)
def unicron_classify_exception(exc_type: str, message: str, traceback: str) -> Classification | None:
    """Classify an exception a worker reported (exception propagation, Table 1).

    The first plugin that returns a classification wins; the built-in severity
    table is registered ``trylast``, so plugins extend or override it.

    Args:
        exc_type: Type name of the exception.
        message: Its message.
        traceback: The formatted traceback (may be empty).
    """


@hookspec
def unicron_detectors(config: AgentConfig) -> list[Detector]:
    """Provide detectors for the agent; it runs those named in ``--detectors``.

    The default plugin provides ``node``, ``process``, ``exception``, ``hang``
    and ``nvml``. A plugin adds its own (with new names) and the user enables
    them with ``--detectors``.

    Args:
        config: The agent's configuration (thresholds, node name, ...).
    """


@hookspec
def unicron_event(event: ErrorEvent) -> None:
    """Called for every error event the agent detects, after it was published.

    Args:
        event: The event.
    """


@hookspec
def unicron_action(action: str, event: ErrorEvent, detail: dict) -> None:
    """Called when the agent takes an action (reattempt, restart_worker, give_up ...).

    Args:
        action: The action's name.
        event: The event that caused it.
        detail: Action-specific data (rank, attempt, ...).
    """


@hookspec
def unicron_alert(severity: str, message: str, node: str, task: str) -> None:
    """Called by the coordinator on SEV1 (a node lost or isolated) and on repeated failures of a node.

    The built-in implementation writes a log line (``alert``). A plugin pages
    someone, posts to a chat, opens a ticket.

    Args:
        severity: ``SEV1``, ``SEV2`` or ``SEV3``.
        message: What happened, for people.
        node: The node concerned ("" if none).
        task: The task(s) concerned, comma-separated ("" if none).
    """
