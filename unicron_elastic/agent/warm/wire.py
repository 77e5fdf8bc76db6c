"""The pool's messages: one JSON object per message over a Unix socket, file descriptors passed alongside."""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

from unicron_elastic.agent.warm.api import WarmPoolError

_HEADER = struct.Struct("!I")
#: At most this many descriptors ride with one message (a spare's socket; a worker's stdout and stderr).
MAX_FDS = 4


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    """Send ``message`` (and ``fds``, duplicated into the receiver).

    Raises:
        OSError: The peer is gone.
    """
    payload = json.dumps(message).encode()
    data = _HEADER.pack(len(payload)) + payload
    if fds:
        sent = socket.send_fds(sock, [data[:_HEADER.size]], fds)
        if sent != _HEADER.size:
            raise WarmPoolError("a message's header was cut short")
        sock.sendall(data[_HEADER.size:])
    else:
        sock.sendall(data)


def receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """The next message and the descriptors that came with it; None at the end of the stream.

    Raises:
        WarmPoolError: The stream ended inside a message, or it is not a JSON object.
    """
    header, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, MAX_FDS)
    if not header:
        return None
    while len(header) < _HEADER.size:
        more = sock.recv(_HEADER.size - len(header))
        if not more:
            raise WarmPoolError("the stream ended inside a message's header")
        header += more
    (length,) = _HEADER.unpack(header)
    body = bytearray()
    while len(body) < length:
        chunk = sock.recv(min(length - len(body), 1 << 20))
        if not chunk:
            raise WarmPoolError("the stream ended inside a message")
        body += chunk
    message = json.loads(body)
    if not isinstance(message, dict):
        raise WarmPoolError(f"not a message: {message!r}")
    return message, list(fds)
