"""``LocalWorkers``: this node's worker processes as torch's agent holds them, by local and by global rank.

torch replaces its process context at every start of the group and its workers at every rendezvous, so
the view reads both again at each call.
"""

from __future__ import annotations

from collections.abc import Callable
from subprocess import Popen
from typing import Any

from torch.distributed.elastic.agent.server.api import Worker, WorkerGroup

from unicron_elastic.agent import _torch_compat


class LocalWorkers:
    """The worker processes of one agent.

    Args:
        group: torch's worker group (the same object for the agent's life; its ``workers`` change).
        pcontext: Returns torch's current process context (None while there is none).
    """

    def __init__(self, group: WorkerGroup, pcontext: Callable[[], Any]) -> None:
        self._group = group
        self._pcontext = pcontext

    def processes(self) -> dict[int, Popen]:
        """``local_rank -> process`` of torch's current process context, ended processes included."""
        return _torch_compat.worker_processes(self._pcontext())

    def by_local_rank(self) -> dict[int, tuple[int, Popen]]:
        """``local_rank -> (global rank, process)`` of the current workers."""
        ranks = {w.local_rank: w.global_rank for w in self._group.workers}
        return {lr: (ranks[lr], proc) for lr, proc in self.processes().items() if lr in ranks}

    def local_rank(self, rank: int) -> int | None:
        """The local rank of global ``rank`` (None: not a worker of this node)."""
        return next((w.local_rank for w in self._group.workers if w.global_rank == rank), None)

    def process(self, rank: int) -> Popen | None:
        """The running process of ``rank`` (None if it has none or it ended)."""
        local_rank = self.local_rank(rank)
        entry = self.by_local_rank().get(local_rank) if local_rank is not None else None
        return entry[1] if entry is not None and entry[1].poll() is None else None

    def running_ranks(self) -> list[int]:
        """The global ranks whose process runs, in order."""
        return sorted(rank for rank, _ in self.by_local_rank().values() if self.process(rank) is not None)

    def some_finished(self) -> bool:
        """Whether one of the current workers exited with code 0."""
        return any(proc.poll() == 0 for proc in self.processes().values())

    def healthy_for_now(self, handled_pids: set[int]) -> bool:
        """Whether torch's monitor must not look at the group this time.

        True while some worker runs and every other one ended with 0. True also when a worker failed
        *after* the agent's monitor polled it: its exit is not handled yet (it is at the next interval,
        or by the process detector, which waits for the agent's lock), and torch's monitor would take
        that exit for the group's failure and stop every worker, healthy ones included.

        Args:
            handled_pids: The processes whose exit the agent handled.
        """
        procs = self.processes()
        codes = {proc.pid: proc.poll() for proc in procs.values()}
        if any(code not in (None, 0) and pid not in handled_pids for pid, code in codes.items()):
            return True
        return bool(procs) and all(code in (None, 0) for code in codes.values()) and None in codes.values()

    def worker(self, local_rank: int) -> Worker:
        """torch's record of the worker of ``local_rank``."""
        return self._group.workers[local_rank]

    def can_restart_one(self) -> bool:
        """Whether torch's process context can restart one local rank alone (a script entrypoint's can)."""
        return _torch_compat.supports_per_rank_restart(self._pcontext())

    def respawn(self, local_rank: int, env: dict[str, str]) -> int:
        """Start a new process for ``local_rank`` with ``env`` added, recorded as the worker's id.

        Returns:
            The new process' pid.
        """
        pid = _torch_compat.respawn(self._pcontext(), local_rank, env)  # type: ignore[arg-type]
        self.worker(local_rank).id = pid
        return pid
