"""The agent's end of the worker channel: a UNIX datagram socket on the node.

Workers send small JSON datagrams (see ``unicron_elastic.worker``); the agent
receives them on a thread and hands each valid message to a callback. Verdicts
go back to the worker's own socket. Per-iteration traffic never leaves the node.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from unicron_elastic.worker import MAX_REASON  # the longest rejoin reason a worker sends

log = structlog.get_logger(__name__)

#: Message type -> required fields (besides ``t``, ``rank``).
SCHEMA: dict[str, tuple[str, ...]] = {
    "hello": ("pid", "resumable", "reply"),
    "beat": ("step", "dur"),
    "state": (),
    "progress": ("step", "mb"),
    "exc": ("type", "msg", "step", "fatal"),
    "rejoin": ("reason",),  # (``pid``: optional) alive but left out: restart me as a joiner when I exit
}
MAX_DATAGRAM = 64 * 1024
#: Largest rank, PID or step a worker may send (a 63-bit signed integer).
MAX_INT = 2**63 - 1
#: Longest iteration a heartbeat may report, in seconds (a day).
MAX_DURATION = 86_400.0
#: Malformed messages logged one by one before the channel logs only a count per interval.
LOG_BURST = 10
LOG_INTERVAL = 10.0


def _integer(low: int) -> Callable[[Any], bool]:
    return lambda v: type(v) is int and low <= v <= MAX_INT


def _duration(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v) and 0 <= v <= MAX_DURATION


def _boolean(v: Any) -> bool:
    return type(v) is bool


def _string(longest: int) -> Callable[[Any], bool]:
    return lambda v: type(v) is str and len(v) <= longest


#: Field -> (check of its value, what the check wants), for every field a message may carry.
FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "rank": (_integer(0), "an integer >= 0"),
    "pid": (_integer(0), "an integer >= 0"),
    "step": (_integer(-1), "an integer >= -1"),  # -1: an exception outside any step
    "mb": (_integer(0), "an integer >= 0"),
    "dur": (_duration, f"a finite number of seconds in [0, {MAX_DURATION:g}]"),
    "busy": (_duration, f"a finite number of seconds in [0, {MAX_DURATION:g}]"),
    "resumable": (_boolean, "true or false"),
    "leavable": (_boolean, "true or false"),
    "fatal": (_boolean, "true or false"),
    "paused": (_boolean, "true or false"),
    "pause_for": (_duration, f"a finite number of seconds in [0, {MAX_DURATION:g}]"),
    "collective": (_boolean, "true or false"),
    "waiting": (_boolean, "true or false"),
    "exiting": (_boolean, "true or false"),
    "reply": (_string(107), "a socket path of at most 107 characters"),
    "type": (_string(256), "a string of at most 256 characters"),
    "msg": (_string(4_000), "a string of at most 4000 characters"),
    "tb": (_string(16_000), "a string of at most 16000 characters"),
    "reason": (_string(MAX_REASON), f"a string of at most {MAX_REASON} characters"),
}


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid number")


def parse(raw: bytes) -> dict[str, Any]:
    """Decode and validate one worker message.

    Every known field is type- and range-checked (integers for ranks and steps,
    finite non-negative durations, booleans, bounded strings), so what reaches
    the detectors is what a :class:`~unicron_elastic.worker.WorkerChannel` sends.

    Raises:
        ValueError: Not JSON (or nested too deep to decode), unknown type,
            missing fields, or a field of the wrong type or range.
    """
    try:
        msg = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError("message is nested too deeply") from None
    if not isinstance(msg, dict):
        raise ValueError("message is not a JSON object")
    kind = msg.get("t")
    if not isinstance(kind, str) or kind not in SCHEMA:
        raise ValueError(f"unknown message type {str(kind)[:40]!r}")
    missing = [f for f in ("rank", *SCHEMA[kind]) if f not in msg]
    if missing:
        raise ValueError(f"{kind} message misses {missing}")
    for name, value in msg.items():
        check = FIELDS.get(name)
        if check is not None and not check[0](value):
            raise ValueError(f"{kind} message field {name!r} must be {check[1]}")
    return msg


class _RateLimitedLog:
    """Log the first ``burst`` events, then at most one per ``interval`` (with the count suppressed)."""

    def __init__(self, burst: int = LOG_BURST, interval: float = LOG_INTERVAL) -> None:
        self.burst, self.interval = burst, interval
        self._logged = 0
        self._suppressed = 0
        self._next = 0.0

    def warning(self, event: str, **fields: Any) -> None:
        now = time.monotonic()
        if self._logged < self.burst:
            self._logged += 1
            log.warning(event, **fields)
        elif now >= self._next:
            log.warning(event, **fields, suppressed=self._suppressed)
            self._suppressed = 0
        else:
            self._suppressed += 1
            return
        if self._logged >= self.burst:
            self._next = now + self.interval


class AgentChannel:
    """Receive worker messages on ``<directory>/agent.sock``.

    Args:
        directory: A private directory for the sockets.
        on_message: Called with each valid message and its receive time
            (``time.monotonic()``), from the receiver thread.

    Attributes:
        malformed: Datagrams dropped: invalid (see :func:`parse`), a ``hello``
            whose reply socket is not in ``directory``, or any other error
            while handling them. Nothing one datagram does stops the channel.
    """

    def __init__(self, directory: str, on_message: Callable[[dict[str, Any], float], None]) -> None:
        self.path = os.path.join(directory, "agent.sock")
        self._directory = directory
        self._on_message = on_message
        self.malformed = 0
        self._log = _RateLimitedLog()
        self._handler_log = _RateLimitedLog()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self.path)
        self._sock.settimeout(0.2)
        self._out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._out.setblocking(False)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="unicron-agent-channel", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                raw = self._sock.recv(MAX_DATAGRAM)
            except TimeoutError:
                continue
            except OSError as exc:
                if self._closed.is_set():
                    return
                self._log.warning("worker_channel_receive_failed", error=str(exc))
                self._closed.wait(0.05)
                continue
            try:
                self._handle(raw, time.monotonic())
            except Exception as exc:  # noqa: BLE001 - whatever one datagram does costs that datagram only
                self.malformed += 1
                self._log.warning("worker_message_failed", error=f"{type(exc).__name__}: {exc}"[:200])

    def _handle(self, raw: bytes, received: float) -> None:
        try:
            msg = parse(raw)
        except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            self.malformed += 1
            self._log.warning("malformed_worker_message", error=str(exc)[:200], raw=raw[:120])
            return
        if msg["t"] == "hello" and os.path.dirname(msg["reply"]) != self._directory:
            self.malformed += 1  # verdicts go only to sockets in the agent's private directory
            self._log.warning("malformed_worker_message", error="reply socket outside the agent's directory",
                              rank=msg["rank"])
            return
        try:
            self._on_message(msg, received)
        except Exception:  # noqa: BLE001 - one bad message must not stop the channel
            self._handler_log.warning("worker_message_handler_failed", message_type=msg["t"], exc_info=True)

    def send(self, path: str, msg: dict[str, Any]) -> bool:
        """Send ``msg`` to a worker's socket; False if the worker is gone."""
        try:
            self._out.sendto(json.dumps(msg).encode(), path)
            return True
        except OSError:
            return False

    def close(self) -> None:
        """Stop receiving and remove the socket."""
        self._closed.set()
        self._sock.close()
        self._out.close()
        self._thread.join(timeout=1)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
