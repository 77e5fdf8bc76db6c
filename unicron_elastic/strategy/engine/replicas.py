"""Data-parallel replicas of a tensor x pipeline parallel model, and their one membership authority.

With tensor parallelism (TP) and pipeline parallelism (PP) a *replica* of the
model is ``C = TP x PP`` ranks; the data-parallel (DP) group of each
*shard* (one (tensor rank, stage) position of a replica) reduces that shard's gradients
(paper section 6: "one DP engine per coordinate", the paper's word for a shard). A lost rank loses its
whole replica (its peers cannot compute without it), so membership is decided
per replica, once, for every shard: the recovery protocol
(:class:`~unicron_elastic.strategy.engine.protocol.Protocol`) runs in *replica space*
(its "ranks" are replica indices) and :class:`ReplicaMembership` maps what it
reads and writes onto the ranks' keys in the meeting store:

* a replica checked in for a generation when every rank of it did; its
  check-in is *broken* when one of them is broken or they are in different
  steps (some stepped, some did not: its state is not one step's);
* a replica is alive when every rank of it is, in the incarnation the group
  was formed with; it waits to join when every rank of it waits, and leaves
  when any rank of it is asked to;
* the record of a generation is written once for all shards; it keeps
  the reduced buckets *per shard* (:attr:`MembershipRecord.kept`): each
  shard's group has its own buckets, reduced when that stage's backward is
  done (scenario 2 per stage). A shard's group sees its own count
  (:meth:`MembershipRecord.for_shard`).

Launch ranks are laid out replica-major, ``rank = replica * C + stage * TP +
tensor_rank``: a node of 8 ranks with ``C = 4`` holds two whole replicas, and
a node that grows the run adds whole replicas after the others. The world of
each generation numbers the members' ranks the same way (megatron-core's
``order="tp-pp-dp"``).

With ``C = 1`` every replica is one rank and this is the plain data-parallel
layout: the same keys, the same decisions.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from unicron_elastic.api import ConfigError
from unicron_elastic.store.keys import MeetingKeys as K
from unicron_elastic.strategy.engine.membership import CheckIn, MembershipError, MembershipRecord

#: compare_set(key, _ABSENT, _ABSENT) returns the value, or _ABSENT when the key does not exist: a get that never waits.
_ABSENT = "\x00unicron-absent"


@dataclass(frozen=True)
class ModelParallel:
    """How launch ranks form replicas of a ``tensor x pipeline`` parallel model.

    Attributes:
        tensor: Tensor-parallel size (TP).
        pipeline: Pipeline-parallel size (PP, stages).

    Raises:
        ConfigError: A size below 1.
    """

    tensor: int = 1
    pipeline: int = 1

    def __post_init__(self) -> None:
        for name, value in (("tensor", self.tensor), ("pipeline", self.pipeline)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}-parallel size must be a whole number >= 1 (got {value!r})")

    @property
    def size(self) -> int:
        """C: ranks per replica (one per shard)."""
        return self.tensor * self.pipeline

    def replicas(self, world_size: int) -> int:
        """How many replicas ``world_size`` ranks make.

        Raises:
            ConfigError: ``world_size`` is not a positive multiple of C.
        """
        if world_size < 1 or world_size % self.size:
            raise ConfigError(f"world size {world_size} is not a multiple of TP x PP = {self.size}")
        return world_size // self.size

    def replica(self, rank: int) -> int:
        """The replica of launch rank ``rank``."""
        return rank // self.size

    def shard(self, rank: int) -> int:
        """The shard of launch rank ``rank``: ``stage * TP + tensor_rank``."""
        return rank % self.size

    def tensor_rank(self, rank: int) -> int:
        """The tensor-parallel rank of launch rank ``rank``."""
        return rank % self.tensor

    def stage(self, rank: int) -> int:
        """The pipeline stage of launch rank ``rank``."""
        return self.shard(rank) // self.tensor

    def stage_of(self, shard: int) -> int:
        """The pipeline stage of a shard."""
        return shard // self.tensor

    def rank(self, replica: int, shard: int) -> int:
        """The launch rank at ``shard`` of ``replica``."""
        return replica * self.size + shard

    def ranks(self, replica: int) -> list[int]:
        """The launch ranks of ``replica``."""
        return [self.rank(replica, c) for c in range(self.size)]

    def ranks_of(self, replicas: Iterable[int]) -> list[int]:
        """The launch ranks of every one of ``replicas``, replica by replica."""
        return [rank for replica in replicas for rank in self.ranks(replica)]

    def world_rank(self, members: Sequence[int], rank: int) -> int:
        """Rank of launch rank ``rank`` in the world of the replicas ``members`` (same layout, renumbered).

        Raises:
            ValueError: Its replica is not a member.
        """
        return list(members).index(self.replica(rank)) * self.size + self.shard(rank)

    def neighbour(self, members: Sequence[int], rank: int, stage: int) -> int:
        """World rank (among ``members``) of the rank of the same replica and tensor rank at ``stage``."""
        shard = stage * self.tensor + self.tensor_rank(rank)
        return list(members).index(self.replica(rank)) * self.size + shard

    def tensor_peers(self, members: Sequence[int], rank: int) -> list[int]:
        """The group ranks (in the group of every member rank) of ``rank``'s replica and stage, by tensor rank."""
        base = list(members).index(self.replica(rank)) * self.size + self.stage(rank) * self.tensor
        return [base + t for t in range(self.tensor)]

    def label(self, rank: int) -> str:
        """``tp<t>-pp<p>`` of launch rank ``rank`` (names a shard's files and snapshots)."""
        return f"tp{self.tensor_rank(rank)}-pp{self.stage(rank)}"

    def labels(self) -> list[str]:
        """The labels of every shard, in shard order."""
        return [self.label(c) for c in range(self.size)]


