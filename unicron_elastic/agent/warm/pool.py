"""``WarmPool``: the agent's side of the zygote, which forks workers from an interpreter that imported their modules.

The pool starts the zygote when the agent starts (its imports overlap the rendezvous), keeps
``spares`` workers forked ahead of need, and hands one its worker's command when torch starts a
worker or the agent restarts one. Whatever a fork cannot run as torchrun's subprocess would (another
interpreter, an interpreter option, an environment start-up reads differently, a zygote that is not
fork-safe or has gone) returns None: the caller starts a plain subprocess, and the pool logs why.
"""

from __future__ import annotations

import ctypes
import enum
import os
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from unicron_elastic.agent.warm import learned, wire
from unicron_elastic.agent.warm.api import AUTO, WarmConfig, WarmPoolError
from unicron_elastic.agent.warm.command import (
    ROOM_HEADER,
    PythonCommand,
    argv_block,
    auto_preload,
    env_block,
    env_mismatch,
    parse_command,
    room_for,
)
from unicron_elastic.agent.warm.process import WarmProcess
from unicron_elastic.env import ZYGOTE_ROOM

log = structlog.get_logger(__name__)

_PR_SET_CHILD_SUBREAPER = 36
#: Seconds a spare the pool discards gets to exit (it does at once when its socket closes) before SIGKILL.
_SPARE_EXIT_S = 5.0


class PoolState(enum.Enum):
    """Where the pool is: starting (the zygote imports), ready, off (plain subprocesses), closed."""

    STARTING = "starting"
    READY = "ready"
    OFF = "off"
    CLOSED = "closed"


@dataclass
class _Spare:
    """A forked worker waiting for its command on ``sock``; ``prepared``: it initialised CUDA."""

    pid: int
    sock: socket.socket
    prepared: bool


