"""The agent's side of the seam with its rendezvous handler (the handler's side is ``rendezvous/api.py``).

With the ``unicron`` rendezvous the agent gets the run's status store, its task and what each rendezvous handed
over about the round this node joined; with another backend (torch's c10d, static, ...) it gets none of these.
No I/O.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.elastic.agent.server.api import WorkerGroup

from unicron_elastic.rendezvous.api import RoundJoined, RoundStart, UnicronRendezvous, max_world
from unicron_elastic.store.client import StatusStore


def unicron_rendezvous(handler: Any) -> UnicronRendezvous | None:
    """``handler`` if it is a ``unicron`` rendezvous handler; None for another backend's (torch's c10d, static, ...)."""
    return handler if isinstance(handler, UnicronRendezvous) else None


def round_joined(handler: Any) -> RoundJoined | None:
    """What the ``unicron`` rendezvous ``handler`` handed over about the round this node joined (None: another backend).

    Raises:
        RuntimeError: Asked before this node's first rendezvous completed.
    """
    rendezvous = unicron_rendezvous(handler)
    if rendezvous is None:
        return None
    joined = rendezvous.round_joined
    if joined is None:
        raise RuntimeError("the unicron rendezvous has handed over no round: this node joined none yet")
    return joined


def status_store(handler: Any) -> StatusStore | None:
    """The etcd status store of the ``unicron`` rendezvous ``handler``; None with another backend."""
    rendezvous = unicron_rendezvous(handler)
    return rendezvous.status_store if rendezvous is not None else None


def task_of(handler: Any) -> str:
    """The task of the run: the ``unicron`` rendezvous' task, else (none, or another backend) the run id."""
    rendezvous = unicron_rendezvous(handler)
    return (rendezvous.task if rendezvous is not None else "") or handler.get_run_id()


def round_start(worker_group: WorkerGroup, max_nodes: int) -> RoundStart | None:
    """This round as torch formed it, seen from this node (the round's first agent records it).

    Places that nodes add get this node's ``--nproc-per-node`` workers each, up to ``max_nodes``
    (``--nnodes``' max).
    """
    if not worker_group.workers:
        return None
    spec = worker_group.spec
    nodes, world = worker_group.group_world_size, worker_group.workers[0].world_size
    return RoundStart(nodes, world, spec.local_world_size, max_world(nodes, world, max_nodes, spec.local_world_size))
