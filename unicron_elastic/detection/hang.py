"""Hang verdicts from progress, and iteration-time statistics (paper section 4.1), pure.

One :class:`IterationMonitor` per worker. A worker sends signs of life: a
heartbeat per iteration (step and duration), progress reports within the step
(micro-batch ends, gradient buckets reduced, the forward and backward of its
top-level modules and layers; at most one every few tens of milliseconds, see
:class:`~unicron_elastic.worker.WorkerChannel`), and "waiting on my group"
reports repeated while a collective of its group waits for a peer.
``check(now)`` decides:

* **hung**: no sign of life of any kind for ``allowed_silence`` seconds:
  ``hang_factor`` x the largest gap between two signs seen in the last
  ``gap_window`` iterations of this configuration, and at least
  ``min_silence``. A rank that makes progress, however slowly, keeps sending
  signs; only a gap several times longer than any it showed recently (and
  longer than the floor) is a hang. SEV2 ``task_hang``; SEV3
  ``collective_timeout`` if the worker said it is inside a collective;
* **stuck waiting**: a rank that keeps saying it waits on its group is alive
  and not the one to blame while the wait lasts (the peer that went silent
  is); a single wait longer than ``max_wait`` is a collective that never
  completes: SEV3 ``collective_timeout`` for the rank still in it (its peers'
  collectives fail at the engine's own timeout, shorter, and they regroup);
* an iteration above ``noise_factor`` x mean is noise: counted, no event;
  ``flap_window`` consecutive iterations above ``flap_factor`` x mean: link
  flapping, SEV3, observed only.

The peer that stopped answering sends nothing (a stopped process cannot), so
its silence makes it the hung one. :func:`hang_verdict` is the decision over
the reports of one agent's ranks (an agent hears only its own node's
workers); a node that froze altogether is decided by its lease, not here.

When another worker of the task fails, every survivor may stall in a
collective with it (or with a survivor that is already regrouping) until it
notices: :meth:`IterationMonitor.peer_failed` starts the silence count
``peer_failure_grace`` seconds later, time enough for the survivor to notice
and declare its own (bounded) regroup pause. A survivor truly stuck is still
found, that much later.

No alarm until an iteration after the first ``warmup`` ones of a
configuration has ended (the first steps after a start or a regroup are slow;
the gaps of the iterations after them calibrate the allowed silence),
while the worker declared a pause (checkpoint), or after a reconfiguration
until the new configuration has warmed up (statistics are reset per
configuration).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from unicron_elastic.api import ConfigError
from unicron_elastic.events import Severity


def _seconds(value: object, low: float = 0.0, high: float = 3600.0) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and low <= value <= high


@dataclass(frozen=True)
class HangThresholds:
    """Thresholds of the hang verdict and the iteration statistics (all configurable).

    Attributes:
        hang_factor: Safety factor on the largest recent gap between signs of life (``--hang-factor``).
        min_silence: Floor of the allowed silence, seconds (``--hang-min-silence``).
        gap_window: Iterations whose largest gaps calibrate the allowed silence (``--hang-gap-window``).
        max_wait: Longest single wait on the group before the rank still in it is blamed, seconds
            (``--hang-max-wait``); keep it above the engine's collective timeout (30 s).
        noise_factor: An iteration this many times the mean is noise (counted).
        flap_factor: ... and ``flap_window`` of them in a row above this factor are link flapping.
        flap_window: See ``flap_factor``.
        warmup: Iterations of a configuration without any alarm.
        peer_failure_grace: Seconds after a local peer's failure before silence counts.

    Raises:
        ConfigError: ``hang_factor`` is not a finite number above 1, ``1 < noise_factor <=
            flap_factor`` does not hold, a count is below 1, or a time is out of its range.
    """

    noise_factor: float = 1.1
    hang_factor: float = 5.0
    flap_factor: float = 1.5
    flap_window: int = 5
    warmup: int = 5
    peer_failure_grace: float = 5.0
    min_silence: float = 3.0
    gap_window: int = 100
    max_wait: float = 90.0

    def __post_init__(self) -> None:
        factors = (self.noise_factor, self.flap_factor, self.hang_factor)
        if not all(isinstance(f, (int, float)) and math.isfinite(f) for f in factors):
            raise ConfigError(f"noise_factor, flap_factor and hang_factor must be finite numbers, got {factors}")
        if not self.hang_factor > 1.0:
            raise ConfigError(f"hang_factor (--hang-factor) must be above 1, got {self.hang_factor}")
        if not 1.0 < self.noise_factor <= self.flap_factor:
            raise ConfigError(f"need 1 < noise_factor ({self.noise_factor}) <= flap_factor ({self.flap_factor})")
        if self.flap_window < 1 or self.warmup < 1 or self.gap_window < 1:
            raise ConfigError("flap_window, warmup and gap_window (--hang-gap-window) must be >= 1")
        for name, flag in (("peer_failure_grace", "--peer-failure-grace"), ("min_silence", "--hang-min-silence")):
            if not _seconds(getattr(self, name)):
                raise ConfigError(f"{name} ({flag}) must be a number of seconds in [0, 3600], got {getattr(self, name)!r}")
        if not _seconds(self.max_wait, 1.0, 86_400.0):
            raise ConfigError(f"max_wait (--hang-max-wait) must be a number of seconds in [1, 86400], "
                              f"got {self.max_wait!r}")


@dataclass(frozen=True)
class Finding:
    """A failure the monitor found.

    Attributes:
        severity: SEV2 or SEV3.
        kind: ``task_hang``, ``collective_timeout`` or ``link_flapping``.
        message: Detail with the measured times.
        since: Monotonic time the problem started (last heartbeat for hangs).
    """

    severity: Severity
    kind: str
    message: str
    since: float


class IterationMonitor:
    """Signs of life and iteration-time statistics of one worker, and its hang decision.

    Args:
        thresholds: The thresholds.

    Attributes:
        rejected: Heartbeats ignored because their duration was not a finite
            number >= 0 (they never reach the statistics).
    """

    def __init__(self, thresholds: HangThresholds | None = None) -> None:
        self.thresholds = thresholds or HangThresholds()
        self.config_id: str | None = None
        self.rejected = 0
        self.reset("initial", now=0.0)

    def reset(self, config_id: str, now: float) -> None:
        """Start fresh statistics for a new configuration (reconfiguration, restart)."""
        self.config_id = config_id
        self.count = 0
        self.mean = 0.0
        self._m2 = 0.0
        self.last_beat = now  # the last sign of life of any kind
        self.noise = 0
        self._slow_run = 0
        self._slow_since = now
        self.paused = False
        self._pause_until: float | None = None
        self._grace_until: float | None = None
        self.in_collective = False
        self.waiting = False
        self._wait_since: float | None = None
        self._reported_hang = False
        self._step_gap = 0.0  # the largest gap between signs within the iteration in progress
        self._gaps: deque[float] = deque(maxlen=self.thresholds.gap_window)  # per finished iteration

    @property
    def stddev(self) -> float:
        """Standard deviation of the durations seen (0 before two)."""
        return (self._m2 / (self.count - 1)) ** 0.5 if self.count > 1 else 0.0

    @property
    def largest_gap(self) -> float:
        """The largest gap between two signs of life in the last ``gap_window`` iterations and the current one."""
        return max(self._step_gap, max(self._gaps, default=0.0))

    def _alive(self, now: float, progress: bool = True) -> None:
        """A sign of life at ``now``: the gap since the previous one calibrates the allowed silence.

        Progress (not a "still waiting" report, which the watch thread of a stuck rank keeps sending) ends a
        reported hang: the rank may be found hung again.
        """
        if not self.paused and now > self.last_beat:
            self._step_gap = max(self._step_gap, now - self.last_beat)
        self.last_beat = max(self.last_beat, now)
        if progress:
            self._reported_hang = False

    def heartbeat(self, now: float, duration: float) -> Finding | None:
        """Record one finished iteration of ``duration`` seconds at ``now``.

        A duration that is not a finite number >= 0 is ignored and counted in
        ``rejected``: it changes nothing, not even the time of the last beat.

        Returns:
            A link-flapping finding when the slow run reaches the window.
        """
        if not (isinstance(duration, (int, float)) and math.isfinite(duration) and duration >= 0):
            self.rejected += 1
            return None
        finding = self._flapping(now, duration)
        self.count += 1
        delta = duration - self.mean
        self.mean += delta / self.count
        self._m2 += delta * (duration - self.mean)
        self._alive(now)
        if self.count > self.thresholds.warmup:  # the warmup's slow first iterations calibrate nothing
            self._gaps.append(self._step_gap)
        self._step_gap = 0.0
        self._grace_until = None
        self.in_collective = False
        self.waiting = False
        self._wait_since = None
        return finding

    def _flapping(self, now: float, duration: float) -> Finding | None:
        """Count noise and slow runs of iterations; a link-flapping finding when a run reaches the window."""
        t = self.thresholds
        if self.count < t.warmup or self.mean <= 0:
            return None
        if duration > t.noise_factor * self.mean:
            self.noise += 1
        if duration <= t.flap_factor * self.mean:
            self._slow_run = 0
            return None
        if self._slow_run == 0:
            self._slow_since = now - duration
        self._slow_run += 1
        if self._slow_run != t.flap_window:
            return None
        return Finding(Severity.SEV3, "link_flapping",
                       f"{t.flap_window} iterations slower than {t.flap_factor}x the mean {self.mean:.3f}s",
                       self._slow_since)

    def sign(self, now: float) -> None:
        """A sign of life that is not an iteration (progress within the step): silence counts from ``now``."""
        self._alive(now)

    def peer_failed(self, now: float) -> None:
        """Another worker of the task failed at ``now``: silence counts from ``peer_failure_grace`` later.

        Until this worker notices the failure it may wait in a collective; once
        it does, its regroup is a declared pause. The grace ends with its next
        heartbeat.
        """
        until = now + self.thresholds.peer_failure_grace
        self._grace_until = until if self._grace_until is None else max(self._grace_until, until)

    def set_state(self, now: float, *, paused: bool | None = None, in_collective: bool | None = None,
                  pause_for: float | None = None, waiting: bool | None = None) -> None:
        """The worker entered or left a pause (checkpoint, regroup), a collective, or a wait on its group.

        A pause with ``pause_for`` seconds protects the worker only that long:
        after it, silence counts towards a hang again (a stuck regroup is found).
        ``waiting`` True is repeated while the worker waits on its group: each
        report counts as a sign of life (the first starts the wait's clock,
        bounded by ``max_wait``); False ends the wait, and silence counts from then.
        """
        if waiting is not None:
            if waiting or self.waiting:
                self._alive(now, progress=False)
            if waiting and not self.waiting:
                self._wait_since = now
            elif not waiting:
                self._wait_since = None
            self.waiting = waiting
        if paused is not None:
            if self.paused and not paused:
                self.last_beat = max(self.last_beat, now)  # the pause does not count towards a hang, nor as a gap
            if paused:
                bounded = pause_for is not None and math.isfinite(pause_for) and pause_for >= 0
                self._pause_until = now + pause_for if bounded else None
            self.paused = paused
        if in_collective is not None:
            self.in_collective = in_collective

    def deadline(self) -> float | None:
        """Monotonic time after which this worker is hung (None: no alarm possible now)."""
        if not self._gaps or self._reported_hang:  # warming up: no iteration after the warmup calibrated the gaps
            return None
        if self.paused:
            if self._pause_until is None:
                return None
            return self._pause_until + self.allowed_silence  # the bound passed: watched again
        since = self.last_beat if self._grace_until is None else max(self.last_beat, self._grace_until)
        silent_until = since + self.allowed_silence
        if self.waiting and self._wait_since is not None:
            return min(silent_until, self._wait_since + self.thresholds.max_wait)
        return silent_until

    @property
    def allowed_silence(self) -> float:
        """Seconds without any sign of life that are not yet a hang: ``hang_factor`` x :attr:`largest_gap`,
        at least ``min_silence``."""
        return max(self.thresholds.hang_factor * self.largest_gap, self.thresholds.min_silence)

    def report(self, rank: int) -> RankReport:
        """What this monitor knows of ``rank``, for :func:`hang_verdict`."""
        phase = "waiting" if self.waiting else "paused" if self.paused else "running"
        return RankReport(rank, phase, self.last_beat, self.deadline())

    def check(self, now: float) -> Finding | None:
        """A hang finding if the worker has been silent (or waiting) too long (reported once per hang)."""
        deadline = self.deadline()
        if deadline is None or now <= deadline:
            return None
        return self.finding(now)

    def finding(self, now: float) -> Finding:
        """The hang finding of a worker found hung at ``now`` (marks it reported: once per hang)."""
        self._reported_hang = True
        silent = now - self.last_beat
        if self.waiting and self._wait_since is not None and now - self._wait_since > self.thresholds.max_wait:
            return Finding(Severity.SEV3, "collective_timeout",
                           f"waiting on its group for {now - self._wait_since:.2f}s "
                           f"(> max_wait {self.thresholds.max_wait:g}s): a collective that never completes",
                           self._wait_since)
        bound = (f"> {self.thresholds.hang_factor:g}x the largest recent gap {self.largest_gap:.3f}s, "
                 f"at least {self.thresholds.min_silence:g}s")
        if self.in_collective:
            return Finding(Severity.SEV3, "collective_timeout",
                           f"stuck in a collective for {silent:.2f}s ({bound})", self.last_beat)
        return Finding(Severity.SEV2, "task_hang", f"no progress for {silent:.2f}s ({bound})", self.last_beat)


@dataclass(frozen=True)
class RankReport:
    """One rank as its agent's monitor sees it.

    Attributes:
        rank: The global rank.
        phase: ``running`` (computing: its heartbeats count), ``waiting``
            (blocked on its group, saying so), ``paused`` (a declared pause).
        last_sign: Monotonic time of its last heartbeat or wait report.
        deadline: Monotonic time after which its silence is a hang; None
            while no alarm is possible (warming up, an unbounded pause, a
            hang already reported).
    """

    rank: int
    phase: str
    last_sign: float
    deadline: float | None


@dataclass(frozen=True)
class HangVerdict:
    """Who stopped answering, and who is only waiting on them.

    Attributes:
        hung: Ranks silent past their deadline: restart each (SEV2).
        waiting: Ranks blocked on their group and still saying so: spared.
    """

    hung: tuple[int, ...]
    waiting: tuple[int, ...]


def hang_verdict(reports: Mapping[int, RankReport], now: float) -> HangVerdict:
    """Decide, from the reports of one agent's ranks, which of them are hung.

    A rank waiting on its group keeps reporting while it waits, so it stays
    within its deadline: only the rank that went silent is blamed, never the
    peers blocked on it. A slow rank is never blamed while its heartbeats (or
    its wait reports) keep coming within its deadline. An agent hears its
    own node's ranks only: a node that froze is not decided here but by its
    lease, which expires (the node detector of every other agent, SEV1).

    Args:
        reports: Rank -> its report.
        now: Monotonic time of the decision.

    Returns:
        The verdict (ranks sorted).
    """
    hung, waiting = [], []
    for rank, report in sorted(reports.items()):
        if report.deadline is not None and now > report.deadline:
            hung.append(rank)
        elif report.phase == "waiting":
            waiting.append(rank)
    return HangVerdict(tuple(hung), tuple(waiting))
