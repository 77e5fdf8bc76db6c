"""Fault injectors and helpers for tests and demos (shipped, like TorchFT's).

Faults are data: a test describes *what* fails and the helpers here make it
happen to real processes.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux ``/proc``), empty if it is gone."""
    children: list[int] = []
    task_dir = Path(f"/proc/{pid}/task")
    try:
        tasks = list(task_dir.iterdir())
    except OSError:
        return children
    for task in tasks:
        try:
            children.extend(int(p) for p in (task / "children").read_text().split())
        except OSError:
            continue
    return children


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants, parents first."""
    tree, frontier = [], [pid]
    while frontier:
        current = frontier.pop(0)
        tree.append(current)
        frontier.extend(child_pids(current))
    return tree


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
    tree = process_tree(launcher_pid)
    for pid in tree:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return tree
