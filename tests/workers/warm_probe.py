"""What a worker sees of its interpreter, printed as one JSON line, then an ending chosen by ``argv[1]``.

Endings: an exit code (``0``, ``3``), ``raise`` (an uncaught exception), ``kill`` (SIGKILL itself),
``intr`` (an uncaught KeyboardInterrupt), ``thread`` (a non-daemon thread still printing at the end).
"""

import atexit
import json
import os
import signal
import sys
import threading
import time

atexit.register(lambda: print("atexit ran", flush=True))
print(json.dumps({
    "argv": sys.argv, "orig_argv": sys.orig_argv[1:], "path0": sys.path[0], "name": __name__, "file": __file__,
    "cwd": os.getcwd(), "own_session": os.getsid(0) == os.getpid(), "env": dict(os.environ),
    "signals": {name: str(signal.getsignal(getattr(signal, name))) for name in ("SIGINT", "SIGPIPE", "SIGTERM",
                                                                                 "SIGUSR1", "SIGCHLD")},
    "mask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "stdout": [sys.stdout.line_buffering, sys.stdout.write_through, sys.stdout.encoding, sys.stdout.errors],
    "stderr": [sys.stderr.line_buffering, sys.stderr.errors],
    "main_spec": repr(sys.modules["__main__"].__spec__), "threads": threading.active_count(),
    # what ps, pgrep and readers of /proc see (a fork keeps room after its own: NULs, one padding variable)
    "proc_cmdline": [a.decode() for a in open("/proc/self/cmdline", "rb").read().rstrip(b"\0").split(b"\0")],
    "proc_environ": sorted(e.decode() for e in open("/proc/self/environ", "rb").read().rstrip(b"\0").split(b"\0")
                           if not e.startswith(b"UNICRON_ZYGOTE_ROOM=")),
}))
ending = sys.argv[1]
if ending == "raise":
    raise ValueError("boom")
if ending == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if ending == "intr":
    raise KeyboardInterrupt
if ending == "thread":
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread done", flush=True))).start()
    sys.exit(0)
sys.exit(int(ending))
