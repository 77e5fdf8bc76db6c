"""The stop and leave signals of ``unicron-run``, for the launcher and its agent (main thread state).

SIGTERM, SIGINT, SIGHUP and SIGQUIT stop the node (torch's ``SignalException``),
deferred across steps that must not be cut in half and ignored once the
clean-up began; SIGUSR2 (:data:`LEAVE_SIGNAL`) asks the agent to leave its
task at the next step boundary (during the workers' start-up or a restart the
request waits until they train); while the node waits for a round it ends the
node at once, exit code 0 (:class:`LeftBeforeTraining`). It never stops a
node as a failure. A node daemon's death stops its launcher too.
Under SLURM (``unicron-run --slurm``), SIGUSR1 (:data:`PREEMPT_SIGNAL`,
SLURM's warning before the end of the allocation) stops the node as SIGTERM
does; its workers, which SLURM signals too, never see it.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import structlog
from torch.distributed.elastic.multiprocessing import SignalException

from unicron_elastic.agent import _torch_compat
from unicron_elastic.env import daemon_pid

log = structlog.get_logger(__name__)

#: Signals that stop ``unicron-run`` (torch's default set of handled signals).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
#: The signal that makes ``unicron-run`` leave its task at the next step boundary (a node the plan takes away).
LEAVE_SIGNAL = signal.SIGUSR2
#: SLURM's warning signal (``--signal=USR1@N``): stops ``unicron-run --slurm`` like SIGTERM (exit code 138).
PREEMPT_SIGNAL = signal.SIGUSR1
#: Set once the process cleans up: later stop signals are ignored.
_shutting_down = threading.Event()
#: Set when LEAVE_SIGNAL arrived: the agent acts on it once its workers can leave.
_leave_requested = threading.Event()
#: Set while the node waits for a round (it has no workers of its own): a leave ends the wait at once.
_in_rendezvous = threading.Event()
#: The main thread's state of the stop signal.
_signals: dict[str, Any] = {"pending": None, "deferring": 0}


def _on_stop_signal(signum: int, frame: object) -> None:
    """Raise torch's ``SignalException`` in the main thread, unless deferred or a shutdown is under way.

    Raises:
        SignalException: For a stop signal outside :func:`stop_signals_deferred`.
    """
    sig = signal.Signals(signum)
    if _shutting_down.is_set():
        log.warning("stop_signal_ignored", signal=sig.name, reason="shutdown under way (SIGKILL forces)")
        return
    _signals["pending"] = sig
    if _signals["deferring"]:
        log.info("stop_signal_deferred", signal=sig.name)
        return
    raise SignalException(f"Process {os.getpid()} got signal: {sig.name}", sigval=sig)


def raise_pending_stop() -> None:
    """Raise again a stop signal that was received but is not being acted on.

    A ``SignalException`` raised in the middle of library code that catches
    ``Exception`` (a health probe, a retry loop) is lost; the agent calls this
    at points where it is safe to stop (every monitor interval, after a rendezvous).

    Raises:
        SignalException: A stop signal arrived and no shutdown has begun.
    """
    sig = _signals["pending"]
    if sig is not None and not _shutting_down.is_set() and threading.current_thread() is threading.main_thread():
        raise SignalException(f"Process {os.getpid()} got signal: {sig.name}", sigval=sig)


@contextmanager
def stop_signals_deferred() -> Iterator[None]:
    """A stop signal inside the block takes effect when the block ends (main thread).

    For steps that must not be cut in half: starting etcd (its health probe
    would swallow the exception) or worker processes (torch would lose track
    of those started so far). In other threads (signals only reach the main
    thread) it does nothing.

    Raises:
        SignalException: At the end of the block, for a stop signal received in it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _signals["deferring"] += 1
    try:
        yield
    finally:
        _signals["deferring"] -= 1
    if not _signals["deferring"]:
        raise_pending_stop()


def install_stop_signals() -> None:
    """Turn SIGTERM, SIGINT, SIGHUP and SIGQUIT into ``SignalException`` (main thread only).

    Like torch's own handler (which it also replaces in the worker start-up,
    see :func:`~unicron_elastic.agent._torch_compat.use_signal_handler`), but a
    signal inside :func:`stop_signals_deferred` waits for the end of the block,
    and once :func:`begin_shutdown` was called a further signal is logged and
    ignored, so it cannot break off the clean-up (stopping the workers and etcd,
    removing temp dirs). ``unicron-run`` installs it before it starts anything.
    """
    _torch_compat.use_signal_handler(_on_stop_signal)
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_stop_signal)


