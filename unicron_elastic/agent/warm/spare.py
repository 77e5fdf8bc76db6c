"""A spare: a fork of the zygote waiting for its worker's command, then that worker, as a fresh interpreter runs it.

What ``python [-u] SCRIPT ARGS`` does at start-up and at exit is done here for the fork: the
worker's environment in ``os.environ`` (and the C environment), its stdout and stderr on 1 and 2, the
working directory, ``sys.argv``, ``sys.orig_argv`` and ``sys.path[0]``, the signal dispositions of a
fresh interpreter, the script or module run as ``__main__`` by ``runpy``; at exit, the wait for
non-daemon threads, the ``atexit`` functions, the flush of stdout and stderr, and the exit code
(``SystemExit``'s, 1 after an uncaught exception, death by SIGINT after an uncaught
``KeyboardInterrupt``). The spare runs in a session of its own, as torch's workers do.
"""

from __future__ import annotations

import atexit
import builtins
import importlib.machinery
import io
import os
import runpy
import signal
import socket
import sys
import threading
import traceback
import types
from types import TracebackType
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from unicron_elastic.agent.warm import learned, wire
from unicron_elastic.agent.warm.command import ROOM_HEADER, PythonCommand, argv_block, env_block, proc_image

#: Signals a fresh CPython ignores at start-up (all others: the default, SIGINT: KeyboardInterrupt).
_IGNORED_AT_START = tuple(getattr(signal, name) for name in ("SIGPIPE", "SIGXFSZ") if hasattr(signal, name))


def serve(sock: socket.socket, prepare_cuda: bool) -> NoReturn:
    """Wait for the worker's command and become that worker; exit 0 if the agent closes the socket first."""
    try:
        os.setsid()
        if prepare_cuda:
            _initialise_cuda()
        received = wire.receive(sock)
    except BaseException:  # noqa: BLE001 - a spare that cannot start exits; the agent forks another
        os._exit(0)
    if received is None:
        os._exit(0)
    message, fds = received
    preloaded = set(sys.modules)
    try:
        command = _setup(message, fds)
    except BaseException:  # noqa: BLE001 - the worker did not start: said on its stderr, exit 1 (a failed start)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    finally:
        sock.close()
    learn = message.get("learn")
    run(command, (lambda: learned.record(Path(learn), sorted(set(sys.modules) - preloaded),
                                         command.sys_path0(message["cwd"]))) if learn else None)


def _initialise_cuda() -> None:
    """What a GPU worker would do first, before its rank is known: the CUDA driver and runtime."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.init()


def _setup(message: dict[str, Any], fds: list[int]) -> PythonCommand:
    """Take the worker's stdout, stderr, directory, environment, arguments and fresh signal dispositions."""
    stdout, stderr = fds
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    for fd in {stdout, stderr} - {1, 2}:
        os.close(fd)
    os.chdir(message["cwd"])
    os.environ.clear()
    os.environ.update(message["env"])
    command = PythonCommand(script=message.get("script"), module=message.get("module"),
                            args=tuple(message["args"]), unbuffered=bool(message.get("unbuffered")))
    _fresh_signals()
    _fresh_stdio(command.unbuffered)
    sys.argv = command.sys_argv()
    sys.orig_argv = list(message["orig_argv"])
    _retitle(sys.orig_argv, message["env"])
    sys.path[0] = command.sys_path0(message["cwd"])
    return command


def _retitle(argv: list[str], env: dict[str, str]) -> None:
    """Write the worker's command line and environment over the zygote's in this process' memory.

    ``/proc/PID/cmdline`` and ``/proc/PID/environ`` show what lies between the addresses in
    ``/proc/PID/stat`` (fields 48 to 51); the pool made them large enough. The command line's rest
    is NULs; the environment's rest is one ``UNICRON_ZYGOTE_ROOM`` of spaces.
    """
    try:
        with open("/proc/self/stat", "rb") as file:
            fields = file.read().rsplit(b")", 1)[1].split()
        arg_start, arg_end, env_start, env_end = (int(f) for f in fields[45:49])  # (fields 48-51; field 3 is [0])
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            for start, image in ((arg_start, proc_image(argv_block(argv), arg_end - arg_start)),
                                 (env_start, proc_image(env_block(env), env_end - env_start, ROOM_HEADER))):
                mem.seek(start)
                mem.write(image)
    except (OSError, ValueError) as exc:  # (a kernel that refuses: the worker runs, ps shows the zygote's line)
        print(f"unicron warm worker: /proc shows the zygote's command line and environment ({exc})", file=sys.stderr)


