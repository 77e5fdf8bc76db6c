"""The worker's side of unicron: tell the local agent how training goes.

Use it from a training script (the Lightning strategy does it for you)::

    from unicron_elastic.worker import get_worker

    w = get_worker()                  # no-op when not started by unicron-run
    w.hello(resumable=True)           # I can be restarted alone (state from a peer)
    for step in range(steps):
        t0 = time.monotonic()
        loss = w.run_step(lambda: train_step(step), step)   # SEV3 -> retried in place
        w.heartbeat(step, time.monotonic() - t0)

Messages are JSON datagrams on the UNIX socket named by ``UNICRON_AGENT_SOCKET``.
If the agent is gone, messages are dropped at once (counted in ``dropped``).
When it is only behind (its queue is full: Linux queues at most
``net.unix.max_dgram_qlen`` datagrams, 10 by default, for all the node's
workers), a heartbeat, a progress report or a repeated "still waiting" is
dropped (the next one replaces it), and any other message (a pause, a rejoin
request, an exception) waits for room, at most ``deliver_within`` seconds:
losing one would make the agent take a paused worker for hung or a left-out
one for failed. An uncaught exception is reported before the process dies
(:meth:`WorkerChannel.install_excepthook`; ``get_worker`` installs it). An
uncaught exception whose class says ``rejoin = True`` (the engine's ``Excluded``:
alive but left out of a membership record) first asks the agent to start the
worker again as a joiner (:meth:`WorkerChannel.request_rejoin`): no failure.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, TypeVar

from unicron_elastic.env import agent_socket

T = TypeVar("T")
_MAX_TRACEBACK = 8000
#: Longest reason a rejoin request carries (the agent refuses longer ones).
MAX_REASON = 1000


def lossy(msg: dict[str, Any]) -> bool:
    """Whether a later message replaces ``msg`` (a heartbeat, a progress report, a repeated "still waiting").

    Such a message is dropped when the agent's queue is full; any other waits for room.
    """
    return msg["t"] in ("beat", "progress") or (msg["t"] == "state" and msg.get("waiting") is True)


def wants_rejoin(exc: BaseException | None) -> bool:
    """Whether ``exc`` asks for a rejoin (its ``rejoin`` attribute is ``True``), duck-typed: no strategy import."""
    return exc is not None and getattr(exc, "rejoin", False) is True


class WorkerChannel:
    """A worker's connection to its agent (inactive without ``UNICRON_AGENT_SOCKET``).

    Args:
        agent_path: The agent's socket; default from the environment.
        rank: Global rank; default ``$RANK``.
        deliver_within: Seconds a message that is not :func:`lossy` waits for
            room in the agent's queue before it is dropped.
        progress_interval: The shortest time between two progress messages (:meth:`progress`).
    """

    def __init__(self, agent_path: str | None = None, rank: int | None = None, deliver_within: float = 5.0,
                 progress_interval: float = 0.05) -> None:
        self.agent_path = agent_path if agent_path is not None else agent_socket()
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        self.deliver_within = deliver_within
        self.progress_interval = progress_interval
        self._progress_sent = -math.inf
        self.dropped = 0
        self.active = bool(self.agent_path)
        self._sock: socket.socket | None = None
        self.reply_path = ""
        if self.active:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)
            directory = os.path.dirname(self.agent_path)
            self.reply_path = os.path.join(directory, f"w{self.rank}-{os.getpid()}.sock")
            self._sock.bind(self.reply_path)
            atexit.register(self.close)

    def _send(self, msg: dict[str, Any]) -> None:
        """Send ``msg``; see the module's docstring for when it is dropped instead (counted in ``dropped``)."""
        if not self.active or self._sock is None:
            return
        msg["rank"] = self.rank
        raw = json.dumps(msg, separators=(",", ":")).encode()
        deadline = None if lossy(msg) else time.monotonic() + self.deliver_within
        pause = 0.001
        while True:
            try:
                self._sock.sendto(raw, self.agent_path)
                return
            except BlockingIOError:  # the agent's queue is full: it is behind
                if deadline is None or time.monotonic() >= deadline:
                    break
                time.sleep(pause)
                pause = min(pause * 2, 0.02)
            except OSError:  # the agent is gone: never block training
                break
        self.dropped += 1

    def hello(self, resumable: bool = False, leavable: bool = False, growable: bool = False) -> None:
        """Introduce this worker.

        Args:
            resumable: The agent may restart it alone (it rejoins from a replica).
            leavable: It can leave its data-parallel group at a step boundary
                when asked (an ``ElasticDataParallel`` rank without a
                ``schedule``): the agent may then take its node out of the task
                without stopping it.
            growable: Its group admits joiners with ranks up to
                ``$UNICRON_MAX_WORLD`` (past ``WORLD_SIZE``): a node arriving
                later may grow the run in place instead of waiting for a lost
                node's place.
        """
        self._send({"t": "hello", "pid": os.getpid(), "resumable": bool(resumable), "leavable": bool(leavable),
                    "growable": bool(growable), "reply": self.reply_path})

    def heartbeat(self, step: int, duration: float, busy: float | None = None) -> None:
        """One iteration finished after ``duration`` seconds.

        Args:
            step: The iteration.
            duration: Seconds since the previous heartbeat.
            busy: Of those, the seconds not spent waiting on the group (the
                straggler detector compares them across ranks); None: unknown.
        """
        msg: dict[str, Any] = {"t": "beat", "step": int(step), "dur": float(duration)}
        if busy is not None:
            msg["busy"] = min(max(float(busy), 0.0), float(duration))
        self._send(msg)
        self._progress_sent = time.monotonic()

    def progress(self, step: int, micro_batch: int = 0) -> None:
        """Progress within ``step`` (a micro-batch, a bucket reduced, a module's forward or backward).

        Cheap enough to call at every such point: it sends a message only when
        ``progress_interval`` seconds passed since the last heartbeat or
        progress message, so the agent hears of progress at most that often
        (a lossy message: dropped when the agent's queue is full). The hang
        detector counts each as a sign of life, and calibrates its bound
        from the gaps between them.
        """
        now = time.monotonic()
        if now - self._progress_sent < self.progress_interval:
            return
        self._progress_sent = now
        self._send({"t": "progress", "step": int(step), "mb": int(micro_batch)})

    @contextmanager
    def _flag(self, name: str) -> Iterator[None]:
        self._send({"t": "state", name: True})
        try:
            yield
        finally:
            self._send({"t": "state", name: False})

    def set_paused(self, paused: bool, pause_for: float | None = None) -> None:
        """Enter or leave a pause that must not count as a hang (see :meth:`checkpointing`).

        Args:
            paused: Entering (True) or leaving the pause.
            pause_for: A bound in seconds: a worker still paused after it is
                watched for hangs again (a regroup that got stuck is found).
                None: unbounded.
        """
        msg: dict[str, Any] = {"t": "state", "paused": bool(paused)}
        if paused and pause_for is not None:
            msg["pause_for"] = float(pause_for)
        self._send(msg)

    def checkpointing(self) -> AbstractContextManager[None]:
        """A pause (checkpoint, evaluation) that must not count as a hang."""
        return self._flag("paused")

    def collective(self) -> AbstractContextManager[None]:
        """Inside a collective: a stall here is a collective timeout (SEV3)."""
        return self._flag("collective")

    def waiting(self, waiting: bool) -> None:
        """Blocked on the group (a collective waiting for a peer), repeated while it lasts; False when it ends.

        The hang detector spares a rank that keeps saying so and blames the
        one that went silent: the peer it waits on.
        """
        self._send({"t": "state", "waiting": bool(waiting)})

    def report_exception(self, exc: BaseException, step: int = -1, fatal: bool = True) -> None:
        """Send an exception to the agent for classification."""
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-_MAX_TRACEBACK:]
        self._send({"t": "exc", "type": type(exc).__name__[:256], "msg": str(exc)[:2000], "tb": tb,
                    "step": int(step), "fatal": bool(fatal)})

    def request_rejoin(self, reason: str) -> None:
        """Ask the agent to start this worker again as a joiner once its process exits.

        For a rank that is alive but was left out of its group (a replica that
        lost a peer): its exit is no failure (no error event, no restart
        counted against ``max_worker_restarts``); the agent restarts it with a
        new incarnation so it joins the running group. Exiting with code 0
        afterwards still means finished.

        Args:
            reason: Why, for the agent's log (truncated to :data:`MAX_REASON` characters).
        """
        self._send({"t": "rejoin", "pid": os.getpid(), "reason": str(reason)[:MAX_REASON]})

    def wait_verdict(self, timeout: float) -> dict[str, Any] | None:
        """Wait up to ``timeout`` seconds for the agent's verdict on a reported exception."""
        if not self.active or self._sock is None:
            return None
        self._sock.settimeout(timeout)
        try:
            return json.loads(self._sock.recv(65536))
        except (OSError, ValueError):
            return None
        finally:
            self._sock.setblocking(False)

    def run_step(self, fn: Callable[[], T], step: int, verdict_timeout: float = 5.0) -> T:
        """Run ``fn``; on an exception ask the agent and retry while it says ``reattempt``.

        Raises:
            Exception: The step's exception when the agent does not say reattempt
                (or is absent), and at once (not reported) one that asks for a
                rejoin (:func:`wants_rejoin`); the process then dies and the agent handles it.
        """
        while True:
            try:
                return fn()
            except Exception as exc:  # noqa: BLE001 - the agent decides
                if not self.active or wants_rejoin(exc):  # left out: no step failure to retry
                    raise
                self._drain()
                self.report_exception(exc, step, fatal=False)
                verdict = self.wait_verdict(verdict_timeout)
                if not verdict or verdict.get("action") != "reattempt":
                    raise

    def _drain(self) -> None:
        if self._sock is None:
            return
        while True:
            try:
                self._sock.recv(65536)
            except OSError:
                return

    def install_excepthook(self) -> None:
        """Report an uncaught exception to the agent before the default hook runs.

        One that asks for a rejoin (:func:`wants_rejoin`) is preceded by a
        rejoin request (:meth:`request_rejoin`), so the agent restarts the
        worker as a joiner instead of counting a failure.
        """
        previous = sys.excepthook

        def hook(exc_type, exc, tb):  # type: ignore[no-untyped-def]
            if exc is not None and not isinstance(exc, (KeyboardInterrupt, SystemExit)):
                if wants_rejoin(exc):
                    self.request_rejoin(f"{type(exc).__name__}: {exc}")
                self.report_exception(exc.with_traceback(tb), fatal=True)
            previous(exc_type, exc, tb)

        sys.excepthook = hook

    def close(self) -> None:
        """Say goodbye (no more heartbeats to expect), close and remove this worker's socket."""
        if self._sock is not None:
            self._send({"t": "state", "paused": True, "exiting": True})
            self._sock.close()
            self._sock = None
            try:
                os.unlink(self.reply_path)
            except OSError:
                pass


_WORKER: WorkerChannel | None = None


def get_worker() -> WorkerChannel:
    """This process's channel (created on first use, with the exception hook installed)."""
    global _WORKER
    if _WORKER is None:
        _WORKER = WorkerChannel()
        if _WORKER.active:
            _WORKER.install_excepthook()
    return _WORKER
