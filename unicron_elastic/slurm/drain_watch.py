"""Following this node's state in SLURM: a drain (``scontrol update ... state=drain``) makes its work leave.

SLURM does not tell a running job that one of its nodes is being drained (it
only stops scheduling new work there), so the launcher asks: one
``scontrol show node -o NAME`` per interval from each node, a few
milliseconds of slurmctld's time (at 2,048 nodes and the default 10 s, about
200 requests a second: give a longer ``--slurm-poll`` on large allocations).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import structlog

from unicron_elastic.slurm.api import SlurmCommandError, is_draining

log = structlog.get_logger(__name__)

#: Default seconds between two looks at the node's state.
POLL_S = 10.0


class NodeWatch:
    """A daemon thread that calls ``on_drain`` once, when SLURM drains node ``node``.

    A failed look (slurmctld busy or restarting) is logged and tried again
    at the next interval: it never counts as a drain.

    Args:
        node: The node's name in SLURM.
        on_drain: Called once (from the watch thread) when the node is drained.
        interval: Seconds between two looks.
        flags: How to read the node's state (default: ``scontrol show node``);
            tests pass their own.
    """

    def __init__(self, node: str, on_drain: Callable[[], None], interval: float = POLL_S,
                 flags: Callable[[str], frozenset[str]] | None = None) -> None:
        from unicron_elastic.slurm.job import node_flags

        self.node, self.on_drain, self.interval = node, on_drain, interval
        self._flags = flags or node_flags
        self._stop = threading.Event()
        self.drained = threading.Event()
        self._failures = 0
        self._thread = threading.Thread(target=self._run, name="unicron-slurm-watch", daemon=True)

    def start(self) -> NodeWatch:
        self._thread.start()
        log.info("slurm_node_watched", node=self.node, interval=self.interval)
        return self

    def stop(self) -> None:
        self._stop.set()

    def look(self) -> bool:
        """One look at the node's state; True (and ``on_drain`` called) when it is drained."""
        try:
            flags = self._flags(self.node)
        except SlurmCommandError as exc:
            self._failures += 1
            if self._failures in (1, 10) or self._failures % 100 == 0:
                log.warning("slurm_node_state_unknown", node=self.node, failures=self._failures, error=str(exc)[:200])
            return False
        self._failures = 0
        if not is_draining(flags):
            return False
        log.warning("slurm_node_drained", node=self.node, state="+".join(sorted(flags)))
        self.drained.set()
        self.on_drain()
        return True

    def _run(self) -> None:
        """A look at once (a node drained before its launcher started leaves too), then one per interval."""
        if self.look():
            return
        while not self._stop.wait(self.interval):
            if self.look():
                return