# -- pure decisions ----------------------------------------------------------------------------------------
def combine_checkins(layout: ModelParallel, per_rank: Mapping[int, CheckIn], replicas: Iterable[int],
                     shard: int) -> dict[int, CheckIn]:
    """Each replica's check-in as shard ``shard``'s group sees it.

    Args:
        layout: The model's parallelism.
        per_rank: Launch rank -> its check-in.
        replicas: The replicas asked about.
        shard: Whose ``done`` the result carries.

    Returns:
        ``replica -> CheckIn`` for the replicas every rank of which checked in:
        the lowest step among them, the shard's ``done``, broken when a
        rank is broken or their steps differ.
    """
    out: dict[int, CheckIn] = {}
    for replica in replicas:
        mine = [per_rank.get(rank) for rank in layout.ranks(replica)]
        if any(checkin is None for checkin in mine):
            continue
        steps = {checkin.step for checkin in mine}
        broken = len(steps) > 1 or any(checkin.broken for checkin in mine)
        out[replica] = CheckIn(min(steps), mine[shard].done, broken)
    return out


def kept_per_shard(layout: ModelParallel, per_rank: Mapping[int, CheckIn], members: Sequence[int]) -> tuple[int, ...]:
    """The buckets every member replica completed, per shard.

    Raises:
        MembershipError: A member's rank has no check-in (the record was not decided from check-ins).
    """
    kept = []
    for shard in range(layout.size):
        ranks = [layout.rank(replica, shard) for replica in members]
        missing = [rank for rank in ranks if rank not in per_rank]
        if missing:
            raise MembershipError(f"ranks {missing} of members {list(members)} have not checked in")
        kept.append(min(per_rank[rank].done for rank in ranks))
    return tuple(kept)




def live_replicas(layout: ModelParallel, live_ranks: Collection[int] | None, replicas: Iterable[int]) -> set[int] | None:
    """The replicas every rank of which is alive (None: liveness is not kept)."""
    if live_ranks is None:
        return None
    return {replica for replica in replicas if set(layout.ranks(replica)) <= set(live_ranks)}


