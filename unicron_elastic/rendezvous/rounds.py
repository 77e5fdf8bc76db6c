"""A run's rendezvous rounds as their meeting spaces in etcd record them: which runs, which places are free.

The ``unicron`` handler reads these to let a node join a running round
(take a lost node's place, or add one) instead of making every node restart.
Only reads and one create-only claim; the joining itself is
:meth:`UnicronRendezvousHandler._rejoin_running_round
<unicron_elastic.rendezvous.handler.UnicronRendezvousHandler._rejoin_running_round>`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import structlog

from unicron_elastic.rendezvous.api import RoundStart, ranks_past_round
from unicron_elastic.store.client import StatusStore
from unicron_elastic.store.keys import MeetingKeys

log = structlog.get_logger(__name__)
#: A claimed place is freed again if the claiming agent dies before taking it over (seconds).
CLAIM_TTL_S = 30
#: How long after a round started its workers have to say they admit joiners past its world (their
#: ``hello``, once Lightning is imported). A node that would grow the run waits for that; after it, a plan
#: grows the run by torch's restart-all and a node without a coordinator waits for a lost node's place.
GROWABLE_WAIT_S = 30.0


def raise_places(store: StatusStore, prefix: str, places: int) -> None:
    """Make the round at ``prefix`` have at least ``places`` places (:attr:`MeetingKeys.AGENTS_WORLD` never shrinks).

    Raises:
        StoreError: etcd refused or could not be reached.
    """
    key = prefix + MeetingKeys.AGENTS_WORLD
    while True:
        kv = store.get(key)
        if kv is not None and int(kv.value) >= places:
            return
        if store.cas(key, str(int(places)).encode(), None if kv is None else kv.mod_revision).succeeded:
            return


def initial_round(store: StatusStore, prefix: str) -> RoundStart | None:
    """The round at ``prefix`` as torch formed it; None when no agent recorded it.

    Raises:
        StoreError: etcd refused or could not be reached.
    """
    kv = store.get(prefix + MeetingKeys.AGENTS_INITIAL)
    if kv is None:
        return None
    value = json.loads(kv.value)
    return RoundStart(int(value["nodes"]), int(value["world"]), int(value["nproc"]), int(value["max_world"]),
                      float(value["started"]))


@dataclass(frozen=True)
class RunningRound:
    """The round a node arriving now would join.

    Attributes:
        round: Its number.
        prefix: Its meeting space's key prefix.
        nodes: Its places.
        alive: The places whose agent is alive.
    """

    round: int
    prefix: str
    nodes: int
    alive: list[int]


class RunRounds:
    """The rounds of run ``run_id`` in the meeting spaces under ``store``.

    Args:
        store: The status store (etcd).
        run_id: The run (``--rdzv-id``).
    """

    def __init__(self, store: StatusStore, run_id: str) -> None:
        self.store, self.run_id = store, run_id

    def rounds(self) -> Iterator[tuple[int, str, int]]:
        """The run's rounds that have places, newest first: (round, prefix, nodes).

        Raises:
            StoreError: etcd is unreachable.
        """
        base = self.store.keys.meeting(self.run_id)
        rounds = {kv.key[len(base):].split("/", 1)[0] for kv in self.store.get_prefix(base)}
        for round_ in sorted((int(r) for r in rounds if r.isdigit()), reverse=True):
            prefix = f"{base}{round_}/"
            world = self.store.get(prefix + MeetingKeys.AGENTS_WORLD)
            if world is not None:
                yield round_, prefix, int(world.value)

    def running(self) -> RunningRound | None:
        """The newest round whose meeting space has a live agent; or the newest round of all, when none of its
        agents is alive but it did not finish (a place of it unfinished, none done: lost, or lapsed leases).

        Returns:
            The round; None when no round runs.

        Raises:
            StoreError: etcd is unreachable.
        """
        newest = True
        for round_, prefix, nodes in self.rounds():
            alive = [g for g in range(nodes) if self.store.get(prefix + MeetingKeys.agent(g)) is not None]
            if alive or (newest and any(self.place_free(prefix, g) for g in range(nodes))
                         and not self.done(prefix, nodes)):
                return RunningRound(round_, prefix, nodes, alive)
            newest = False
        return None

    def done(self, prefix: str, nodes: int) -> bool:
        """Whether a node of the round at ``prefix`` passed the exit barrier (its workers succeeded: training is over).

        Raises:
            StoreError: etcd is unreachable.
        """
        return any(self.store.get(prefix + MeetingKeys.agent_done(g)) is not None for g in range(nodes))

    def finished(self) -> bool:
        """Whether the run's newest round finished (see :meth:`done`).

        Raises:
            StoreError: etcd is unreachable.
        """
        _, prefix, nodes = next(self.rounds(), (None, "", 0))
        return nodes > 0 and self.done(prefix, nodes)

    def place_free(self, prefix: str, group_rank: int) -> bool:
        """Whether place ``group_rank`` started workers and did not finish (free once its agent key is gone).

        Raises:
            StoreError: etcd is unreachable.
        """
        return self.store.get(prefix + MeetingKeys.agent_seen(group_rank)) is not None \
            and self.store.get(prefix + MeetingKeys.agent_done(group_rank)) is None

    def claim(self, prefix: str, group_rank: int, value: str) -> bool:
        """Create-only claim of place ``group_rank`` (``value`` names the claimant; expires unless its agent takes it over).

        Raises:
            StoreError: etcd is unreachable.
        """
        claim = self.store.cas(prefix + MeetingKeys.agent(group_rank), value, None,
                               lease=self.store.grant_lease(CLAIM_TTL_S))
        return claim.succeeded

    def fits(self, prefix: str, place: int, nproc: int) -> bool:
        """Whether a node of ``nproc`` workers may take ``place``: one of the round torch formed, or a place past
        it whose workers' count (the round's record) is ``nproc``.

        Raises:
            StoreError: etcd is unreachable.
        """
        start = initial_round(self.store, prefix)
        return start is None or place < start.nodes or start.nproc == nproc

    def growable(self, prefix: str, place: int, nproc: int) -> bool | None:
        """Whether the round's workers admit joiners past its world on a new ``place``; None: not known yet.

        True once one said so (``hello(growable=True)``); False when none did
        within :data:`GROWABLE_WAIT_S` of the round's start (workers that never
        introduce themselves: any script that does not use our engine), or
        when the arriving node runs another number of workers (``nproc``) than
        the round's places take (:class:`~unicron_elastic.rendezvous.api.RoundStart`)
        or its ranks would pass the run's highest rank.

        Raises:
            StoreError: etcd is unreachable.
        """
        start = initial_round(self.store, prefix)
        if start is None:
            return None
        if nproc != start.nproc or ranks_past_round(start.nodes, start.world, place, start.nproc).stop > start.max_world:
            log.warning("rendezvous_cannot_grow", run_id=self.run_id, place=place, nproc=nproc,
                        round_nproc=start.nproc, max_world=start.max_world)
            return False
        if self.store.get(prefix + MeetingKeys.GROWABLE) is not None:
            return True
        return False if time.time() - start.started >= GROWABLE_WAIT_S else None