class WarmPool:
    """One agent's zygote and spares.

    Args:
        config: What to preload and how many spares.
        command: The workers' command (torch's entrypoint and arguments), for ``--preload auto``.
    """

    def __init__(self, config: WarmConfig, command: Sequence[str]) -> None:
        self._config = config
        self._command = [str(c) for c in command]
        self._lock = threading.Lock()
        self._state = PoolState.OFF
        self._reason = "--no-preload" if not config.enabled else ""
        self._zygote: subprocess.Popen | None = None
        self._control: socket.socket | None = None
        self._env: dict[str, str] = {}
        self._spares: deque[_Spare] = deque()
        self._started_at = 0.0
        self._said: set[str] = set()
        self._room = (0, 0)
        self._named: set[str] = set()
        self._learn: Path | None = None  # (auto: where workers record what they imported)
        self.preloaded: tuple[str, ...] = ()

    @property
    def state(self) -> PoolState:
        """The pool's state."""
        return self._state

    @property
    def environment(self) -> dict[str, str]:
        """The environment the zygote started with (a worker's may differ in per-worker variables only)."""
        return dict(self._env)

    @property
    def reason(self) -> str:
        """Why the pool is off ("" while it is not)."""
        return self._reason

    def start(self) -> None:
        """Start the zygote (its imports go on while the agent meets the others); off with a log line if it cannot."""
        if not self._config.enabled:
            log.info("warm_workers_off", reason=self._reason)
            return
        reason = _unsupported()
        if reason:
            return self._off(reason)
        command = parse_command(self._command, sys.executable)
        names = self._preload_names(command)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._env = dict(os.environ)
        # Room in the zygote's command line and environment, which a worker overwrites with its own (so that
        # ps, pgrep and /proc/PID/environ show the worker's, as for a plain subprocess).
        argv = [sys.executable, "-m", "unicron_elastic.agent.warm.zygote", str(theirs.fileno()),
                " " * room_for(argv_block(self._command))]
        env = {**self._env, ZYGOTE_ROOM.name: " " * room_for(env_block(self._env))}
        self._room = (len(argv_block(argv)), len(env_block(env)))
        self._started_at = time.monotonic()
        try:
            self._zygote = subprocess.Popen(  # noqa: S603 - our own module, this interpreter
                argv, pass_fds=(theirs.fileno(),), env=env)
            wire.send(ours, {"preload": list(names)})
        except OSError as exc:
            ours.close()
            return self._off(f"the zygote could not start: {exc}")
        finally:
            theirs.close()
        self._control, self._state, self.preloaded = ours, PoolState.STARTING, names

    def _preload_names(self, command: PythonCommand | str) -> tuple[str, ...]:
        """``--preload``'s modules, ``auto`` replaced by what :func:`auto_preload` finds and what workers of this
        script imported after they started (:mod:`~unicron_elastic.agent.warm.learned`)."""
        names: list[str] = []
        for name in self._config.preload:
            if name == AUTO and isinstance(command, PythonCommand):
                found = auto_preload(command, os.getcwd())
                self._named.update(found)
                self._learn = learned.cache_path(command.script, command.module, os.getcwd())
                names += [*found, *learned.read(self._learn)]
            elif name != AUTO:
                self._named.add(name)
                names.append(name)
        return tuple(dict.fromkeys(names))

    def await_ready(self) -> None:
        """Wait for the zygote's imports (a no-op once they are done or the pool is off).

        The agent calls it before torch starts the workers, where a stop signal still interrupts the wait
        (torch's start defers it).
        """
        with self._lock:
            if self._state is PoolState.STARTING:
                self._await_ready()

    def spawn(self, args: Sequence[str], env: Mapping[str, str], stdout: int, stderr: int) -> WarmProcess | None:
        """Start the worker torch would start with ``Popen(args, env=env)``, its stdout and stderr on the fds given.

        Returns:
            The worker, or None: it must be started as a plain subprocess (the reason is logged).
        """
        with self._lock:
            if self._state is PoolState.STARTING:
                self._await_ready()
            if self._state is not PoolState.READY:
                return None
            command = parse_command(args, sys.executable)
            if isinstance(command, str):
                return self._plain(command)
            mismatch = env_mismatch(self._env, env)
            if mismatch:
                return self._plain(f"the worker's environment sets {', '.join(mismatch)} differently from the "
                                   f"agent's when the zygote started (read at start-up)")
            if len(argv_block(args)) > self._room[0] or len(env_block(env)) + len(ROOM_HEADER) + 1 > self._room[1]:
                return self._plain("the worker's command line or environment is larger than the room the zygote "
                                   "kept for it in /proc")
            try:
                return self._hand_out(command, args, env, stdout, stderr)
            except (OSError, WarmPoolError) as exc:
                self._off(f"the zygote stopped answering: {exc}")
                return None

    def _hand_out(self, command: PythonCommand, args: Sequence[str], env: Mapping[str, str], stdout: int,
                  stderr: int) -> WarmProcess:
        """Give a spare (or a fresh fork) the worker's command, then fork spares up to ``spares``."""
        fits = self._env.get("CUDA_VISIBLE_DEVICES") == env.get("CUDA_VISIBLE_DEVICES")
        message = {"cwd": os.getcwd(), "env": dict(env), "script": command.script, "module": command.module,
                   "args": list(command.args), "unbuffered": command.unbuffered, "orig_argv": list(args),
                   "learn": str(self._learn) if self._learn is not None else None}
        while True:
            spare = self._take_spare(fits)
            try:
                wire.send(spare.sock, message, [stdout, stderr])
            except OSError:  # (a spare that ended: another one)
                self._discard(spare)
                continue
            spare.sock.close()
            break
        try:
            self._refill()
        except (OSError, WarmPoolError) as exc:  # (this worker runs: only the next ones are plain subprocesses)
            self._off(f"the zygote stopped answering: {exc}")
        return WarmProcess(spare.pid, args)

    def _take_spare(self, fits: bool) -> _Spare:
        """The oldest spare this worker can use (a CUDA-initialised one only if its devices are the zygote's)."""
        while self._spares:
            spare = self._spares.popleft()
            if fits or not spare.prepared:
                return spare
            self._discard(spare)
        return self._fork(prepare_cuda=False)

    def _refill(self) -> None:
        """Fork spares until there are ``spares`` of them."""
        while len(self._spares) < self._config.spares:
            self._spares.append(self._fork(prepare_cuda=True))

    def _fork(self, prepare_cuda: bool) -> _Spare:
        """Ask the zygote for a spare.

        Raises:
            WarmPoolError: The zygote refused or ended.
            OSError: Its socket failed.
        """
        assert self._control is not None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            wire.send(self._control, {"op": "fork", "prepare_cuda": prepare_cuda}, [theirs.fileno()])
        finally:
            theirs.close()
        reply = wire.receive(self._control)
        if reply is None or "pid" not in reply[0]:
            ours.close()
            raise WarmPoolError(f"no spare: {reply[0].get('error') if reply else 'the zygote exited'}")
        return _Spare(int(reply[0]["pid"]), ours, prepare_cuda)

    def _await_ready(self) -> None:
        """Wait for the zygote's imports (at most ``ready_timeout``), then fork the spares."""
        assert self._control is not None
        self._control.settimeout(self._config.ready_timeout)
        try:
            reply = wire.receive(self._control)
        except (OSError, WarmPoolError) as exc:
            return self._off(f"the zygote did not report within {self._config.ready_timeout:g} s ({exc})")
        finally:
            self._control.settimeout(None)
        if reply is None:
            return self._off(f"the zygote exited while importing (exit code {self._zygote_code()})")
        report = reply[0]
        if not report.get("ready"):
            if self._learn is not None:  # (a learned module may be the unsafe one: the next zygote learns afresh)
                self._learn.unlink(missing_ok=True)
            return self._off(f"a fork of the preloaded interpreter is not safe: {report.get('reason')}")
        self._state = PoolState.READY
        imported, skipped = list(report.get("imported", [])), dict(report.get("skipped") or {})
        log.info("warm_workers_ready", preloaded=len(imported), named=[n for n in imported if n in self._named],
                 skipped=len(skipped), skipped_named={n: e for n, e in skipped.items() if n in self._named},
                 spares=self._config.spares,
                 import_s=round(time.monotonic() - self._started_at, 2))
        try:
            self._refill()
        except (OSError, WarmPoolError) as exc:
            self._off(f"the zygote stopped answering: {exc}")

    def _plain(self, reason: str) -> None:
        """Log (once per reason) that a worker starts as a plain subprocess."""
        if reason not in self._said:
            self._said.add(reason)
            log.info("warm_worker_plain_subprocess", reason=reason)
        return None

    def _off(self, reason: str) -> None:
        """Every worker from now on a plain subprocess; the zygote and spares stopped."""
        self._reason = reason
        log.warning("warm_workers_off", reason=reason)
        self._stop()
        self._state = PoolState.OFF

    def _discard(self, spare: _Spare) -> None:
        """Close a spare's socket (it exits) and reap it."""
        spare.sock.close()
        process = WarmProcess(spare.pid, ["spare"])
        try:
            process.wait(_SPARE_EXIT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def _zygote_code(self) -> int | None:
        """The zygote's exit code, once it ended (a moment's wait)."""
        try:
            return self._zygote.wait(1.0) if self._zygote is not None else None
        except subprocess.TimeoutExpired:
            return None

    def _stop(self) -> None:
        """Discard every spare and end the zygote (closing its socket ends it; SIGKILL after a while)."""
        for spare in self._spares:  # (all told first, then waited for: they end together)
            spare.sock.close()
        if self._control is not None:
            self._control.close()
            self._control = None
        while self._spares:
            self._discard(self._spares.popleft())
        if self._zygote is not None:
            try:
                self._zygote.wait(_SPARE_EXIT_S)
            except subprocess.TimeoutExpired:
                self._zygote.kill()
                self._zygote.wait()
            self._zygote = None

    def close(self) -> None:
        """Stop the zygote and the spares (the workers are the agent's to stop)."""
        with self._lock:
            self._stop()
            self._state = PoolState.CLOSED


def _unsupported() -> str:
    """Why this platform cannot run a pool ("" if it can): fork, and a child subreaper (Linux) for the agent."""
    if not hasattr(os, "fork") or sys.platform != "linux":
        return f"{sys.platform} has no fork and child subreaper (Linux only)"
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            return f"prctl(PR_SET_CHILD_SUBREAPER) failed: {os.strerror(ctypes.get_errno())}"
    except (OSError, AttributeError) as exc:
        return f"prctl(PR_SET_CHILD_SUBREAPER) is not available: {exc}"
    return ""
