"""Every store effect of the engine, in one class: membership, requests, joining, publishing.

:class:`EngineStore` is what one rank of
:class:`~unicron_elastic.strategy.engine.elastic_dp.ElasticDataParallel`
reads and writes in the meeting store: check-ins and membership records
(through :class:`~unicron_elastic.strategy.engine.replicas.ReplicaMembership`),
the liveness of the members in the incarnation the group formed with,
join and leave requests (through
:class:`~unicron_elastic.strategy.engine.requests.RequestReader`), a joiner's
admission, the published members, the stop and finish records and the ranks
that found a NaN or Inf. :meth:`EngineStore.handlers` maps each of the
protocol's store effects to its method; the in-process fake
(``tests/fake_dp.py``) uses the same class over an in-memory store.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

import structlog

from unicron_elastic.api import StoreUnavailableError
from unicron_elastic.store.keys import MeetingKeys as K
from unicron_elastic.strategy.engine import effects as E
from unicron_elastic.strategy.engine.membership import MembershipError, MembershipRecord
from unicron_elastic.strategy.engine.replicas import ModelParallel, ReplicaMembership, live_replicas
from unicron_elastic.strategy.engine.requests import RequestReader

__all__ = ["EngineStore"]

log = structlog.get_logger(__name__)


class EngineStore:
    """One rank's reads and writes in the meeting store.

    Args:
        store: The meeting store (a c10d store: ``set``, ``get``, ``check``, ``compare_set``, ``delete_key``,
            ``add``; etcd's ``read_int`` bounds the request reads in an outage).
        layout: The model's tensor x pipeline parallelism.
        rank: This launch rank.
        max_replicas: Replicas ``0..max_replicas-1`` may ask to join.
    """

    def __init__(self, store: Any, layout: ModelParallel, rank: int, max_replicas: int) -> None:
        self.store, self.layout, self.rank = store, layout, rank
        self.replica, self.shard = layout.replica(rank), layout.shard(rank)
        self.membership = ReplicaMembership(store, layout, rank, max_replicas)
        #: The join/leave requests' counter (the publishing rank reads it off the step's critical path).
        self.requests = RequestReader(store, rank)
        #: The incarnation of each member's ranks when this rank's group formed.
        self.incarnations: dict[int, str] = {}
        self._shard_buckets: list[int] | None = None

    def handlers(self) -> dict[type, Callable[[Any], Any]]:
        """The handler of each store effect of the protocol."""
        membership = self.membership
        return {
            E.CheckInFor: lambda e: membership.check_in(e.generation, e.checkin),
            E.ReadRecord: lambda e: membership.read_record(e.generation),
            E.ReadCheckIns: lambda e: membership.checkins(e.generation, e.ranks, _malformed),
            E.AnyCheckedIn: lambda e: membership.any_checked_in(e.generation, e.ranks),
            E.MarkReady: lambda e: membership.mark_ready(e.generation),
            E.ReadReady: lambda e: membership.ready(e.generation, e.ranks),
            E.WriteRecord: lambda e: membership.write_record(e.record),
            E.FreeGeneration: lambda e: membership.free_generation(e.generation),
            E.ReadWaiting: lambda e: membership.waiting(),
            E.ReadAlive: self.read_alive, E.ReadRequests: self.read_requests, E.Announce: self.announce,
            E.ReadMembers: self.read_members, E.RequestJoin: self.request_join, E.Admitted: self.admitted,
            E.ReadFinished: self.read_finished, E.ReadLatest: self.read_latest,
        }

    # -- liveness ----------------------------------------------------------------------------------------
    def note_incarnations(self, members: Iterable[int]) -> None:
        """Remember which incarnation of each of the replicas' ranks this rank's group formed with."""
        self.incarnations = self.membership.incarnations(self.layout.ranks_of(members))

    def alive_among(self, replicas: list[int], trained: bool = True) -> set[int] | None:
        """Those of ``replicas`` whose every rank is alive; None when no one keeps liveness keys.

        Args:
            replicas: The replicas to look at.
            trained: Alive in the incarnation this rank's group formed with: a rank restarted since
                then is a joiner, not the member that must check in. A joiner (False) trained with
                nobody: the keys alone count.
        """
        if not self.membership.liveness_kept():
            return None
        live = self.membership.incarnations(self.layout.ranks_of(replicas))
        noted = self.incarnations if trained else {}
        alive = {rank for rank, seen in live.items() if noted.get(rank, seen) == seen}
        return live_replicas(self.layout, alive, replicas)

    def read_alive(self, effect: E.ReadAlive) -> set[int] | None:
        """The effect's replicas that are alive; with ``exclude_waiting``, not those waiting to join.

        A replica some rank of which waits to join will not check in as a member.
        """
        alive = self.alive_among(list(effect.ranks), effect.trained)
        if alive is None or not effect.exclude_waiting:
            return alive
        return alive - set(self.membership.partly_waiting())

    def gone(self, generation: int, members: list[int]) -> str | None:
        """Why the group of ``members`` cannot complete (members gone), or None while every one is alive.

        A member is gone when its liveness key is (its agent restarted it
        after a hang, or its node's lease expired: a frozen node) or names
        another incarnation than the group formed with.
        """
        alive = self.alive_among(members) if members else None
        missing = sorted(set(members) - alive) if alive is not None else []
        if not missing:
            return None
        return f"generation {generation}: member(s) {missing} gone (liveness key expired or replaced)"

    # -- requests ----------------------------------------------------------------------------------------
    def read_requests(self, effect: E.ReadRequests) -> tuple[list[int], list[int]]:
        """Joiners and members asked to leave: one counter read when there are none.

        The primary reads this every step, for the next step's members; the
        read began when this step began computing (:meth:`prefetch_requests`).
        With etcd unreachable (an outage) it gives up after
        :data:`~unicron_elastic.strategy.engine.requests.REQUESTS_PATIENCE_S` and
        reports none, so training goes on and the requests are seen at a later
        step. With TP/PP only the first shard of the primary replica reads
        them (its offer is the one the commit carries); the others report none.
        """
        if self.shard != 0 and effect.proposal:
            return [], []
        try:
            count = self.requests.count_for(effect.step, effect.proposal)
        except StoreUnavailableError as exc:
            log.warning("requests_unreadable", error=str(exc)[:200])
            return [], []
        if count <= 0:
            return [], []
        return self.membership.waiting(), self.membership.leaving(effect.members)

    def prefetch_requests(self, step: int, reads_requests: bool) -> None:
        """The publishing rank begins reading the requests for ``step + 1``'s members now, in a thread.

        The primary's proposal rides in the last bucket, which every other
        rank waits in: a store round trip there (a millisecond or more on a
        busy host) would delay the whole group each step. What was asked
        before ``step`` began computing is seen, as when read at its end; a
        later request waits one step more. The first shard reads for its
        replica; with a member schedule (``reads_requests`` False) nobody reads.
        """
        if self.shard == 0 and reads_requests:
            self.requests.prefetch(step)

    def withdraw_leave_request(self) -> None:
        """Forget this rank's leave request (it retired); a failure is logged, not raised."""
        self.requests.withdraw_leave()

    # -- joining -----------------------------------------------------------------------------------------
    def request_join(self, effect: E.RequestJoin) -> None:
        """Ask to join: the counter first, then this rank's key.

        Whoever sees the key (``waiting()``, e.g. a hold for joiners) must
        find the counter raised, or the primary's next read misses the
        request for a step.
        """
        self.store.add(K.JOIN_REQUESTS, 1)
        self.store.set(K.join(self.rank), "1")

    def admitted(self, effect: E.Admitted) -> None:
        """This rank was admitted: its join request goes."""
        self.store.delete_key(K.join(self.rank))
        self.store.add(K.JOIN_REQUESTS, -1)

    def announce(self, effect: E.Announce) -> None:
        """Tell the ranks waiting to join that a record admits them, a root sending the state from a source."""
        record = effect.record
        self.store.set(K.LATEST, json.dumps({"generation": record.generation, "members": list(record.members),
                                             "step": record.step, "root": effect.root, "source": effect.source}))

    def read_latest(self, effect: E.ReadLatest) -> dict[str, Any] | None:
        """The last admission announced, or None."""
        return json.loads(self.store.get(K.LATEST)) if self.store.check([K.LATEST]) else None

    def read_members(self, effect: E.ReadMembers) -> tuple[int, list[int]] | None:
        """The generation and members the last group's primary published, or None."""
        if not self.store.check([K.MEMBERS]):
            return None
        last = json.loads(self.store.get(K.MEMBERS))
        return int(last["generation"]), list(last["members"])

    # -- a group formed, a step, the end -----------------------------------------------------------------
    def formed(self, generation: int, members: list[int], read_stop: bool = True) -> bool:
        """A group of ``members`` formed: note their incarnations, publish them (the primary's first shard).

        Args:
            generation: The generation of the group.
            members: Its members (replicas).
            read_stop: Read whether a stop was recorded (not when this rank sends one already, nor at start).

        Returns:
            Whether a stop was recorded (members stopped after a step: this group's exchange carries it on).
        """
        self.note_incarnations(members)
        stopped = read_stop and self.store.check([K.STOP])
        if members and members[0] == self.replica and self.shard == 0:
            self.store.set(K.MEMBERS, json.dumps({"generation": generation, "members": list(members)}))
        return stopped

    def record_stop(self, step: int) -> None:
        """This rank stops after ``step``: ranks that regroup because that step's exchange failed on them learn
        it when their group forms. A store error is logged, not raised: the stop goes on."""
        try:
            self.store.set(K.STOP, str(step))
        except Exception as exc:  # noqa: BLE001 - stopping must not turn into a crash
            log.warning("stop_not_recorded", step=step, error=str(exc)[:200])

    def record_finished(self, step: int) -> None:
        """Training is over at ``step``: ranks still waiting to join give up waiting."""
        self.store.set(K.FINISHED, str(step))

    def read_finished(self, effect: E.ReadFinished) -> int | None:
        """The step training finished at, or None."""
        return int(self.store.get(K.FINISHED)) if self.store.check([K.FINISHED]) else None

    def set_buckets(self, buckets: int) -> None:
        """Say how many gradient buckets this rank's shard has (a recomputation reads every shard's)."""
        self.store.set(K.buckets(self.shard), str(buckets))

    def shard_buckets(self) -> list[int]:
        """The number of gradient buckets of every shard (read once)."""
        if self._shard_buckets is None:
            self._shard_buckets = [int(self.store.get(K.buckets(c))) for c in range(self.layout.size)]
        return self._shard_buckets

    def record_non_finite(self, step: int) -> None:
        """This rank found a NaN or Inf in ``step`` (for the error's message)."""
        self.store.set(K.non_finite(step, self.rank), json.dumps({"step": step, "rank": self.rank}))

    def non_finite_ranks(self, step: int, members: list[int]) -> list[int]:
        """The ranks of ``members`` that found a NaN or Inf in ``step`` (lowest first)."""
        return [rank for rank in self.layout.ranks_of(members) if self.store.check([K.non_finite(step, rank)])]

    @property
    def record(self) -> MembershipRecord | None:
        """The last full membership record read or written (every shard's buckets kept)."""
        return self.membership.record

    def close(self) -> None:
        """Stop the request reads' thread."""
        self.requests.close()


def _malformed(generation: int, rank: int, exc: MembershipError) -> None:
    log.warning("dp_checkin_malformed", generation=generation, rank=rank, error=str(exc)[:200])