def waiting_replicas(layout: ModelParallel, waiting_ranks: Collection[int], replicas: Iterable[int]) -> list[int]:
    """The replicas every rank of which waits to join."""
    return [replica for replica in replicas if set(layout.ranks(replica)) <= set(waiting_ranks)]


def touched_replicas(layout: ModelParallel, ranks: Collection[int], replicas: Iterable[int]) -> list[int]:
    """The replicas at least one rank of which is in ``ranks`` (e.g. asked to leave, or waiting)."""
    return [replica for replica in replicas if set(layout.ranks(replica)) & set(ranks)]


def stages_to_backpropagate(layout: ModelParallel, kept: Sequence[int], buckets: Sequence[int]) -> set[int]:
    """The stages that must run backward when a reduced step's micro-batches are recomputed.

    A stage is *reduced* when every shard of it kept all its buckets
    (``kept[c] >= buckets[c]``); its gradients are not needed again. Backward
    flows from the last stage down, so stage ``s`` runs backward when some
    stage ``<= s`` is not reduced (its own gradients, or those it passes on).
    Stages below every unreduced stage run forward only (the later stages
    need their activations); when every stage is reduced nothing is recomputed.

    Args:
        layout: The model's parallelism.
        kept: Buckets kept per shard.
        buckets: Gradient buckets per shard (the step's commit excluded).

    Returns:
        The stages that run backward (empty: every stage is reduced).
    """
    unreduced = [s for s in range(layout.pipeline)
                 if any(kept[c] < buckets[c] for c in range(layout.size) if layout.stage_of(c) == s)]
    return set(range(min(unreduced), layout.pipeline)) if unreduced else set()


# -- the store ----------------------------------------------------------------------------------------------
def _text(value: Any) -> str:
    return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)


