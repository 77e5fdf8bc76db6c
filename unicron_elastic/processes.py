"""Process trees on Linux (``/proc``): what a node daemon stops, what a test kills as "a node"."""

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


def signal_tree(pid: int, sig: int = signal.SIGKILL) -> list[int]:
    """Signal ``pid`` and every process below it (collected before any is signalled).

    torch starts each worker in a session of its own, so signalling the
    launcher's process group would miss them; this walks the tree instead.

    Returns:
        The PIDs that were signalled (those already gone included).
    """
    tree = process_tree(pid)
    for member in tree:
        try:
            os.kill(member, sig)
        except ProcessLookupError:
            pass
    return tree
