"""torch's ``SubprocessHandler`` with its ``Popen`` taken from the warm pool (a plain one where the pool says no)."""

from __future__ import annotations

import sys
from subprocess import Popen
from typing import Any

from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler
from typing_extensions import override

from unicron_elastic.agent.warm.pool import WarmPool


class WarmSubprocessHandler(SubprocessHandler):
    """A worker of torch's ``SubprocessContext``, forked from the zygote where it can be.

    Everything else is torch's: the stdout and stderr files it opens, the NUMA wrapper of the command,
    ``close()`` signalling the worker's process group (the fork leads a session of its own).

    Args:
        pool: The agent's pool.
        *args: torch's ``SubprocessHandler`` arguments.
        **kwargs: Those by name.
    """

    def __init__(self, pool: WarmPool, *args: Any, **kwargs: Any) -> None:
        self._pool = pool
        super().__init__(*args, **kwargs)

    @override
    def _popen(self, args: tuple, env: dict[str, str]) -> Popen:
        stdout = self._stdout.fileno() if self._stdout else sys.stdout.fileno()
        stderr = self._stderr.fileno() if self._stderr else sys.stderr.fileno()
        proc = self._pool.spawn(args, env, stdout, stderr)
        return proc if proc is not None else super()._popen(args, env)  # type: ignore[return-value]
