"""Ranks of the workers of a node that grows a running round (pure; the agent and the rendezvous use them).

torch assigns ranks when a round forms. A node that adds a place to a running
round (docs/rendezvous.md) takes the ranks after the round's, and every worker
of the run agrees on the highest rank + 1 a run may reach (``$UNICRON_MAX_WORLD``).
"""

from __future__ import annotations


def ranks_past_round(nodes: int, world: int, place: int, nproc: int) -> range:
    """Ranks of the workers on ``place`` >= ``nodes`` of a round torch formed with ``nodes`` nodes and ``world`` workers.

    They follow the round's ranks, ``nproc`` per place (the round's record:
    a node that runs another number takes no such place), whatever the
    round's own nodes ran; their ``WORLD_SIZE`` stays the round's.

    Raises:
        ValueError: ``place`` is one of the round's own.
    """
    if place < nodes:
        raise ValueError(f"place {place} is one of the round's {nodes}: torch assigned its ranks")
    base = world + (place - nodes) * nproc
    return range(base, base + nproc)


def max_world(nodes: int, world: int, max_nodes: int, nproc: int) -> int:
    """The highest rank + 1 of a run that may grow from ``nodes`` to ``max_nodes`` nodes (``$UNICRON_MAX_WORLD``)."""
    return world + max(0, max_nodes - nodes) * nproc
