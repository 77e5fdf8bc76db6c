"""``WarmProcess``: the part of ``subprocess.Popen`` torch's agent and ours use, for a worker forked by the zygote.

The worker is the agent's child (the agent is a child subreaper and the zygote forks through a middle
process that exits), so its exit is waited for with ``waitpid`` as ``Popen`` does; the code is
``Popen``'s: the exit status, or minus the signal that killed it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence

import structlog

log = structlog.get_logger(__name__)

_POLL_S = 0.005


class WarmProcess:
    """A forked worker, waited for and signalled as a ``Popen``.

    Args:
        pid: The worker's pid (the agent's child).
        args: The command it runs (as ``Popen.args``).
    """

    def __init__(self, pid: int, args: Sequence[str]) -> None:
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        """The exit code if the worker ended (it is reaped then), else None."""
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # (reaped by someone else: its code is lost; never a success)
                    log.warning("warm_worker_lost_exit_code", pid=self.pid)
                    self.returncode = 1
                    return self.returncode
                if pid == self.pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the worker to end.

        Raises:
            subprocess.TimeoutExpired: It still runs after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
            time.sleep(_POLL_S)
        return code

    def send_signal(self, sig: int) -> None:
        """Signal the worker, unless it ended."""
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        """SIGTERM."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL."""
        self.send_signal(signal.SIGKILL)

    def __repr__(self) -> str:
        return f"WarmProcess(pid={self.pid}, returncode={self.returncode})"
