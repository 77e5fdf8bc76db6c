"""Where torch's launcher and agent internals differ between the supported releases (2.8 to 2.13).

This module is the one place that chooses between releases, not the only one
that touches torch's internals: :class:`~unicron_elastic.agent.agent.UnicronAgent`
subclasses ``LocalElasticAgent`` and overrides its private methods
(``_rendezvous``, ``_assign_worker_ranks``, ``_start_workers``,
``_monitor_workers``, ``_stop_workers``, ``_shutdown``, ``_exit_barrier``)
and reads its private fields (``_worker_group``, ``_pcontext``,
``_exit_barrier_timeout``); those are the same from 2.8 to 2.13, and the
``compat`` test selection runs the agent through each of them (a launch,
per-rank restart, SIGTERM and Ctrl-C, ``--shutdown-timeout``, a node loss)
on the oldest supported release. The rendezvous backend
(:mod:`unicron_elastic.rendezvous`) builds on torch's
``DynamicRendezvousHandler`` the same way.

What differs between releases is chosen here by what the installed torch
has (a field, a parameter, a flag), never by its version string:

* the launch settings a ``WorkerSpec`` takes (``event_log_handler`` 2.8,
  ``numa_options`` 2.9, the ``duplicate_*_filters`` and ``virtual_local_rank``
  2.10): :func:`worker_spec_options` passes on those both sides have;
* ``--shutdown-timeout`` (torchrun's own flag from 2.12): :func:`add_shutdown_timeout_flag`
  adds it where torch's parser has none, and :func:`shutdown_timeout` reads it.
  The agent stops its workers itself (:func:`stop_workers`, used by
  ``UnicronAgent._shutdown``), so the timeout means the same on every release,
  for a restart of the group too (torch 2.12 and 2.13 wait 30 s there);
* per-rank restart replaces one worker of a ``SubprocessContext`` without
  disturbing the others: its fields are the same from 2.8 to 2.13, and the
  handler takes ``numa_options`` from 2.9 (:func:`respawn`);
* the signal handler ``PContext.start()`` registers (:func:`use_signal_handler`).
* the handler a ``SubprocessContext`` builds for each worker, from the warm pool (:func:`use_warm_pool`).

``tests/test_torch_compat.py`` pins each of these against the installed torch,
and ``.ci/run`` runs the ``compat`` selection on the oldest supported release.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
from collections.abc import Callable
from subprocess import Popen
from types import FrameType
from typing import Any

from torch.distributed.argparse_util import env as _env_action
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import api as _mp_api
from torch.distributed.elastic.multiprocessing.api import PContext, SubprocessContext

from unicron_elastic.api import ConfigError

#: ``LaunchConfig`` settings a ``WorkerSpec`` takes in some releases only (passed on where both have them).
OPTIONAL_SPEC_FIELDS = ("event_log_handler", "numa_options", "duplicate_stdout_filters",
                        "duplicate_stderr_filters", "virtual_local_rank")
#: torchrun's default, and its environment variable (torch 2.12+ reads it too).
DEFAULT_SHUTDOWN_TIMEOUT_S = 30
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"


def worker_spec_options(config: Any) -> dict[str, Any]:
    """The optional ``WorkerSpec`` arguments this torch has, from a ``LaunchConfig``."""
    spec_fields = {f.name for f in dataclasses.fields(WorkerSpec)}
    return {name: getattr(config, name) for name in OPTIONAL_SPEC_FIELDS
            if name in spec_fields and hasattr(config, name)}


def agent_takes_shutdown_timeout() -> bool:
    """Whether torch's ``LocalElasticAgent`` takes ``shutdown_timeout`` (torch 2.12+)."""
    return "shutdown_timeout" in inspect.signature(LocalElasticAgent.__init__).parameters


def add_shutdown_timeout_flag(parser: argparse.ArgumentParser) -> None:
    """Add torchrun's ``--shutdown-timeout`` (as torch 2.12 defines it) where torch's parser lacks it."""
    if any(action.dest == "shutdown_timeout" for action in parser._actions):
        return
    parser.add_argument(
        "--shutdown-timeout", "--shutdown_timeout", action=_env_action, type=int, default=None,
        help="Time in seconds to wait for graceful shutdown of worker processes before sending SIGKILL. "
             f"If not specified, uses {SHUTDOWN_TIMEOUT_ENV} environment variable or defaults to "
             f"{DEFAULT_SHUTDOWN_TIMEOUT_S} seconds.")


def shutdown_timeout(config: Any, args: argparse.Namespace) -> int:
    """The seconds workers get between the stop signal and SIGKILL.

    The flag, else ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else 30 (torch 2.12's
    rule; its ``LaunchConfig`` has resolved it already).

    Raises:
        ConfigError: The value is negative or the variable is not an integer.
    """
    value = getattr(config, "shutdown_timeout", None)
    if value is None:
        value = getattr(args, "shutdown_timeout", None)
    if value is None:
        raw = os.environ.get(SHUTDOWN_TIMEOUT_ENV, str(DEFAULT_SHUTDOWN_TIMEOUT_S))
        try:
            value = int(raw)
        except ValueError:
            raise ConfigError(f"{SHUTDOWN_TIMEOUT_ENV}={raw!r}: not a number of seconds") from None
    if value < 0:
        raise ConfigError(f"--shutdown-timeout {value}: must be >= 0")
    return value


def stop_workers(pcontext: PContext | None, death_sig: int, timeout: int) -> None:
    """Send ``death_sig`` to every worker, SIGKILL those still running after ``timeout`` seconds."""
    if pcontext is not None:
        pcontext.close(death_sig, timeout)


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


_PLAIN_HANDLER = _mp_api.get_subprocess_handler


def use_warm_pool(pool: Any) -> None:
    """Make torch's ``SubprocessContext`` (and :func:`respawn`) start workers through ``pool`` (None: as torch does).

    torch's context builds each worker's handler by the module attribute ``get_subprocess_handler``
    (the same from 2.8 to 2.13); a :class:`~unicron_elastic.agent.warm.handler.WarmSubprocessHandler`
    takes its place.
    """
    if pool is None:
        _mp_api.get_subprocess_handler = _PLAIN_HANDLER  # type: ignore[assignment]
        return
    from unicron_elastic.agent.warm.handler import WarmSubprocessHandler

    def warm_handler(*args: Any, **kwargs: Any) -> Any:
        return WarmSubprocessHandler(pool, *args, **kwargs)

    _mp_api.get_subprocess_handler = warm_handler  # type: ignore[assignment]


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
    handler = _mp_api.get_subprocess_handler(
        entrypoint=pcontext.entrypoint,  # type: ignore[arg-type]
        args=pcontext.args[local_rank],
        env=env,
        stdout=pcontext.stdouts.get(local_rank) or None,
        stderr=pcontext.stderrs.get(local_rank) or None,
        local_rank_id=local_rank,
        **_numa(pcontext),
    )
    pcontext.subprocess_handlers[local_rank] = handler
    pcontext._running_local_ranks.add(local_rank)
    pcontext._failures.pop(local_rank, None)
    return handler.proc.pid


def _numa(pcontext: SubprocessContext) -> dict[str, Any]:
    """The context's NUMA binding for a respawned worker, where this torch has one (2.9+)."""
    if "numa_options" not in inspect.signature(_PLAIN_HANDLER).parameters:
        return {}
    return {"numa_options": getattr(pcontext, "_numa_options", None)}
