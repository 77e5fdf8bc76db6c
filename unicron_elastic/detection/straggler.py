"""Stragglers: ranks whose steps are persistently slower than their peers', reported, never restarted (pure).

A data-parallel group is as fast as its slowest rank: every rank's iteration
takes the same time, the fast ones waiting in the step's collectives for the
slow one. What tells them apart is the time a rank was *busy* in a step: the
step's duration minus the time it waited on its group (the engine's watched
waits, :class:`~unicron_elastic.strategy.engine.group_watch.GroupWatch`),
which each heartbeat carries. :class:`StragglerWatch` keeps the last
``window`` busy times of each of an agent's ranks and flags a rank whose median
exceeds ``factor`` x the median of its peers' medians, as Megatron-LM's
straggler detector reports its slowest ranks: an event (SEV3 ``straggler``)
and a metric, for the operator and the coordinator's plan; a straggler makes
progress, so nothing restarts it. A rank is flagged once per episode: again
only after its median came back within halfway to its peers' (1.25 x for a
factor of 1.5), so a rank near the factor is not reported on and off.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from unicron_elastic.api import ConfigError


@dataclass(frozen=True)
class StragglerThresholds:
    """When a rank is a straggler (``--straggler-factor``, ``--straggler-window``).

    Attributes:
        factor: Its median busy time over ``factor`` x its peers' median.
        window: Steps whose busy times each median is taken over.
        warmup: Steps of each process not counted (start-up, the first snapshot, a joiner's state transfer).

    Raises:
        ConfigError: ``factor`` is not a finite number above 1, or ``window`` is below 3.
    """

    factor: float = 1.5
    window: int = 10
    warmup: int = 5

    @property
    def recovered(self) -> float:
        """A flagged rank's episode ends when its median is back within this factor (halfway to 1: no flapping)."""
        return 1 + (self.factor - 1) / 2

    def __post_init__(self) -> None:
        if not (isinstance(self.factor, (int, float)) and math.isfinite(self.factor) and self.factor > 1):
            raise ConfigError(f"--straggler-factor must be a finite number above 1, got {self.factor!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 3:
            raise ConfigError(f"--straggler-window must be a whole number of steps >= 3, got {self.window!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ConfigError(f"straggler warmup must be a whole number of steps >= 0, got {self.warmup!r}")


@dataclass(frozen=True)
class Straggler:
    """A rank found persistently slower than its peers.

    Attributes:
        rank: The global rank.
        busy: Its median busy seconds per step over the window.
        peers: The median of its peers' medians.
        steps: The steps the medians were taken over.
    """

    rank: int
    busy: float
    peers: float
    steps: int

    @property
    def ratio(self) -> float:
        """How many times slower than its peers."""
        return self.busy / self.peers if self.peers > 0 else math.inf

    @property
    def message(self) -> str:
        return (f"median busy time {self.busy * 1000:.1f} ms per step over the last {self.steps} steps, "
                f"{self.ratio:.2f}x its peers' median {self.peers * 1000:.1f} ms")


class StragglerWatch:
    """The busy times of one agent's ranks and the straggler decision.

    Args:
        thresholds: When a rank is a straggler.
    """

    def __init__(self, thresholds: StragglerThresholds | None = None) -> None:
        self.thresholds = thresholds or StragglerThresholds()
        self._busy: dict[int, deque[float]] = {}
        self._seen: dict[int, int] = {}  # rank -> steps recorded, the warmup's included
        self.flagged: set[int] = set()

    def forget(self, rank: int) -> None:
        """Drop ``rank``'s times (it restarted or left: a new process starts a new record)."""
        self._busy.pop(rank, None)
        self._seen.pop(rank, None)
        self.flagged.discard(rank)

    def _against_peers(self) -> Iterator[tuple[int, float, float]]:
        """``(rank, its median, the median of its peers' medians)`` for each rank with a full window and peers."""
        full = {r: statistics.median(b) for r, b in self._busy.items() if len(b) == self.thresholds.window}
        for rank, own in full.items():
            peers = [m for r, m in full.items() if r != rank]
            if peers:
                yield rank, own, statistics.median(peers)

    def ratios(self) -> dict[int, float]:
        """Each rank's median busy time over its peers' median (ranks with a full window and peers only)."""
        return {rank: own / middle for rank, own, middle in self._against_peers() if middle > 0}

    def record(self, rank: int, busy: float) -> list[Straggler]:
        """One step of ``rank`` kept it busy ``busy`` seconds; the ranks that became stragglers with it.

        A value that is not a finite number >= 0 is ignored; so are the first
        ``warmup`` values of each rank.
        """
        if not (isinstance(busy, (int, float)) and math.isfinite(busy) and busy >= 0):
            return []
        self._seen[rank] = self._seen.get(rank, 0) + 1
        if self._seen[rank] <= self.thresholds.warmup:
            return []
        self._busy.setdefault(rank, deque(maxlen=self.thresholds.window)).append(float(busy))
        found = []
        for other, own, middle in self._against_peers():
            if own > self.thresholds.factor * middle and other not in self.flagged:
                self.flagged.add(other)
                found.append(Straggler(other, own, middle, self.thresholds.window))
            elif own <= self.thresholds.recovered * middle:
                self.flagged.discard(other)
        return found
