"""Every edge of the escalation ladder (pure)."""

from __future__ import annotations

import pytest

from unicron_elastic.agent.decide import Action, LadderPolicy, RankHistory, decide
from unicron_elastic.api import ConfigError
from unicron_elastic.events import ErrorEvent, Severity

POLICY = LadderPolicy(max_reattempts=2, max_worker_restarts=2)


def ev(severity: Severity, kind: str = "x") -> ErrorEvent:
    return ErrorEvent(severity, kind, "test", "node")


def test_sev3_reattempts_then_escalates_to_sev2_restart() -> None:
    h = RankHistory(resumable=True)
    d1 = decide(POLICY, h, ev(Severity.SEV3), step=7)
    d2 = decide(POLICY, d1.history, ev(Severity.SEV3), step=7)
    d3 = decide(POLICY, d2.history, ev(Severity.SEV3), step=7)
    assert [d1.action, d2.action, d3.action] == [Action.REATTEMPT, Action.REATTEMPT, Action.RESTART_WORKER]
    assert d3.severity is Severity.SEV2 and d3.escalated_from == (Severity.SEV3,)


def test_sev3_reattempt_budget_is_per_step() -> None:
    h = RankHistory(resumable=True)
    for step in range(5):
        d = decide(POLICY, h, ev(Severity.SEV3), step=step)
        assert d.action is Action.REATTEMPT
        h = d.history


def test_unresponsive_sev3_goes_straight_to_sev2() -> None:
    d = decide(POLICY, RankHistory(resumable=True, responsive=False), ev(Severity.SEV3, "collective_timeout"))
    assert d.action is Action.RESTART_WORKER and d.escalated_from == (Severity.SEV3,)


def test_sev2_restarts_resumable_worker_then_escalates_to_sev1() -> None:
    h = RankHistory(resumable=True)
    actions = []
    for _ in range(3):
        d = decide(POLICY, h, ev(Severity.SEV2))
        actions.append(d.action)
        h = d.history
    assert actions == [Action.RESTART_WORKER, Action.RESTART_WORKER, Action.GIVE_UP]
    assert d.severity is Severity.SEV1 and d.escalated_from == (Severity.SEV2,)


def test_sev2_on_plain_script_keeps_torchrun_restart_all() -> None:
    d = decide(POLICY, RankHistory(resumable=False), ev(Severity.SEV2))
    assert d.action is Action.RESTART_ALL


def test_sev1_gives_up_at_once() -> None:
    d = decide(POLICY, RankHistory(resumable=True), ev(Severity.SEV1, "ecc"))
    assert d.action is Action.GIVE_UP and "ecc" in d.reason


def test_zero_budgets_escalate_immediately() -> None:
    d = decide(LadderPolicy(0, 0), RankHistory(resumable=True), ev(Severity.SEV3))
    assert d.action is Action.GIVE_UP and d.escalated_from == (Severity.SEV3, Severity.SEV2)
    with pytest.raises(ConfigError):
        LadderPolicy(-1, 0)


def test_nvml_detector_is_silent_and_cheap_without_nvml(capsys) -> None:
    import threading

    from unicron_elastic.agent.detectors import NvmlDetector

    try:
        import pynvml

        pynvml.nvmlInit()
        pytest.skip("NVML is present on this machine: the silent path cannot be shown")
    except pytest.skip.Exception:
        raise
    except Exception:  # noqa: BLE001 - the expected case here: no driver
        pass
    before = threading.active_count()
    detector = NvmlDetector()
    detector.start(ctx=None)  # the context is never touched when NVML is missing
    assert detector.available is False
    assert threading.active_count() == before  # no polling thread
    out = capsys.readouterr().out
    assert "detector_disabled" in out and "NVML unavailable" in out
    detector.stop()
