"""A node asked to leave its task (a SLURM drain, a plan without it) at any moment of its life (no I/O).

The decision is pure (:func:`~unicron_elastic.agent.rank_state.leave_decision`); the leave signal records
the request and never stops the node as a failure: while the node waits for a round it ends the wait
(exit code 0), later the agent acts on it once its workers can leave. The multi-process paths
(a drain during the rendezvous and during a restart, on a real SLURM) are in tests/test_slurm_e2e.py.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from unicron_elastic.agent import signals
from unicron_elastic.agent.rank_state import HELLO_GRACE_S, LeaveDecision, leave_decision


@pytest.mark.parametrize(("meeting", "running", "said", "leavable", "waited", "decision"), [
    (True, 2, 2, True, 0.0, LeaveDecision.LEAVE),   # training: every worker said it can leave
    (True, 2, 1, True, 0.0, LeaveDecision.WAIT),    # one is starting (or restarting): not said yet
    (True, 0, 0, True, 5.0, LeaveDecision.WAIT),    # no worker runs (between a worker's exit and its respawn)
    (True, 2, 0, True, HELLO_GRACE_S, LeaveDecision.STOP),  # none said within the grace: a plain torchrun script
    (True, 2, 1, False, 0.0, LeaveDecision.STOP),   # one said it cannot: it never will
    (False, 2, 2, True, 0.0, LeaveDecision.STOP),   # no meeting store to ask in
])
def test_a_node_leaves_when_every_worker_can_waits_while_one_has_not_said_and_stops_when_one_cannot(
        meeting: bool, running: int, said: int, leavable: bool, waited: float, decision: LeaveDecision) -> None:
    assert leave_decision(meeting, running, said, leavable, waited) is decision


@given(st.booleans(), st.integers(0, 8), st.integers(0, 8), st.booleans(), st.floats(0, 100))
def test_a_node_never_leaves_before_every_running_worker_said_it_can_and_waits_a_bounded_time(
        meeting: bool, running: int, said: int, leavable: bool, waited: float) -> None:
    said = min(said, running)
    decision = leave_decision(meeting, running, said, leavable, waited)
    assert (decision is LeaveDecision.LEAVE) == (meeting and running > 0 and said == running and leavable)
    assert decision is not LeaveDecision.WAIT or waited < HELLO_GRACE_S


@pytest.fixture()
def leave_handler() -> Iterator[None]:
    previous = signal.getsignal(signals.LEAVE_SIGNAL)
    signals._leave_requested.clear()
    signals.install_leave_signal()
    yield
    signal.signal(signals.LEAVE_SIGNAL, previous)
    signals._leave_requested.clear()


def test_the_leave_signal_outside_training_is_recorded_and_never_stops_the_node(leave_handler: None) -> None:
    """No workers train here (what a launcher in its rendezvous or start-up is): the signal raises nothing."""
    assert not signals.leave_requested()
    os.kill(os.getpid(), signals.LEAVE_SIGNAL)
    os.kill(os.getpid(), signals.LEAVE_SIGNAL)  # (a drain watch and a daemon may both ask)
    assert signals.leave_requested()


def test_a_leave_while_the_node_waits_for_a_round_ends_the_wait_and_one_before_it_never_starts_it(
        leave_handler: None) -> None:
    with pytest.raises(signals.LeftBeforeTraining):
        with signals.leaving_ends_the_wait():
            os.kill(os.getpid(), signals.LEAVE_SIGNAL)
            time.sleep(5)  # (the handler raises in this thread at once)
    assert signals.leave_requested()
    with pytest.raises(signals.LeftBeforeTraining):  # (a drain seen before the rendezvous)
        with signals.leaving_ends_the_wait():
            raise AssertionError("the wait started")
    signals._leave_requested.clear()
    os.kill(os.getpid(), signals.LEAVE_SIGNAL)  # after the wait: only recorded (start-up, training)
    assert signals.leave_requested()
