"""A rank blocked on a peer that stopped answering: say so, and give the group up once the peer is gone.

A collective of the step waits until every member reaches it. When a member
dies, its connections reset and the collective fails at once; when it hangs
(a stuck kernel, a deadlock, a stopped process, a frozen host, a partition)
nothing resets and the collective would wait for its timeout. The engine
wraps every wait on its groups in :meth:`GroupWatch.waiting`, and the watch's
thread does two things while a wait lasts:

* after ``report_after`` seconds it tells the agent "waiting on the group",
  repeated every ``refresh`` seconds (``report(True)``; ``report(False)``
  when the wait ends): the agent's hang detector spares a rank that keeps
  saying so and blames the one that went silent, the peer that hangs (a
  stopped process says nothing), whose agent restarts it: a lost rank the
  survivors resolve as after a kill;
* after ``check_after`` seconds it asks ``gone()`` every ``poll`` seconds
  whether a member is gone (its liveness key: deleted when its agent
  restarted it, expired with its node's lease when the node froze); once one
  is, it calls ``interrupt(reason)`` (once per wait), which makes the wait fail here as a
  reset would (:meth:`~unicron_elastic.strategy.engine.transport.CollectiveTransport.interrupt`),
  and the engine regroups without the member.

The thread only reads a timestamp the main thread writes; entering and
leaving a wait costs the main thread two attribute writes and a lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import structlog

from unicron_elastic.api import ConfigError

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class WatchTimes:
    """When the watch reports a wait and checks the members (seconds).

    Attributes:
        report_after: A wait this long is reported to the agent.
        refresh: The report is repeated this often while the wait lasts
            (well below the hang detector's shortest allowed silence, 0.5 s by default).
        check_after: A wait this long makes the watch check the members' liveness.
        poll: How often it checks them while the wait lasts.

    Raises:
        ConfigError: A time is not a number of seconds in (0, 60].
    """

    report_after: float = 0.1
    refresh: float = 0.15
    check_after: float = 0.3
    poll: float = 0.2

    def __post_init__(self) -> None:
        for name in ("report_after", "refresh", "check_after", "poll"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value <= 60):
                raise ConfigError(f"WatchTimes.{name} must be a number of seconds in (0, 60], got {value!r}")

    @property
    def tick(self) -> float:
        """How often the thread looks at the main thread's wait."""
        return min(self.report_after, self.refresh, self.check_after, self.poll) / 2


class GroupWatch:
    """Watches the engine's waits on its groups from a thread of its own.

    Args:
        report: ``report(waiting)`` tells the agent (e.g. :meth:`~unicron_elastic.worker.WorkerChannel.waiting`).
        gone: Returns why the group cannot complete (a member gone), or None while every member is alive.
        interrupt: ``interrupt(reason)`` makes the engine's operations in flight fail (any thread).
        times: When to report and check.

    Attributes:
        interrupted: Waits given up because a member was gone.
        waited: Seconds the main thread spent in waits so far (a step's busy time is its duration less its waits).
    """

    def __init__(self, report: Callable[[bool], None], gone: Callable[[], str | None],
                 interrupt: Callable[[str], None], times: WatchTimes | None = None) -> None:
        self.times = times or WatchTimes()
        self._report, self._gone, self._interrupt = report, gone, interrupt
        self._lock = threading.Lock()
        self._since: float | None = None  # monotonic start of the main thread's wait
        self._what = ""
        self._reported = False
        self.interrupted = 0
        self.waited = 0.0
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    @contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """The main thread waits on its group (``what``: the operation, for logs) inside this block."""
        self._start()
        began = time.monotonic()
        with self._lock:
            self._since, self._what = began, what
        try:
            yield
        finally:
            self.waited += time.monotonic() - began
            with self._lock:
                self._since = None
                reported, self._reported = self._reported, False
                if reported:
                    self._safe_report(False)

    def _start(self) -> None:
        if self._thread is None and not self._closed.is_set():
            self._thread = threading.Thread(target=self._run, daemon=True, name="unicron-group-watch")
            self._thread.start()

    def _run(self) -> None:
        times, last_report, next_poll, seen = self.times, 0.0, 0.0, None
        while not self._closed.wait(times.tick):
            since = self._since
            if since is None:
                continue
            now = time.monotonic()
            if since != seen:  # a new wait
                seen, last_report, next_poll = since, 0.0, since + times.check_after
            waited = now - since
            if waited >= times.report_after and now - last_report >= times.refresh:
                last_report = now
                with self._lock:
                    if self._since == since:
                        self._reported = True
                        self._safe_report(True)
            if now >= next_poll:
                next_poll = now + times.poll
                if self._check(since, waited):
                    next_poll = float("inf")  # interrupted once: this wait is failing, the next one is watched

    def _check(self, since: float, waited: float) -> bool:
        """Ask whether a member is gone; if so (and the same wait still lasts) interrupt the group.

        Returns:
            Whether it interrupted the wait.
        """
        try:
            reason = self._gone()
        except Exception as exc:  # noqa: BLE001 - an unreachable store: the collective's own timeout remains
            log.debug("group_watch_check_failed", error=str(exc)[:200])
            return False
        if reason is None:
            return False
        with self._lock:
            if self._since != since:
                return False  # the wait ended meanwhile
            what = self._what
        log.warning("dp_wait_interrupted", waiting_on=what, waited_s=round(waited, 3), reason=reason[:200])
        self.interrupted += 1
        try:
            self._interrupt(reason)
        except Exception:  # noqa: BLE001 - the collective's own timeout remains
            log.exception("group_watch_interrupt_failed")
        return True

    def _safe_report(self, waiting: bool) -> None:
        try:
            self._report(waiting)
        except Exception:  # noqa: BLE001 - reporting must never break the wait
            log.debug("group_watch_report_failed", exc_info=True)

    def close(self) -> None:
        """Stop the thread (a wait in progress is no longer watched)."""
        self._closed.set()
