"""The one place that touches torch's private process-context fields (torch 2.13).

Per-rank restart needs to replace one worker of a ``SubprocessContext`` without
disturbing the others. ``tests/test_agent.py`` pins the fields used here, and
``tests/test_shutdown.py`` the signal handler name :func:`use_signal_handler` replaces.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from subprocess import Popen
from types import FrameType

from torch.distributed.elastic.multiprocessing import api as _mp_api
from torch.distributed.elastic.multiprocessing.api import PContext, SubprocessContext
from torch.distributed.elastic.multiprocessing.subprocess_handler import get_subprocess_handler


def use_signal_handler(handler: Callable[[int, FrameType | None], None]) -> bool:
    """Make ``PContext.start()`` register ``handler`` instead of torch's ``_terminate_process_handler``.

    torch registers its handler (which always raises ``SignalException``) each
    time it starts workers, *before* it starts them; with ours in its place a
    signal while workers start can be deferred until torch has recorded them
    all, so that its shutdown stops every one.

    Returns:
        False if this torch has no such module attribute (then torch's own is used).
    """
    if not callable(getattr(_mp_api, "_terminate_process_handler", None)):
        return False
    _mp_api._terminate_process_handler = handler  # type: ignore[assignment]
    return True


def supports_per_rank_restart(pcontext: PContext | None) -> bool:
    """True for script entrypoints (``SubprocessContext``), the ones we can respawn."""
    return isinstance(pcontext, SubprocessContext)


def worker_processes(pcontext: PContext | None) -> dict[int, Popen]:
    """``local_rank -> Popen`` of a subprocess context (empty otherwise)."""
    if not isinstance(pcontext, SubprocessContext):
        return {}
    return {lr: handler.proc for lr, handler in pcontext.subprocess_handlers.items()}


def respawn(pcontext: SubprocessContext, local_rank: int, env_update: dict[str, str]) -> int:
    """Start a new process for ``local_rank`` with the same command and environment.

    The dead worker's stdout/stderr files are kept under ``<file>.<old pid>``
    (torch reopens them with ``"w"``).

    Returns:
        The new PID.
    """
    old = pcontext.subprocess_handlers[local_rank]
    for path in (pcontext.stdouts.get(local_rank), pcontext.stderrs.get(local_rank)):
        if path and os.path.exists(path):
            os.replace(path, f"{path}.{old.proc.pid}")
    env = dict(pcontext.envs[local_rank])
    env.update(env_update)
    pcontext.envs[local_rank] = env
    handler = get_subprocess_handler(
        entrypoint=pcontext.entrypoint,  # type: ignore[arg-type]
        args=pcontext.args[local_rank],
        env=env,
        stdout=pcontext.stdouts.get(local_rank) or None,
        stderr=pcontext.stderrs.get(local_rank) or None,
        local_rank_id=local_rank,
        numa_options=pcontext._numa_options,
    )
    pcontext.subprocess_handlers[local_rank] = handler
    pcontext._running_local_ranks.add(local_rank)
    pcontext._failures.pop(local_rank, None)
    return handler.proc.pid
