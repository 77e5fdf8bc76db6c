"""The zygote: ``python -m unicron_elastic.agent.warm.zygote FD``, started by the agent's :class:`WarmPool`.

It imports the modules it is told to preload, checks that a fork of it is safe (no thread started, CUDA
not initialised), then forks a spare each time the agent asks. A spare is forked twice (the middle
process exits at once), so that it is the agent's child (the agent is a child subreaper) and the agent
waits for it as for a ``Popen``. The zygote never computes, starts no thread and opens no store
client; it exits when the agent's end of its socket closes (the agent ended, or died with its node).
"""

from __future__ import annotations

import importlib
import os
import socket
import struct
import sys
import threading
from typing import Any

from unicron_elastic.agent.warm import spare, wire


def preload(names: list[str]) -> dict[str, Any]:
    """Import ``names`` in order and say whether a fork of this process is still safe.

    A module that fails to import is skipped (the worker that imports it fails itself, as it would
    have); one that starts a thread or initialises CUDA makes the zygote unfit.

    Returns:
        ``{"ready": bool, "imported": [...], "skipped": {name: error}, "reason": str}``.
    """
    imported, skipped = [], {}
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - the worker meets the same error itself, at its own import
            skipped[name] = f"{type(exc).__name__}: {exc}"
            continue
        imported.append(name)
        reason = unsafe_after(name)
        if reason:
            return {"ready": False, "imported": imported, "skipped": skipped, "reason": reason}
    return {"ready": True, "imported": imported, "skipped": skipped, "reason": ""}


def unsafe_after(name: str) -> str:
    """Why a fork is unsafe now that ``name`` is imported ("" if it is safe).

    A Python thread does not exist in a fork (whatever it held stays held); a CUDA context cannot be
    used in one. Native thread pools that libraries start at import (OpenBLAS' in torch and numpy)
    stop and restart themselves around a fork (``pthread_atfork``) and are allowed.
    """
    others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if others:
        return f"importing {name} started a thread ({', '.join(others)})"
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and callable(getattr(cuda, "is_initialized", None)) and cuda.is_initialized():
        return f"importing {name} initialised CUDA"
    return ""


def fork_spare(spare_fd: int, control: socket.socket, prepare_cuda: bool) -> int:
    """Fork a spare (through a middle process that exits at once) holding ``spare_fd``.

    Returns:
        The spare's pid; the middle process is reaped, so the spare is already the agent's child.
    """
    for stream in (sys.stdout, sys.stderr):  # (nothing of the zygote's left in a buffer the worker would flush)
        stream.flush()
    read_end, write_end = os.pipe()
    middle = os.fork()
    if middle == 0:  # the middle process
        try:
            os.close(read_end)
            child = os.fork()
            if child == 0:
                os.close(write_end)
                control.close()
                try:
                    spare.serve(socket.socket(fileno=spare_fd), prepare_cuda)  # never returns
                finally:
                    os._exit(1)  # (never back into the zygote's loop)
            os.write(write_end, struct.pack("!i", child))
        finally:
            os._exit(0)
    os.close(write_end)
    os.close(spare_fd)
    data = os.read(read_end, 4)
    os.close(read_end)
    os.waitpid(middle, 0)
    if len(data) != 4:
        raise OSError("the spare's middle process ended before it forked")
    return struct.unpack("!i", data)[0]


def serve(control: socket.socket) -> None:
    """Fork a spare for each request until the agent's end closes."""
    while (received := _receive(control)) is not None:
        message, fds = received
        if message.get("op") != "fork" or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            reply: dict[str, Any] = {"error": f"unknown request {message!r}"}
        else:
            try:
                reply = {"pid": fork_spare(fds[0], control, bool(message.get("prepare_cuda")))}
            except OSError as exc:
                reply = {"error": f"fork failed: {exc}"}
        if not _reply(control, reply):
            return


def _receive(control: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """The agent's next request; None once its end is closed (it ended, or died: a reset is the same)."""
    try:
        return wire.receive(control)
    except OSError:
        return None


def _reply(control: socket.socket, message: dict[str, Any]) -> bool:
    """Answer the agent; False if it is gone (a spare forked for it sees its own socket closed and ends)."""
    try:
        wire.send(control, message)
    except OSError:
        return False
    return True


def main(argv: list[str]) -> int:
    """Preload, report, serve; the exit code is 0 when the agent closed its end."""
    control = socket.socket(fileno=int(argv[1]))
    os.setsid()  # a Ctrl-C to the agent's terminal group does not reach it (torch's workers: the same)
    received = _receive(control)
    if received is None:
        return 0
    report = preload(list(received[0].get("preload", [])))
    if _reply(control, report) and report["ready"]:
        serve(control)
    return 0


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)  # (no interpreter finalisation: tearing torch down takes longer than the zygote's whole job)
