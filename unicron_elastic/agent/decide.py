"""The node's escalation ladder as a pure function (paper section 4.2).

``decide(policy, history, event) -> Decision``; the agent executes the decision.

    SEV3 -> reattempt in place, at most ``max_reattempts`` times per step;
            then handled as SEV2
    SEV2 -> restart only the failed worker (same rank and configuration) if it
            declared itself resumable, at most ``max_worker_restarts`` times;
            plain scripts: torchrun's restart of all workers;
            too many restarts -> SEV1
    SEV1 -> the node gives up its assignment (distinct exit code and event) so
            the coordinator can re-plan without it
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

from unicron_elastic.api import ConfigError
from unicron_elastic.events import ErrorEvent, Severity

#: Exit code of an agent that gave up its node (SEV1): EX_TEMPFAIL.
EXIT_GIVE_UP = 75


class Action(str, Enum):
    """What the agent does about an event."""

    REATTEMPT = "reattempt"
    RESTART_WORKER = "restart_worker"
    RESTART_ALL = "restart_all"
    GIVE_UP = "give_up"
    OBSERVE = "observe"


@dataclass(frozen=True)
class LadderPolicy:
    """Bounds of the ladder.

    Raises:
        ConfigError: A bound is negative.
    """

    max_reattempts: int = 3
    max_worker_restarts: int = 3

    def __post_init__(self) -> None:
        if self.max_reattempts < 0 or self.max_worker_restarts < 0:
            raise ConfigError("max_reattempts and max_worker_restarts must be >= 0")


@dataclass(frozen=True)
class RankHistory:
    """What happened to one rank so far (the decision's state).

    Attributes:
        resumable: The worker declared it can be restarted alone.
        responsive: The worker can still receive a verdict (not hung or dead).
        step: Step of the last reattempt.
        reattempts: Reattempts at ``step``.
        restarts: Restarts of this rank.
    """

    resumable: bool = False
    responsive: bool = True
    step: int = -1
    reattempts: int = 0
    restarts: int = 0


@dataclass(frozen=True)
class Decision:
    """The decision and the history after it.

    Attributes:
        action: What to do.
        severity: The severity the action answers (after escalation).
        history: The rank's history including this decision.
        reason: Why, for logs and events.
    """

    action: Action
    severity: Severity
    history: RankHistory
    reason: str = ""
    escalated_from: tuple[Severity, ...] = field(default=())


def decide(policy: LadderPolicy, history: RankHistory, event: ErrorEvent, step: int = -1) -> Decision:
    """Choose the action for ``event`` on a rank with ``history``.

    Args:
        policy: The ladder's bounds.
        history: The rank's history.
        event: The event.
        step: The training step the event happened in (for reattempt counting).

    Returns:
        The decision.
    """
    escalated: tuple[Severity, ...] = ()
    severity = event.severity
    if severity is Severity.SEV3:
        same_step = history.step == step
        used = history.reattempts if same_step else 0
        if history.responsive and used < policy.max_reattempts:
            new = replace(history, step=step, reattempts=used + 1)
            return Decision(Action.REATTEMPT, Severity.SEV3, new, f"reattempt {used + 1}/{policy.max_reattempts}")
        escalated, severity = (Severity.SEV3,), Severity.SEV2
    if severity is Severity.SEV2:
        if not history.resumable:
            return Decision(Action.RESTART_ALL, Severity.SEV2, history, "worker not resumable: restart all", escalated)
        if history.restarts < policy.max_worker_restarts:
            new = replace(history, restarts=history.restarts + 1, reattempts=0)
            return Decision(Action.RESTART_WORKER, Severity.SEV2, new,
                            f"restart {history.restarts + 1}/{policy.max_worker_restarts}", escalated)
        escalated, severity = (*escalated, Severity.SEV2), Severity.SEV1
    return Decision(Action.GIVE_UP, Severity.SEV1, history, f"{event.kind}: node gives up its assignment", escalated)
