"""Fault injectors and helpers for tests and demos (shipped, like TorchFT's).

Faults are data: a test describes *what* fails and the helpers here make it
happen to real processes.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

from unicron_elastic.faults import (  # noqa: F401 - re-exported: tests and demos build faults from here
    FAULT_KINDS,
    FAULT_LOG_ENV,
    FAULT_POINTS,
    FAULTS_ENV,
    UNFIRED_SUFFIX,
    Fault,
    fail_at,
    faults_env,
    maybe_fail,
    planned_faults,
    throttle,
)
from unicron_elastic.processes import child_pids, process_tree, signal_tree  # noqa: F401 - re-exported for tests
from unicron_elastic.store.keys import MeetingKeys


def unfired_faults(log_path: str | os.PathLike[str]) -> list[dict]:
    """The faults the workers reported as not fired when they exited (``log_path``: the run's fault log)."""
    path = Path(str(log_path) + UNFIRED_SUFFIX)
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def kill_node(launcher_pid: int, sig: int = signal.SIGKILL) -> list[int]:
    """Simulate the loss of a node: signal a launcher and every process below it.

    torchrun starts each worker in a session of its own, so killing the
    launcher's process group would leave the workers running; this walks the
    process tree instead (children are collected before anything is killed).

    Args:
        launcher_pid: PID of the ``torchrun``/``unicron-run`` process.
        sig: The signal, SIGKILL by default (no chance to clean up).

    Returns:
        The PIDs that were signalled.
    """
    return signal_tree(launcher_pid, sig)


# -- faults as data (defined in unicron_elastic.faults, re-exported here) ------------

# -- a toy data-parallel problem and a store-hosting launcher (tests, demos, benchmarks) --


def toy_data(samples: int = 96, seed: int = 1):
    """A small deterministic regression data set: ``(xs, ys)`` with 8 features."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    xs = torch.randn(samples, 8, generator=generator)
    return xs, xs.sum(dim=1, keepdim=True).sin()


def toy_problem(width: int = 16, lr: float = 0.1):
    """The MLP, SGD-with-momentum optimizer and data the examples train: ``(model, optimizer, xs, ys)``."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))
    return (model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9), *toy_data())


def run_workers(script: str, world: int, args: list[str], env: dict[str, str] | None = None,
                timeout: float = 150) -> list:
    """Run ``world`` worker processes of ``script`` around a TCPStore this process hosts.

    The store outlives the workers, as the agent's does under torchrun; workers
    find it at ``MASTER_ADDR``/``MASTER_PORT`` (``TORCHELASTIC_USE_AGENT_STORE``)
    and ``UNICRON_STORE``.

    Returns:
        One ``subprocess.CompletedProcess`` per rank.
    """
    import subprocess
    import sys
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    base = dict(os.environ, WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(store.port), UNICRON_STORE=f"127.0.0.1:{store.port}",
                TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS="1", **(env or {}))
    store.set(MeetingKeys.LIVENESS, "1")  # like the agent: live/<rank> exists while the worker runs
    for r in range(world):
        store.set(MeetingKeys.live(r), "0")  # the incarnation: these workers are never restarted
    procs = [subprocess.Popen([sys.executable, script, *args], env=dict(base, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    supervisor = threading.Thread(target=_keep_liveness, args=(store, procs), daemon=True)
    supervisor.start()
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    supervisor.join()
    del store
    return results


def _keep_liveness(store: object, procs: list) -> None:
    """Delete ``live/<rank>`` within milliseconds of worker ``rank`` exiting (what the agent does)."""
    running = dict(enumerate(procs))
    while running:
        for rank, proc in list(running.items()):
            if proc.poll() is not None:
                store.delete_key(MeetingKeys.live(rank))  # type: ignore[attr-defined]
                del running[rank]
        time.sleep(0.002)


def json_log_entries(path: str | os.PathLike[str]) -> list[dict]:
    """The JSON lines of a ``--log-format=json`` launcher log (other lines, e.g. torch's, skipped)."""
    entries = []
    for line in Path(path).read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                entries.append(json.loads(line))
            except ValueError:
                pass
    return entries
