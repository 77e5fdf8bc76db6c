"""The agent's end of the worker channel: a UNIX datagram socket on the node.

Workers send small JSON datagrams (see ``unicron_elastic.worker``); the agent
receives them on a thread and hands each valid message to a callback. Verdicts
go back to the worker's own socket. Per-iteration traffic never leaves the node.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

log = structlog.get_logger(__name__)

#: Message type -> required fields (besides ``t``, ``rank``).
SCHEMA: dict[str, tuple[str, ...]] = {
    "hello": ("pid", "resumable", "reply"),
    "beat": ("step", "dur"),
    "state": (),
    "progress": ("step", "mb"),
    "exc": ("type", "msg", "step", "fatal"),
}
MAX_DATAGRAM = 64 * 1024


def parse(raw: bytes) -> dict[str, Any]:
    """Decode and validate one worker message.

    Raises:
        ValueError: Not JSON, unknown type, or missing/invalid fields.
    """
    msg = json.loads(raw)
    if not isinstance(msg, dict):
        raise ValueError("message is not a JSON object")
    kind = msg.get("t")
    if kind not in SCHEMA:
        raise ValueError(f"unknown message type {kind!r}")
    if not isinstance(msg.get("rank"), int):
        raise ValueError("message has no integer 'rank'")
    missing = [f for f in SCHEMA[kind] if f not in msg]
    if missing:
        raise ValueError(f"{kind} message misses {missing}")
    return msg


class AgentChannel:
    """Receive worker messages on ``<directory>/agent.sock``.

    Args:
        directory: A private directory for the sockets.
        on_message: Called with each valid message and its receive time
            (``time.monotonic()``), from the receiver thread.
    """

    def __init__(self, directory: str, on_message: Callable[[dict[str, Any], float], None]) -> None:
        self.path = os.path.join(directory, "agent.sock")
        self._on_message = on_message
        self.malformed = 0
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
            except OSError:
                if self._closed.is_set():
                    return
                raise
            received = time.monotonic()
            try:
                msg = parse(raw)
            except (ValueError, UnicodeDecodeError) as exc:
                self.malformed += 1
                log.warning("malformed_worker_message", error=str(exc), raw=raw[:120])
                continue
            try:
                self._on_message(msg, received)
            except Exception:  # noqa: BLE001 - one bad message must not stop the channel
                log.exception("worker_message_handler_failed", message_type=msg.get("t"))

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