def _fresh_signals() -> None:
    """The signal dispositions and mask of a fresh interpreter."""
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        handler: Any = (signal.default_int_handler if sig == signal.SIGINT
                        else signal.SIG_IGN if sig in _IGNORED_AT_START else signal.SIG_DFL)
        try:
            signal.signal(sig, handler)
        except (OSError, ValueError):
            pass  # (a real-time signal Python cannot set)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def _fresh_stdio(unbuffered: bool) -> None:
    """``sys.stdout`` and ``sys.stderr`` on the worker's 1 and 2, buffered as the interpreter buffers them."""
    def stream(fd: int, errors: str, line: bool) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        binary: Any = raw if unbuffered else io.BufferedWriter(raw)
        interactive = os.isatty(fd)
        return io.TextIOWrapper(binary, encoding=sys.stdout.encoding, errors=errors,
                                line_buffering=line or interactive, write_through=unbuffered)

    sys.stdout = sys.__stdout__ = stream(1, sys.stdout.errors or "strict", False)
    sys.stderr = sys.__stderr__ = stream(2, "backslashreplace", not unbuffered)  # (3.9+: stderr line-buffered)


def run(command: PythonCommand, on_end: Callable[[], None] | None = None) -> NoReturn:
    """Run the command as ``__main__``, then end as the interpreter ends (``on_end`` first, if it ended by itself)."""
    interrupted = False
    try:
        if command.script is not None:
            _run_script(command.script)
        else:
            runpy.run_module(command.module, run_name="__main__", alter_sys=True)  # type: ignore[arg-type]
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt as exc:
        traceback.print_exception(exc.with_traceback(_user_frames(exc)))
        code, interrupted = 1, True
    except BaseException as exc:  # noqa: BLE001 - the interpreter prints it and exits 1
        exc = exc.with_traceback(_user_frames(exc))  # (the hook prints the exception's own traceback)
        sys.excepthook(type(exc), exc, exc.__traceback__)
        code = 1
    if on_end is not None:
        try:
            on_end()
        except Exception:  # noqa: BLE001 - learning what to preload must never change how the worker ends
            pass
    _finalise()
    if interrupted:  # (CPython: killed by SIGINT, so that the parent sees the interrupt)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


def _run_script(path: str) -> None:
    """Run a script file as CPython's ``main`` does (``__file__`` absolute, ``sys.argv[0]`` as given).

    A directory or a zip archive (its ``__main__.py``) is run by ``runpy.run_path``.
    """
    absolute = os.path.abspath(path)
    if not os.path.isfile(absolute) or zipfile.is_zipfile(absolute):
        runpy.run_path(path, run_name="__main__")
        return
    main = types.ModuleType("__main__")
    main.__file__ = absolute
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", absolute)
    main.__spec__ = None
    main.__package__ = None
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    sys.modules["__main__"] = main
    with open(absolute, "rb") as file:
        source = file.read()
    exec(compile(source, absolute, "exec"), main.__dict__)  # noqa: S102 - the worker's own script


def _user_frames(exc: BaseException) -> TracebackType | None:
    """The exception's traceback without this module's frames (the interpreter's would not show them)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return tb


def _exit_code(code: object) -> int:
    """The exit code of ``SystemExit(code)``: None 0, an int itself, anything else printed and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    try:
        print(code, file=sys.stderr)
    except Exception:  # noqa: BLE001
        pass
    return 1


def _finalise() -> None:
    """What the interpreter does at exit before the process ends: threads joined, ``atexit``, streams flushed."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # (Py_FinalizeEx's wait_for_thread_shutdown)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
