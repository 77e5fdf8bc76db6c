"""The hang verdict, in-process: every rank's reports and the nodes' liveness -> who is hung (no I/O).

Each case feeds the agents' monitors (:class:`IterationMonitor`) the messages
the ranks would send - heartbeats, then, once a peer stops answering, the
"waiting on my group" reports the engine's watch repeats - and asks
:func:`hang_verdict` at many moments. A rank that stopped answering is blamed
once its silence passes its deadline; the ranks waiting on it never are; a
frozen node's ranks are its node's loss, not hangs; a slow rank that keeps
progressing is never blamed.
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


def _verdicts(monitors: dict[int, IterationMonitor], nodes: dict[int, str], start: float, end: float,
              refresh: float, silent: set[int], waiting: set[int], live_at=lambda t: None):
    """Step time from ``start`` to ``end``: ``waiting`` ranks report every ``refresh`` s, ``silent`` say nothing.

    Yields ``(t, verdict)`` every 10 ms (``live_at(t)``: the live nodes then; None: every node).
    """
    all_nodes = set(nodes.values())
    t, next_report = start, start  # (the first report at the first tick)
    while t < end:
        t = round(t + 0.01, 6)
        if t >= next_report:
            for rank in waiting - silent:
                monitors[rank].set_state(t, waiting=True)
            next_report = t + refresh
        reports = {rank: m.report(rank, nodes[rank]) for rank, m in monitors.items()}
        live = live_at(t)
        yield t, hang_verdict(reports, all_nodes if live is None else live, t)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 8), st.data(), st.floats(0.05, 0.5), st.floats(0.02, 0.2))
def test_one_hung_rank_among_n_is_the_only_one_blamed(ranks: int, data, period: float, refresh: float) -> None:
    hung = data.draw(st.integers(0, ranks - 1))
    monitors, now = _warm_monitors(ranks, period)
    nodes = {rank: "n0" for rank in range(ranks)}
    deadline = monitors[hung].deadline()
    blamed_at = None
    for t, verdict in _verdicts(monitors, nodes, now, now + 10 * period + 2, refresh, {hung},
                                set(range(ranks)) - {hung}):
        assert set(verdict.hung) <= {hung}, f"a rank waiting on the hung one was blamed at {t}"
        if verdict.hung and blamed_at is None:
            blamed_at = t
    assert blamed_at is not None and blamed_at > deadline and blamed_at - deadline < 0.02


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 4), st.integers(1, 4), st.data(), st.floats(0.05, 0.5), st.floats(0.02, 0.2))
def test_a_frozen_node_is_lost_as_a_whole_and_nobody_else_is_blamed(nodes_n: int, per_node: int, data,
                                                                     period: float, refresh: float) -> None:
    frozen = data.draw(st.integers(0, nodes_n - 1))
    ranks = nodes_n * per_node
    nodes = {rank: f"n{rank // per_node}" for rank in range(ranks)}
    on_frozen = {rank for rank, node in nodes.items() if node == f"n{frozen}"}
    monitors, now = _warm_monitors(ranks, period)
    ttl = 2.0
    live_nodes = {f"n{i}" for i in range(nodes_n)}
    lost_after = now + ttl

    def live_at(t: float) -> set[str]:
        return live_nodes - {f"n{frozen}"} if t > lost_after else live_nodes

    for t, verdict in _verdicts(monitors, nodes, now, now + ttl + 1, refresh, on_frozen,
                                set(range(ranks)) - on_frozen, live_at):
        assert set(verdict.hung) <= on_frozen  # survivors are never blamed
        if t > lost_after:
            assert verdict.lost_nodes == (f"n{frozen}",) and not verdict.hung
            assert set(verdict.waiting) == set(range(ranks)) - on_frozen


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.floats(0.05, 0.5), st.floats(0.02, 0.2))
def test_ranks_that_all_wait_and_say_so_are_never_blamed(ranks: int, period: float, refresh: float) -> None:
    monitors, now = _warm_monitors(ranks, period)
    nodes = {rank: "n0" for rank in range(ranks)}
    for _, verdict in _verdicts(monitors, nodes, now, now + 30 * period + 3, refresh, set(), set(range(ranks))):
        assert not verdict.hung and len(verdict.waiting) == ranks


@settings(max_examples=60, deadline=None)
@given(st.floats(0.05, 0.5), st.lists(st.floats(1.0, 2.5), min_size=5, max_size=40))
def test_a_slow_rank_that_keeps_progressing_is_never_blamed(period: float, slowdowns: list[float]) -> None:
    """Each iteration up to 2.5x the mean so far (the hang factor is 3): slower and slower, never silent too long."""
    monitors, now = _warm_monitors(2, period)
    nodes = {0: "n0", 1: "n0"}
    slow = monitors[1]
    for factor in slowdowns:
        duration = factor * slow.mean
        end = now + duration
        while now < end:  # ask the verdict all along the iteration
            now = min(end, now + 0.01)
            assert 1 not in hang_verdict({r: m.report(r, nodes[r]) for r, m in monitors.items()}, {"n0"}, now).hung
        slow.heartbeat(now, duration)
        monitors[0].set_state(now, waiting=True)  # the fast one waits on it, saying so


def test_the_end_of_a_wait_starts_the_silence_count_afresh() -> None:
    monitors, now = _warm_monitors(1, 0.1)
    monitor = monitors[0]
    monitor.set_state(now + 0.2, waiting=True)
    monitor.set_state(now + 5.0, waiting=True)
    assert monitor.check(now + 5.4) is None  # refreshed at +5.0: alive
    monitor.set_state(now + 5.5, waiting=False)
    assert monitor.check(now + 5.9) is None  # silence counts from the end of the wait
    finding = monitor.check(now + 6.1)
    assert finding is not None and finding.kind == "task_hang"
