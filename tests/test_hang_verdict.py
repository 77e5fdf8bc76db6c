"""The hang verdict, in-process: one agent's ranks' reports -> who is hung (no I/O).

Each case feeds an agent's monitors (:class:`IterationMonitor`) the messages
the ranks would send - heartbeats, then, once a peer stops answering, the
"waiting on my group" reports the engine's watch repeats - and asks
:func:`hang_verdict` at many moments. A rank that stopped answering is blamed
once its silence passes its deadline; the ranks waiting on it never are,
however long they wait (a peer on a frozen node included: that node is its
lease's verdict, not this one's); a slow rank that keeps progressing is never
blamed.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from unicron_elastic.detection.hang import HangThresholds, IterationMonitor, hang_verdict

WARM = 8  # heartbeats before the fault (the monitors' warmup is 5)


def _warm_monitors(ranks: int, period: float) -> tuple[dict[int, IterationMonitor], float]:
    """Monitors of ``ranks`` ranks that each beat ``WARM`` times, every ``period`` s; returns them and the time."""
    monitors = {rank: IterationMonitor(HangThresholds()) for rank in range(ranks)}
    now = 0.0
    for _ in range(WARM):
        now += period
        for monitor in monitors.values():
            monitor.heartbeat(now, period)
    return monitors, now


def _verdicts(monitors: dict[int, IterationMonitor], start: float, end: float, refresh: float, silent: set[int],
              waiting: set[int]):
    """Step time from ``start`` to ``end``: ``waiting`` ranks report every ``refresh`` s, ``silent`` say nothing.

    Yields ``(t, verdict)`` every 10 ms.
    """
    t, next_report = start, start  # (the first report at the first tick)
    while t < end:
        t = round(t + 0.01, 6)
        if t >= next_report:
            for rank in waiting - silent:
                monitors[rank].set_state(t, waiting=True)
            next_report = t + refresh
        yield t, hang_verdict({rank: m.report(rank) for rank, m in monitors.items()}, t)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 8), st.data(), st.floats(0.05, 0.5), st.floats(0.02, 0.2))
def test_one_hung_rank_among_n_is_the_only_one_blamed(ranks: int, data, period: float, refresh: float) -> None:
    hung = data.draw(st.integers(0, ranks - 1))
    monitors, now = _warm_monitors(ranks, period)
    deadline = monitors[hung].deadline()
    blamed_at = None
    for t, verdict in _verdicts(monitors, now, now + 10 * period + 4, refresh, {hung}, set(range(ranks)) - {hung}):
        assert set(verdict.hung) <= {hung}, f"a rank waiting on the hung one was blamed at {t}"
        if verdict.hung and blamed_at is None:
            blamed_at = t
    assert blamed_at is not None and blamed_at > deadline and blamed_at - deadline < 0.02


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.floats(0.05, 0.5), st.floats(0.02, 0.2))
def test_ranks_that_all_wait_and_say_so_are_never_blamed(ranks: int, period: float, refresh: float) -> None:
    """As on a survivor's node while a peer's node is frozen: its agent hears only ranks that wait, and blames
    none of them for as long as they wait."""
    monitors, now = _warm_monitors(ranks, period)
    for _, verdict in _verdicts(monitors, now, now + 30 * period + 3, refresh, set(), set(range(ranks))):
        assert not verdict.hung and len(verdict.waiting) == ranks


@settings(max_examples=60, deadline=None)
@given(st.floats(0.05, 0.5), st.lists(st.floats(1.0, 4.9), min_size=5, max_size=40))
def test_a_slow_rank_that_keeps_progressing_is_never_blamed(period: float, slowdowns: list[float]) -> None:
    """Each iteration up to 4.9x the one before (the hang factor is 5): slower and slower, never silent too long."""
    monitors, now = _warm_monitors(2, period)
    slow = monitors[1]
    for factor in slowdowns:
        duration = factor * slow.largest_gap
        start = now
        for k in range(1, 51):  # ask the verdict all along the iteration
            now = start + duration * k / 50
            assert 1 not in hang_verdict({r: m.report(r) for r, m in monitors.items()}, now).hung
        slow.heartbeat(now, duration)
        monitors[0].set_state(now, waiting=True)  # the fast one waits on it, saying so


def test_the_end_of_a_wait_starts_the_silence_count_afresh() -> None:
    monitors, now = _warm_monitors(1, 0.1)
    monitor = monitors[0]
    for k in range(35):  # "still waiting" every 0.15 s from +0.2 to +5.3
        monitor.set_state(now + 0.2 + 0.15 * k, waiting=True)
    assert monitor.check(now + 5.3 + 2.9) is None  # refreshed at +5.3: alive (the floor is 3 s)
    monitor.set_state(now + 5.4, waiting=False)
    assert monitor.check(now + 5.4 + 2.99) is None  # silence counts from the end of the wait
    finding = monitor.check(now + 5.4 + 3.01)
    assert finding is not None and finding.kind == "task_hang"
