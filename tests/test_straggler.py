"""Stragglers, in-process: busy times per step -> who is reported (no I/O), and the detector's path to the agent."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unicron_elastic.agent.detectors import STRAGGLER_RATIO, StragglerDetector
from unicron_elastic.api import ConfigError
from unicron_elastic.detection.straggler import StragglerThresholds, StragglerWatch
from unicron_elastic.events import Severity


def _feed(watch: StragglerWatch, steps: list[dict[int, float]]) -> list[tuple[int, int]]:
    """Record each step's busy times rank by rank; (step, rank) of every straggler reported."""
    found = []
    for step, busy in enumerate(steps):
        for rank, seconds in busy.items():
            found += [(step, s.rank) for s in watch.record(rank, seconds)]
    return found


def test_a_rank_three_times_slower_for_20_steps_is_reported_once_by_name() -> None:
    rng = random.Random(3)
    steps = [{r: 0.1 * rng.uniform(0.9, 1.1) * (3 if r == 1 and 8 <= s < 28 else 1) for r in range(3)}
             for s in range(40)]
    watch = StragglerWatch()
    found = _feed(watch, steps)
    assert [rank for _, rank in found] == [1]
    step = found[0][0]
    assert 8 < step <= 8 + 10 // 2 + 1  # once the slow steps are the window's majority
    assert 1 not in watch.flagged  # back to its peers' speed: the episode ended


@settings(max_examples=80, deadline=None)
@given(st.integers(2, 8), st.floats(0.001, 10.0), st.floats(0.0, 0.2), st.integers(0, 2**32 - 1))
def test_ranks_within_the_jitter_of_each_other_are_never_reported(ranks: int, base: float, jitter: float,
                                                                 seed: int) -> None:
    rng = random.Random(seed)
    steps = [{r: base * rng.uniform(1 - jitter, 1 + jitter) for r in range(ranks)} for _ in range(60)]
    assert _feed(StragglerWatch(), steps) == []  # (1 + 0.2) / (1 - 0.2) = 1.5: never above it


def test_a_rank_alone_or_in_its_warmup_is_never_reported() -> None:
    watch = StragglerWatch()
    assert _feed(watch, [{0: 10.0} for _ in range(30)]) == []  # no peers to compare with
    watch = StragglerWatch(StragglerThresholds(window=3, warmup=5))
    assert _feed(watch, [{0: 0.1, 1: 10.0 if s < 5 else 0.1} for s in range(20)]) == []  # the start-up's steps


def test_a_rank_near_the_factor_is_not_reported_on_and_off() -> None:
    watch = StragglerWatch(StragglerThresholds(window=3, warmup=0))
    pattern = [1.6, 1.4, 1.6, 1.4, 1.6, 1.45, 1.55] * 5  # around 1.5x, never back under 1.25x
    found = _feed(watch, [{0: 1.0, 1: 1.0, 2: f} for f in pattern])
    assert [rank for _, rank in found] == [2]


def test_a_restarted_rank_starts_a_new_record() -> None:
    watch = StragglerWatch(StragglerThresholds(window=3, warmup=0))
    _feed(watch, [{0: 1.0, 1: 3.0} for _ in range(5)])
    assert watch.flagged == {1}
    watch.forget(1)
    assert watch.flagged == set() and 1 not in watch.ratios()


@pytest.mark.parametrize("kwargs", [{"factor": 1.0}, {"factor": float("inf")}, {"factor": "2"}, {"window": 2},
                                    {"window": True}, {"warmup": -1}])
def test_bad_straggler_thresholds_are_refused(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        StragglerThresholds(**kwargs)


class _Context:
    """Three local workers, global ranks 0-2; findings recorded."""

    def __init__(self) -> None:
        self.findings: list = []

    def workers(self) -> dict:
        return {r: (r, None) for r in range(3)}

    def hang(self, rank, finding) -> None:
        self.findings.append((rank, finding))


def test_the_detector_reports_a_sev3_straggler_and_sets_the_ratio_metric() -> None:
    detector, ctx = StragglerDetector(StragglerThresholds(window=4, warmup=1)), _Context()
    detector.ctx = ctx
    for step in range(10):
        for rank in range(3):
            busy = 0.3 if rank == 2 else 0.1
            detector.on_message({"t": "beat", "rank": rank, "step": step, "dur": 0.31, "busy": busy}, float(step))
        detector.on_message({"t": "beat", "rank": 9, "step": step, "dur": 0.31, "busy": 9.0}, float(step))
    assert [(rank, f.severity, f.kind) for rank, f in ctx.findings] == [(2, Severity.SEV3, "straggler")]
    assert "3.00x its peers' median 100.0 ms" in ctx.findings[0][1].message
    assert STRAGGLER_RATIO.labels(rank="2")._value.get() == pytest.approx(3.0)
    assert detector.dropped == 10  # rank 9 is not this agent's
