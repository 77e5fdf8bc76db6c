"""The node's escalation ladder as a pure function (paper section 4.2).

``climb(policy, history, event) -> Rung``: the rung the event puts the rank on; the agent executes it.

    SEV3 -> reattempt in place, at most ``max_reattempts`` times per step;
            then handled as SEV2
    SEV2 -> restart only the failed worker (same rank and configuration) if it
            declared itself resumable, at most ``max_worker_restarts`` times;
            plain scripts: torchrun's restart of all workers;
            too many restarts -> SEV1
    SEV1 -> the node gives up its assignment (distinct exit code and event) so
            the coordinator can re-plan without it

A ``left_out`` event (:data:`LEFT_OUT`: a worker alive but left out of its
group asked to rejoin, then exited) is no failure: the worker is restarted as a
joiner, counted in ``rejoins`` (not ``restarts``), at most ``max_rejoins``
times; past that it is handled as a SEV2 exit. Plain scripts: as for SEV2.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

from unicron_elastic.agent.api import EXIT_GIVE_UP, LadderPolicy  # noqa: F401 - named here too (its home is the contract)
from unicron_elastic.events import ErrorEvent, Severity

#: Event kind of a worker that exited after asking to rejoin (alive, but left out of its group).
LEFT_OUT = "left_out"


class Remedy(str, Enum):
    """What the agent does about an event: the action of a rung of the ladder."""

    REATTEMPT = "reattempt"
    RESTART_WORKER = "restart_worker"
    RESTART_ALL = "restart_all"
    GIVE_UP = "give_up"
    OBSERVE = "observe"


@dataclass(frozen=True)
class RankHistory:
    """What happened to one rank so far (the ladder's state).

    Attributes:
        resumable: The worker declared it can be restarted alone.
        responsive: The worker can still receive a verdict (not hung or dead).
        step: Step of the last reattempt.
        reattempts: Reattempts at ``step``.
        restarts: Restarts of this rank.
        rejoins: Restarts of this rank as a joiner after a ``left_out`` exit.
    """

    resumable: bool = False
    responsive: bool = True
    step: int = -1
    reattempts: int = 0
    restarts: int = 0
    rejoins: int = 0


@dataclass(frozen=True)
class Rung:
    """The rung of the ladder an event put a rank on: the action, and the history after it.

    Attributes:
        action: What to do.
        severity: The severity the action answers (after escalation).
        history: The rank's history including this rung.
        reason: Why, for logs and events.
        escalated_from: The severities the event was escalated from, in order (empty: none).
    """

    action: Remedy
    severity: Severity
    history: RankHistory
    reason: str = ""
    escalated_from: tuple[Severity, ...] = field(default=())


def climb(policy: LadderPolicy, history: RankHistory, event: ErrorEvent, step: int = -1) -> Rung:
    """Choose the action for ``event`` on a rank with ``history``.

    Args:
        policy: The ladder's bounds.
        history: The rank's history.
        event: The event.
        step: The training step the event happened in (for reattempt counting).

    Returns:
        The rung. A ``left_out`` event (:data:`LEFT_OUT`, SEV3 or SEV2) is
        a rejoin while ``history.rejoins < policy.max_rejoins`` and the worker
        is resumable, otherwise a SEV2.
    """
    escalated: tuple[Severity, ...] = ()
    severity = event.severity
    if event.kind == LEFT_OUT and severity is not Severity.SEV1:
        rejoin = _rejoin(policy, history)
        if rejoin is not None:
            return rejoin
        escalated, severity = ((severity,) if severity is Severity.SEV3 else ()), Severity.SEV2
    elif severity is Severity.SEV3:
        same_step = history.step == step
        used = history.reattempts if same_step else 0
        if history.responsive and used < policy.max_reattempts:
            new = replace(history, step=step, reattempts=used + 1)
            return Rung(Remedy.REATTEMPT, Severity.SEV3, new, f"reattempt {used + 1}/{policy.max_reattempts}")
        escalated, severity = (Severity.SEV3,), Severity.SEV2
    if severity is Severity.SEV2:
        if not history.resumable:
            return Rung(Remedy.RESTART_ALL, Severity.SEV2, history, "worker not resumable: restart all", escalated)
        if history.restarts < policy.max_worker_restarts:
            new = replace(history, restarts=history.restarts + 1, reattempts=0)
            return Rung(Remedy.RESTART_WORKER, Severity.SEV2, new,
                        f"restart {history.restarts + 1}/{policy.max_worker_restarts}", escalated)
        escalated, severity = (*escalated, Severity.SEV2), Severity.SEV1
    return Rung(Remedy.GIVE_UP, Severity.SEV1, history, f"{event.kind}: node gives up its assignment", escalated)


def _rejoin(policy: LadderPolicy, history: RankHistory) -> Rung | None:
    """Restart a left-out worker as a joiner; None (handled as a SEV2) for a plain script or past ``max_rejoins``."""
    if not history.resumable or history.rejoins >= policy.max_rejoins:
        return None
    new = replace(history, rejoins=history.rejoins + 1, reattempts=0)
    return Rung(Remedy.RESTART_WORKER, Severity.SEV3, new, f"rejoin {history.rejoins + 1}/{policy.max_rejoins}")
