"""``DetectorSet``: one agent's detectors told as one, each call isolated, and stopping within a deadline.

A broken detector (a plugin's, most likely) is logged and never stops the agent or the other detectors.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from unicron_elastic.agent.api import Detector, DetectorContext

log = structlog.get_logger(__name__)


class DetectorSet:
    """The detectors of one agent.

    Args:
        detectors: The detectors, in the order ``--detectors`` names them.
    """

    def __init__(self, detectors: list[Detector]) -> None:
        self._detectors = list(detectors)

    @property
    def watches_peers(self) -> bool:
        """Whether a detector wants to hear of lost peer nodes (it has ``peer_lost``)."""
        return any(hasattr(d, "peer_lost") for d in self._detectors)

    def start(self, ctx: DetectorContext) -> None:
        """Start every detector, reporting to ``ctx`` (the agent)."""
        for detector in self._detectors:
            try:
                detector.start(ctx)
            except Exception:  # noqa: BLE001 - a broken detector must not stop the agent
                log.exception("detector_start_failed", detector=detector.name)

    def workers_started(self, local_ranks: list[int], incarnation: str) -> None:
        """Fresh processes run ``local_ranks``, as ``incarnation``."""
        for detector in self._detectors:
            try:
                detector.on_workers_started(local_ranks, incarnation)
            except Exception:  # noqa: BLE001
                log.exception("detector_failed", detector=detector.name)

    def rank_failed(self, rank: int) -> None:
        """The worker of ``rank`` died now: its peers may wait in a collective with it, which is not a hang."""
        now = time.monotonic()
        for detector in self._detectors:
            try:
                detector.on_rank_failed(rank, now)
            except Exception:  # noqa: BLE001 - isolate plugin detectors
                log.exception("detector_failed", detector=detector.name)

    def peer_lost(self, node: str, revision: int) -> None:
        """Another node of this round is lost (the meeting point's watch): the detectors that care report it."""
        for detector in self._detectors:
            if hasattr(detector, "peer_lost"):
                try:
                    detector.peer_lost(node, revision)
                except Exception:  # noqa: BLE001 - isolate plugin detectors
                    log.exception("detector_failed", detector=detector.name)

    def message(self, msg: dict[str, Any], received: float) -> None:
        """A worker's message arrived (monotonic ``received``)."""
        for detector in self._detectors:
            try:
                detector.on_message(msg, received)
            except Exception:  # noqa: BLE001 - isolate plugin detectors
                log.exception("detector_failed", detector=detector.name)

    def stop(self, deadline: float) -> None:
        """Stop every detector, waiting for each until the monotonic ``deadline`` at most."""
        for detector in self._detectors:
            bounded(detector.stop, detector.name, deadline)


def bounded(stop: Callable[[], None], name: str, deadline: float) -> None:
    """Run ``stop`` on a daemon thread, waiting for it until the monotonic ``deadline`` at most.

    A ``stop`` still running then is left to its thread (it may wait on an unreachable etcd); its errors
    are logged.
    """
    def run() -> None:
        try:
            stop()
        except Exception:  # noqa: BLE001
            log.exception("detector_stop_failed", detector=name)

    thread = threading.Thread(target=run, daemon=True, name=f"unicron-stop-{name}")
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    if thread.is_alive():
        log.error("detector_stop_timeout", detector=name)
