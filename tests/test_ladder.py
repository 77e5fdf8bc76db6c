"""Every edge of the escalation ladder (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unicron_elastic.agent.ladder import LEFT_OUT, LadderPolicy, RankHistory, Remedy, climb
from unicron_elastic.api import ConfigError
from unicron_elastic.events import ErrorEvent, Severity

POLICY = LadderPolicy(max_reattempts=2, max_worker_restarts=2)


def ev(severity: Severity, kind: str = "x") -> ErrorEvent:
    return ErrorEvent(severity, kind, "test", "node")


def test_sev3_reattempts_then_escalates_to_sev2_restart() -> None:
    h = RankHistory(resumable=True)
    d1 = climb(POLICY, h, ev(Severity.SEV3), step=7)
    d2 = climb(POLICY, d1.history, ev(Severity.SEV3), step=7)
    d3 = climb(POLICY, d2.history, ev(Severity.SEV3), step=7)
    assert [d1.action, d2.action, d3.action] == [Remedy.REATTEMPT, Remedy.REATTEMPT, Remedy.RESTART_WORKER]
    assert d3.severity is Severity.SEV2 and d3.escalated_from == (Severity.SEV3,)


def test_sev3_reattempt_budget_is_per_step() -> None:
    h = RankHistory(resumable=True)
    for step in range(5):
        d = climb(POLICY, h, ev(Severity.SEV3), step=step)
        assert d.action is Remedy.REATTEMPT
        h = d.history


def test_unresponsive_sev3_goes_straight_to_sev2() -> None:
    d = climb(POLICY, RankHistory(resumable=True, responsive=False), ev(Severity.SEV3, "collective_timeout"))
    assert d.action is Remedy.RESTART_WORKER and d.escalated_from == (Severity.SEV3,)


def test_sev2_restarts_resumable_worker_then_escalates_to_sev1() -> None:
    h = RankHistory(resumable=True)
    actions = []
    for _ in range(3):
        d = climb(POLICY, h, ev(Severity.SEV2))
        actions.append(d.action)
        h = d.history
    assert actions == [Remedy.RESTART_WORKER, Remedy.RESTART_WORKER, Remedy.GIVE_UP]
    assert d.severity is Severity.SEV1 and d.escalated_from == (Severity.SEV2,)


def test_sev2_on_plain_script_keeps_torchrun_restart_all() -> None:
    d = climb(POLICY, RankHistory(resumable=False), ev(Severity.SEV2))
    assert d.action is Remedy.RESTART_ALL


def test_sev1_gives_up_at_once() -> None:
    d = climb(POLICY, RankHistory(resumable=True), ev(Severity.SEV1, "ecc"))
    assert d.action is Remedy.GIVE_UP and "ecc" in d.reason


def test_zero_budgets_escalate_immediately() -> None:
    d = climb(LadderPolicy(0, 0), RankHistory(resumable=True), ev(Severity.SEV3))
    assert d.action is Remedy.GIVE_UP and d.escalated_from == (Severity.SEV3, Severity.SEV2)
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


class _NotSupported(Exception):
    """What pynvml raises for a counter a GPU does not have (NVMLError_NotSupported)."""


class _FakeNvml:
    """NVML as an H200 answered it (tests/gpu/nvml_check.py, benchmarks/RESULTS.md): ECC and remapped rows, no
    page retirement, no NVLink; ``links`` makes some links answer."""

    NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC, NVML_NVLINK_MAX_LINKS = 1, 0, 18

    def __init__(self, links: dict[int, int] | None = None) -> None:
        self.ecc, self.rows, self.links = 0, (0, 0, 0, 0), links or {}

    def nvmlDeviceGetTotalEccErrors(self, handle: object, kind: int, counter: int) -> int:  # noqa: N802
        return self.ecc

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: object) -> int:  # noqa: N802
        raise _NotSupported("Not Supported")

    def nvmlDeviceGetRemappedRows(self, handle: object) -> tuple[int, int, int, int]:  # noqa: N802
        return self.rows

    def nvmlDeviceGetNvLinkErrorCounter(self, handle: object, link: int, counter: int) -> int:  # noqa: N802
        if link not in self.links:
            raise _NotSupported("Not Supported")
        return self.links[link]


def test_nvml_counters_are_those_the_gpu_answers_and_a_rise_is_a_sev1_event() -> None:
    """An unsupported counter is left out, not a reason to drop the others; NVLink sums the links that answer
    (the first link unsupported does not hide the rest); a remapped row (Hopper remaps rows, it retires no
    pages) or an ECC error rising is one SEV1 event each."""
    from unicron_elastic.agent.detectors import NvmlDetector, nvml_counters

    assert nvml_counters(_FakeNvml(), "gpu0") == {"ecc": 0, "remapped_rows": 0}
    assert nvml_counters(_FakeNvml(links={3: 2, 7: 1}), "gpu0")["nvlink"] == 3
    nv, events = _FakeNvml(), []
    detector = NvmlDetector()
    detector.ctx = type("Ctx", (), {"node": "n1", "report": staticmethod(events.append)})()
    detector._nvml, detector._handles = nv, ["gpu0"]
    assert detector._counters() == []  # the baseline
    nv.ecc, nv.rows = 2, (5, 1, 1, 0)  # 5 corrected rows remapped are no error; 1 uncorrectable, its remap pending
    assert sorted(detector._counters()) == [(0, "ecc", 2), (0, "remapped_rows", 2)]
    assert detector._counters() == []  # each rise once


# -- left out (alive, asked to rejoin): restarts as a joiner, counted apart ---------------------------
def left_out(severity: Severity = Severity.SEV3) -> ErrorEvent:
    return ev(severity, LEFT_OUT)


def test_left_out_restarts_as_a_joiner_without_using_the_restart_budget() -> None:
    d = climb(POLICY, RankHistory(resumable=True, reattempts=2, step=4), left_out())
    assert d.action is Remedy.RESTART_WORKER and d.severity is Severity.SEV3 and d.escalated_from == ()
    assert d.history.rejoins == 1 and d.history.restarts == 0 and d.history.reattempts == 0
    assert d.reason == "rejoin 1/10"
    after = climb(POLICY, d.history, ev(Severity.SEV2))  # a real failure later still has its whole budget
    assert after.action is Remedy.RESTART_WORKER and after.history.restarts == 1 and after.history.rejoins == 1


def test_left_out_past_max_rejoins_is_an_ordinary_sev2_exit() -> None:
    policy = LadderPolicy(max_reattempts=2, max_worker_restarts=1, max_rejoins=2)
    h, actions = RankHistory(resumable=True), []
    for _ in range(4):
        d = climb(policy, h, left_out())
        actions.append((d.action, d.severity))
        h = d.history
    assert actions == [(Remedy.RESTART_WORKER, Severity.SEV3), (Remedy.RESTART_WORKER, Severity.SEV3),
                       (Remedy.RESTART_WORKER, Severity.SEV2), (Remedy.GIVE_UP, Severity.SEV1)]
    assert h.rejoins == 2 and h.restarts == 1
    assert d.escalated_from == (Severity.SEV3, Severity.SEV2)


def test_left_out_of_a_plain_script_restarts_all_as_for_sev2() -> None:
    d = climb(POLICY, RankHistory(resumable=False), left_out())
    assert d.action is Remedy.RESTART_ALL and d.severity is Severity.SEV2 and d.history.rejoins == 0


def test_left_out_is_never_reattempted_in_place_and_sev1_still_gives_up() -> None:
    d = climb(POLICY, RankHistory(resumable=True, responsive=True), left_out(), step=3)
    assert d.action is Remedy.RESTART_WORKER  # not REATTEMPT, though SEV3 and responsive
    assert climb(POLICY, RankHistory(resumable=True), left_out(Severity.SEV1)).action is Remedy.GIVE_UP
    sev2 = climb(POLICY, RankHistory(resumable=True), left_out(Severity.SEV2))
    assert sev2.action is Remedy.RESTART_WORKER and sev2.history.rejoins == 1


def test_max_rejoins_zero_and_negative() -> None:
    d = climb(LadderPolicy(2, 2, 0), RankHistory(resumable=True), left_out())
    assert d.action is Remedy.RESTART_WORKER and d.severity is Severity.SEV2 and d.history.restarts == 1
    assert LadderPolicy().max_rejoins == 10
    with pytest.raises(ConfigError):
        LadderPolicy(max_rejoins=-1)


@settings(max_examples=200, deadline=None)
@given(kinds=st.lists(st.sampled_from(["left_out", "sev2", "sev3"]), max_size=30),
       max_rejoins=st.integers(0, 4), resumable=st.booleans())
def test_left_out_never_counts_as_a_restart_while_rejoins_last(kinds: list[str], max_rejoins: int,
                                                               resumable: bool) -> None:
    policy = LadderPolicy(max_reattempts=1, max_worker_restarts=3, max_rejoins=max_rejoins)
    events = {"left_out": left_out(), "sev2": ev(Severity.SEV2), "sev3": ev(Severity.SEV3)}
    h = RankHistory(resumable=resumable)
    for kind in kinds:
        d = climb(policy, h, events[kind], step=0)
        assert d.history.rejoins <= max_rejoins and d.history.restarts <= policy.max_worker_restarts
        if kind == "left_out" and d.history.rejoins > h.rejoins:  # a rejoin: nothing else changes
            assert d.action is Remedy.RESTART_WORKER and d.history.restarts == h.restarts and resumable
        if kind == "left_out" and resumable and h.rejoins < max_rejoins:
            assert d.history.rejoins == h.rejoins + 1
        if not resumable:
            assert d.history.rejoins == 0 and d.action in (Remedy.REATTEMPT, Remedy.RESTART_ALL)
        if d.action is Remedy.GIVE_UP:
            return
        h = d.history
