"""The rendezvous' contract with the agent: a round's records, the ranks of places past a round, the handler's seam (no I/O).

The ``unicron`` rendezvous (:mod:`~unicron_elastic.rendezvous.handler`, :mod:`~unicron_elastic.rendezvous.rounds`)
and the agent (:mod:`~unicron_elastic.agent.meeting_point`) both read these records in a round's meeting space;
the store side (reading and writing them) is :mod:`~unicron_elastic.rendezvous.rounds`. What the handler
offers the agent beyond torch's ``RendezvousHandler`` is :class:`UnicronRendezvous`, and what it hands back
after each rendezvous one :class:`RoundJoined`. A leaf: it imports nothing of its own package.

torch assigns ranks when a round forms. A node that adds a place to a running round
(docs/rendezvous.md) takes the ranks after the round's, and every worker of the run agrees on the
highest rank + 1 a run may reach (``$UNICRON_MAX_WORLD``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from unicron_elastic.store.client import StatusStore


@dataclass(frozen=True)
class PlaceOwner:
    """Who runs a place of a round (its owner): the value of its agent key, ``<node>@<host>:<pid>:<round>.<place>``.

    An owner that leaves its place on purpose (its run ended, it left the task, it was stopped, its
    round ended) marks it ``left`` before its lease goes (``...|left``): peers then see no lost node.

    Attributes:
        node: The node's name (``--node-name``).
        host: Its host name.
        pid: The agent's process.
        round: The round.
        place: The place (group rank).
        left: Marked by its owner just before it let the place go.
    """

    node: str
    host: str
    pid: int
    round: int
    place: int
    left: bool = False

    def encode(self) -> str:
        """The agent key's value."""
        text = f"{self.node}@{self.host}:{self.pid}:{self.round}.{self.place}"
        return text + LEFT_MARK if self.left else text

    @staticmethod
    def decode(value: bytes | str) -> PlaceOwner | None:
        """The owner an agent key names; None for another value (a claim in progress, or none)."""
        try:
            text = value.decode() if isinstance(value, bytes) else value
            left = text.endswith(LEFT_MARK)
            node, rest = text.removesuffix(LEFT_MARK).rsplit("@", 1)
            host, pid, where = rest.rsplit(":", 2)
            round_, place = where.split(".")
            return PlaceOwner(node, host, int(pid), int(round_), int(place), left)
        except (ValueError, UnicodeDecodeError):
            return None


#: What an owner appends to its agent key's value just before letting its place go on purpose.
LEFT_MARK = "|left"


@dataclass(frozen=True)
class RoundStart:
    """A round as torch formed it (recorded by its first agent in the meeting space).

    Attributes:
        nodes: Nodes (places) torch gave the round.
        world: Workers in it (``WORLD_SIZE``).
        nproc: Workers of each place a node adds (the first agent's
            ``--nproc-per-node``; a node running another number cannot grow the run).
        max_world: The highest rank + 1 the run may have when nodes grow it
            (``$UNICRON_MAX_WORLD`` of every worker: their groups must agree on it).
        started: When it was recorded (``time.time()`` of that agent's host).
    """

    nodes: int
    world: int
    nproc: int
    max_world: int
    started: float = field(default_factory=time.time)


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


@dataclass(frozen=True)
class RoundJoined:
    """What the ``unicron`` rendezvous hands the agent about the round this node last joined.

    Attributes:
        round: The round (the run-wide number: its meeting space, ``$UNICRON_ROUND``).
        running: This node joined the round while it ran (it took a lost node's place or added one;
            docs/rendezvous.md), not as torch formed it: its workers start as joiners.
        past_round: The round start, when this node's place is past it (the node grew the run, or took
            the place of a node that had): its workers' ranks follow the round's (:func:`ranks_past_round`,
            assigned by the agent). None: torch assigned them.
    """

    round: int
    running: bool = False
    past_round: RoundStart | None = None


@runtime_checkable
class UnicronRendezvous(Protocol):
    """The handler's side of the seam with the agent: what a ``unicron`` rendezvous handler offers besides
    torch's ``RendezvousHandler``.

    ``unicron-run``'s agent asks ``isinstance(handler, UnicronRendezvous)``; torch's own handlers (c10d,
    static, etcd) are not one, and none of this applies to them.

    Attributes:
        task: The task the run belongs to (``--rdzv-conf task=``; "": none).
        status_store: The etcd status store the rendezvous keeps the run in (the agent publishes its
            events and opens its meeting point there).
    """

    task: str
    status_store: StatusStore | None

    @property
    def max_nodes(self) -> int:
        """The most nodes the run may have (``--nnodes``' max)."""

    @property
    def round_joined(self) -> RoundJoined | None:
        """What this node's last rendezvous handed over (None before the first completed)."""

    def join_running_rounds(self, local_world_size: int) -> None:
        """From now on, join a round of the run that is running instead of making every node restart.

        A node arriving while a round runs takes a lost node's place, or adds one with
        ``local_world_size`` workers (docs/rendezvous.md); the round runs without torch's heartbeats.

        Raises:
            ValueError: ``local_world_size`` < 1.
        """