class ReplicaMembership:
    """What one rank reads and writes of the membership in replica space (the protocol's store side).

    Args:
        store: The meeting store (a c10d store: ``set``, ``get``, ``check``,
            ``compare_set``, ``delete_key``, ``add``).
        layout: The model's parallelism.
        rank: This launch rank.
        max_replicas: Replicas ``0..max_replicas-1`` may ask to join.
    """

    def __init__(self, store: Any, layout: ModelParallel, rank: int, max_replicas: int) -> None:
        self.store, self.layout, self.rank, self.max_replicas = store, layout, rank, max_replicas
        self.replica, self.shard = layout.replica(rank), layout.shard(rank)
        self.record: MembershipRecord | None = None  # the last full record read or written (every shard)

    # -- check-ins and records -------------------------------------------------------------------------
    def check_in(self, generation: int, checkin: CheckIn) -> None:
        """Store this rank's check-in for ``generation``."""
        self.store.set(K.checkin(generation, self.rank), checkin.to_json())

    def rank_checkins(self, generation: int, ranks: Iterable[int], on_malformed: Any = None) -> dict[int, CheckIn]:
        """The check-ins of launch ``ranks`` for ``generation`` (a malformed one is passed to ``on_malformed``)."""
        found: dict[int, CheckIn] = {}
        for rank in ranks:
            key = K.checkin(generation, rank)
            if not self.store.check([key]):
                continue
            try:
                found[rank] = CheckIn.from_json(self.store.get(key))
            except MembershipError as exc:
                if on_malformed is not None:
                    on_malformed(generation, rank, exc)
        return found

    def checkins(self, generation: int, replicas: Iterable[int], on_malformed: Any = None) -> dict[int, CheckIn]:
        """The replicas' check-ins for ``generation`` as this rank's shard sees them (:func:`combine_checkins`)."""
        replicas = list(replicas)
        ranks = self.layout.ranks_of(replicas)
        per_rank = self.rank_checkins(generation, ranks, on_malformed)
        return combine_checkins(self.layout, per_rank, replicas, self.shard)

    def any_checked_in(self, generation: int, replicas: Iterable[int]) -> bool:
        """Whether any rank of ``replicas`` checked in for ``generation`` (even if its replica is not complete)."""
        return any(self.store.check([K.checkin(generation, rank)]) for rank in self.layout.ranks_of(replicas))

    def mark_ready(self, generation: int) -> None:
        """This joiner, admitted by ``generation``, built its model."""
        self.store.set(K.ready(generation, self.rank), "1")

    def ready(self, generation: int, replicas: Iterable[int]) -> bool:
        """Whether every rank of ``replicas`` is ready for ``generation``'s state."""
        return all(self.store.check([K.ready(generation, rank)]) for rank in self.layout.ranks_of(replicas))

    def read_record(self, generation: int) -> MembershipRecord | None:
        """The stored record of ``generation`` as this shard sees it, or None."""
        key = K.record(generation)
        if not self.store.check([key]):
            return None
        self.record = MembershipRecord.from_json(self.store.get(key))
        return self.record.for_shard(self.shard)

    def write_record(self, record: MembershipRecord) -> MembershipRecord:
        """Write ``record`` (decided in this shard's view) create-only; returns the stored one, in this view.

        With ``C > 1`` the stored record keeps the buckets of every
        shard: from the members' check-ins for a failure's record (every
        member checked in, and check-ins never change), zeros for a resize.
        """
        full = record
        if self.layout.size > 1 and record.members:
            if record.resize:
                kept = (0,) * self.layout.size
            else:
                ranks = self.layout.ranks_of(record.members)
                kept = kept_per_shard(self.layout, self.rank_checkins(record.generation, ranks), record.members)
            full = MembershipRecord(record.generation, record.members, min(kept), record.dead, record.step,
                                    record.resize, kept)
        stored = self.store.compare_set(K.record(record.generation), "", full.to_json())
        self.record = MembershipRecord.from_json(stored)
        return self.record.for_shard(self.shard)

    def free_generation(self, generation: int) -> int:
        """The first generation from ``generation`` on that has no record yet."""
        while self.store.check([K.record(generation)]):
            generation += 1
        return generation

    # -- liveness, joiners, leavers --------------------------------------------------------------------
    def liveness_kept(self) -> bool:
        """Whether the workers' supervisors keep liveness keys."""
        return self.store.check([K.LIVENESS])

    def incarnations(self, ranks: Iterable[int]) -> dict[int, str]:
        """The liveness values of those ``ranks`` that have one (read without waiting: a key may vanish any time)."""
        values = {rank: _text(self.store.compare_set(K.live(rank), _ABSENT, _ABSENT)) for rank in ranks}
        return {rank: value for rank, value in values.items() if value != _ABSENT}

    def waiting_ranks(self) -> list[int]:
        """Launch ranks waiting to join (alive, when liveness is kept: a joiner that died leaves its request)."""
        asked = [rank for rank in range(self.max_replicas * self.layout.size) if self.store.check([K.join(rank)])]
        if not asked or not self.liveness_kept():
            return asked
        return [rank for rank in asked if self.store.check([K.live(rank)])]

    def waiting(self) -> list[int]:
        """Replicas waiting to join (every rank of them asked)."""
        return waiting_replicas(self.layout, self.waiting_ranks(), range(self.max_replicas))

    def partly_waiting(self) -> list[int]:
        """Replicas some rank of which waits to join: none of them can check in whole as a member."""
        return touched_replicas(self.layout, self.waiting_ranks(), range(self.max_replicas))

    def leaving(self, members: Iterable[int]) -> list[int]:
        """Those of the replicas ``members`` asked to leave (a rank of them is: its node leaves the task)."""
        members = list(members)
        ranks = self.layout.ranks_of(members)
        return touched_replicas(self.layout, [r for r in ranks if self.store.check([K.leave(r)])], members)
