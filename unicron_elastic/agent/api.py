"""The agent's extension and configuration types: ``AgentConfig``, the ``Detector`` interface, ``NodeGaveUp``.

A leaf module (in the manner of ``torch.distributed.elastic``'s ``api.py``):
plugins and the launcher import these without importing the agent.
"""

from __future__ import annotations

import os
import socket
from abc import ABC
from dataclasses import dataclass, field
from subprocess import Popen
from typing import TYPE_CHECKING, Any, Protocol

from unicron_elastic.agent.warm.api import WarmConfig
from unicron_elastic.api import ConfigError, UnicronError
from unicron_elastic.detection.hang import Finding, HangThresholds
from unicron_elastic.detection.straggler import StragglerThresholds
from unicron_elastic.events import Classification, ErrorEvent

if TYPE_CHECKING:
    from unicron_elastic.store.client import StatusStore

#: Exit code of an agent that gave up its node (SEV1): EX_TEMPFAIL.
EXIT_GIVE_UP = 75
#: The built-in detectors, in ``--detectors``' default order.
ALL_DETECTORS = ("node", "process", "exception", "hang", "straggler", "nvml")


@dataclass(frozen=True)
class LadderPolicy:
    """Bounds of the ladder.

    Attributes:
        max_reattempts: SEV3 reattempts per step.
        max_worker_restarts: SEV2 restarts per rank.
        max_rejoins: Restarts as a joiner per rank after a ``left_out`` exit
            (not counted as restarts); past it such an exit is a SEV2.

    Raises:
        ConfigError: A bound is negative.
    """

    max_reattempts: int = 3
    max_worker_restarts: int = 3
    max_rejoins: int = 10

    def __post_init__(self) -> None:
        if self.max_reattempts < 0 or self.max_worker_restarts < 0 or self.max_rejoins < 0:
            raise ConfigError("max_reattempts, max_worker_restarts and max_rejoins must be >= 0")


class DetectorContext(Protocol):
    """What a detector may ask of the agent."""

    node: str
    store: StatusStore | None

    def workers(self) -> dict[int, tuple[int, Popen]]:
        """``local_rank -> (global rank, process)`` of the running workers."""

    def worker_exited(self, local_rank: int, pid: int, exitcode: int, detected_at: float) -> None:
        """A worker process ended with a non-zero exit code."""

    def exception(self, rank: int, msg: dict[str, Any], classification: Classification, received: float) -> None:
        """A worker reported an exception."""

    def hang(self, rank: int, finding: Finding) -> None:
        """A rank's finding: a hang or a collective timeout (acted on), link flapping or a straggler (published
        only)."""

    def report(self, event: ErrorEvent) -> None:
        """Publish an event that needs no worker action (e.g. another node lost)."""

    def lost_own_lease(self) -> None:
        """This node's lease expired: peers consider it dead."""

    def classify(self, exc_type: str, message: str, traceback: str) -> Classification:
        """Classify an exception through the plugins."""


class Detector(ABC):  # noqa: B024 - every method has a sensible default
    """A detector; override what you need.

    Attributes:
        name: Name used in ``--detectors``.
        dropped: Worker messages ignored because their rank is not one of
            this agent's workers (detectors that check it).
    """

    name = "detector"
    dropped = 0

    def start(self, ctx: DetectorContext) -> None:
        """Start watching (called once, after the first rendezvous)."""
        self.ctx = ctx

    def stop(self) -> None:
        """Stop watching."""

    def on_message(self, msg: dict[str, Any], received: float) -> None:
        """A worker message arrived (heartbeat, state, exception ...)."""

    def on_workers_started(self, local_ranks: list[int], incarnation: str) -> None:
        """Workers were (re)started: ``local_ranks`` have fresh processes, of ``incarnation``
        (``<node>.<rendezvous count>.<restarts>``; an opaque label to detectors)."""

    def on_rank_failed(self, rank: int, now: float) -> None:
        """Worker ``rank`` died (monotonic ``now``): the others may stall in collectives with it for a moment."""


class NodeGaveUp(UnicronError):
    """The node gave up its assignment (SEV1); ``unicron-run`` exits with 75."""

    exit_code = EXIT_GIVE_UP


@dataclass(frozen=True)
class AgentConfig:
    """unicron's agent settings (``unicron-run`` flags).

    Attributes:
        detectors: Names of the detectors to run.
        hang: Thresholds of the hang verdict.
        straggler: When a rank is reported as a straggler.
        ladder: Bounds of the escalation ladder.
        node_ttl: Lease TTL of the node in etcd (seconds).
        node: This node's name.
        warm: How the workers are started: forked from a preloaded zygote, or plain subprocesses.
    """

    detectors: tuple[str, ...] = ALL_DETECTORS
    hang: HangThresholds = field(default_factory=HangThresholds)
    straggler: StragglerThresholds = field(default_factory=StragglerThresholds)
    ladder: LadderPolicy = field(default_factory=LadderPolicy)
    node_ttl: int = 2
    node: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    warm: WarmConfig = field(default_factory=lambda: WarmConfig(preload=()))  # (opt-in: --preload auto)

    def __post_init__(self) -> None:
        """Refuse settings that would switch detection off silently.

        Raises:
            ConfigError: No detector is named, or ``node_ttl`` is not a whole number >= 1.
        """
        if not self.detectors:
            raise ConfigError("--detectors names no detector; known: " + ", ".join(ALL_DETECTORS))
        if isinstance(self.node_ttl, bool) or not isinstance(self.node_ttl, int) or self.node_ttl < 1:
            raise ConfigError(f"--node-ttl (node_ttl={self.node_ttl!r}) must be a whole number of seconds >= 1")