def install_preemption_signal() -> None:
    """Make :data:`PREEMPT_SIGNAL` (SIGUSR1) stop this process as SIGTERM does, and keep it from every child.

    SLURM signals every process of a step, the workers and their data
    loaders included, and SIGUSR1's default action ends a process; the
    launcher alone acts on it (its agent then stops the workers with
    SIGTERM: :func:`signal_for_workers`). So the signal is blocked in the
    main thread, which starts the workers (a blocked signal stays blocked
    across ``fork`` and ``exec``: every descendant ignores it), and one
    thread started first keeps it unblocked, to receive it; Python then runs
    the handler in the main thread. Call it in the main thread before any
    other thread starts (threads inherit the mask of the thread that starts them).
    """
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(PREEMPT_SIGNAL, _on_stop_signal)
    receiver = threading.Thread(target=threading.Event().wait, name="unicron-signal-receiver", daemon=True)
    receiver.start()  # (its mask is the main thread's before the block: it receives the signal)
    signal.pthread_sigmask(signal.SIG_BLOCK, {PREEMPT_SIGNAL})


def signal_for_workers(sig: int) -> int:
    """The signal that stops the workers after the launcher got ``sig``: SIGTERM for :data:`PREEMPT_SIGNAL`
    (the workers have it blocked, see :func:`install_preemption_signal`), else ``sig`` itself."""
    return signal.SIGTERM if sig == PREEMPT_SIGNAL else sig


class LeftBeforeTraining(SignalException):
    """The node was asked to leave while it waited for a round: it ends at once, exit code 0 (not a stop)."""

    def __init__(self) -> None:
        super().__init__(f"Process {os.getpid()}: asked to leave while waiting for a round", sigval=LEAVE_SIGNAL)


def _on_leave_signal(signum: int, frame: object) -> None:
    """Ask the agent to leave; it acts in its monitor loop once its workers can leave at a step boundary.

    Raises:
        LeftBeforeTraining: The node waits in the rendezvous (:func:`leaving_ends_the_wait`).
    """
    if not _leave_requested.is_set():
        log.info("leave_requested", signal=signal.Signals(signum).name, waiting_for_a_round=_in_rendezvous.is_set())
    _leave_requested.set()
    if _in_rendezvous.is_set() and not _shutting_down.is_set():
        raise LeftBeforeTraining()


@contextmanager
def leaving_ends_the_wait() -> Iterator[None]:
    """While the node waits for a round (the rendezvous, main thread): a leave request ends the wait and the node.

    A node asked to leave before it has a round of its own (a SLURM drain
    seen as the job starts, a plan that moved the node away) takes no part:
    the others form the round without it.

    Raises:
        LeftBeforeTraining: A leave request came before the block or comes in it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _leave_requested.is_set():
        raise LeftBeforeTraining()
    _in_rendezvous.set()
    try:
        yield
    finally:
        _in_rendezvous.clear()


def install_leave_signal() -> None:
    """Make :data:`LEAVE_SIGNAL` (SIGUSR2) ask the agent to leave the task (main thread only).

    The handler sets a flag; the agent acts on it in its monitor loop
    (:meth:`~unicron_elastic.agent.agent.UnicronAgent.leave_at_step_boundary`)
    as soon as every worker of the node said it can leave. A signal during
    the workers' start-up or a restart waits for that; one while the node
    waits for a round ends it (:func:`leaving_ends_the_wait`); one after the
    workers finished changes nothing (the node exits 0).
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(LEAVE_SIGNAL, _on_leave_signal)


def raise_if_orphaned() -> None:
    """Stop like on SIGTERM when the node daemon that started this launcher died.

    A daemon killed alone (its launcher and workers still running) has lost
    the node's record; the coordinator re-plans without the node, so its
    workers must not keep training.

    Raises:
        SignalException: ``$UNICRON_NODE_DAEMON_PID`` is set and is no longer the parent.
    """
    expected = daemon_pid()
    if expected is not None and os.getppid() != expected and not _shutting_down.is_set():
        log.warning("node_daemon_gone", daemon_pid=expected)
        raise SignalException(f"Process {os.getpid()}: node daemon {expected} is gone", sigval=signal.SIGTERM)


def begin_shutdown() -> None:
    """From now on the process is cleaning up: stop signals are ignored (see :func:`install_stop_signals`)."""
    _shutting_down.set()


def leave_requested() -> bool:
    """Whether :data:`LEAVE_SIGNAL` arrived (the agent acts on it once)."""
    return _leave_requested.is_set()
