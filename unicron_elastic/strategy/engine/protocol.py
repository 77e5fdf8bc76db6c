"""The data-parallel recovery protocol as a pure state machine (sans-I/O).

:class:`Protocol` holds one rank's view of the data-parallel group (members,
generation, the step's deal) and runs the protocol of :mod:`~unicron_elastic.strategy.engine.elastic_dp`
(a step's reduction, the regroup after a failure, a resize, a join) as generators that
*yield effects* (:mod:`~unicron_elastic.strategy.engine.effects`) and receive their results: no
I/O, no clock. A *transport* executes each effect: the real one with gloo groups and the c10d store
(:class:`~unicron_elastic.strategy.engine.elastic_dp.ElasticDataParallel`), the tests' fake in one
process (``tests/fake_dp.py``), so hundreds of failure combinations run through this very code.

A transport sends each effect's result back (``gen.send``) and throws an
effect's exception into it (``gen.throw``): a failed collective is a
``RuntimeError`` (as gloo's), which the protocol handles; anything else ends it.

The decisions themselves are the pure functions of
:mod:`~unicron_elastic.strategy.engine.membership` (who is in the next generation, who
is left out, whether a group can form) and
:mod:`~unicron_elastic.strategy.engine.microbatch` (who computes which micro-batch).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import structlog

from unicron_elastic.strategy.engine.membership import (CheckIn, MembershipError, MembershipRecord, decide_record,
                                                         formation, proposal, resize_record, role)
from unicron_elastic.strategy.engine.effects import (
    Abandon, Add, Admitted, AgreeMembers, Announce, AnyCheckedIn, BuildGroup, CheckInFor, Compute, Decided, DropGroup,
    Excluded, Fallback, Followed, Formed, FreeGeneration, GatherFailed, MarkReady, Now, Pause, Point, ReadAlive,
    ReadCheckIns,
    ReadFinished, ReadLatest, ReadMembers, ReadReady, ReadRecord, ReadRequests, ReadWaiting, Reassigned, Reduce,
    Regrouped, ReplicaBroken, RequestJoin, Retired, SetGradients, Sleep, StepReport, TransferState,
    WriteRecord,
)
from unicron_elastic.strategy.engine.microbatch import dealt_after_losses, redistribute
from unicron_elastic.strategy.engine.protocol_refresh import Effects, ShardedRefresh

log = structlog.get_logger(__name__)


def _root(latest: dict) -> int:
    """The rank the admission's state comes from."""
    return latest["root"]


# -- the machine ---------------------------------------------------------------------------------------
class Protocol(ShardedRefresh):
    """One rank's side of the recovery protocol; every method that acts is a generator of effects.

    Args:
        rank: This rank (with tensor/pipeline parallelism: its replica).
        members: The group's members (empty for a rank that will join).
        micro_batches: B, micro-batches per step.
        buckets: Gradient buckets reduced in order per step.
        member_schedule: ``step -> members`` from that step on (the primary applies it).
        checkin_timeout: How long (transport clock) a rank alive but not checked in is waited for.
        collective_timeout: Seconds a collective may take (bounds a declared pause).
        logger: Where the protocol logs (structlog-like).
        authority: This rank decides for its replica what one rank must decide alone (with TP/PP: the
            replica's first shard): the resume from the fallback state when no replica is left. The other
            ranks of the replica fetch the same step's state of their shard.
        compute_needs_group: Computing needs the group (the model's own collectives, TP/PP): a failed
            membership sync regroups before computing instead of in the step's reduction.
        ready_timeout: How long (transport clock) the members wait for newcomers to build their model
            (:class:`MarkReady`) before sending them the state.
        sharded: The optimizer is sharded (:mod:`~unicron_elastic.strategy.engine.optimizer_shards`): after
            an optimizer step the parameters are stale until a :class:`Refresh` (before the next step computes;
            a rank whose refresh failed computes its micro-batches after the step's regroup), and every group
            formed after a failure or a resize refreshes first.
        overlap_gather: (Sharded) a step's refresh only starts the gather, and its computation waits for it
            (:class:`Refresh` with ``overlap``); every other refresh waits for the gather.
        scatters: (Sharded) the buckets are reduce-scattered over the members' shares: a regroup that changes
            the members keeps none of the step's buckets (each member's part of them was another layout's).
    """

    def __init__(self, rank: int, members: Sequence[int], micro_batches: int, buckets: int,
                 member_schedule: Mapping[int, Sequence[int]] | None = None, checkin_timeout: float = 10.0,
                 collective_timeout: float = 30.0, logger: Any = None, authority: bool = True,
                 compute_needs_group: bool = False, ready_timeout: float = 300.0, sharded: bool = False,
                 overlap_gather: bool = False, scatters: bool = False) -> None:
        self.rank = rank
        self.authority, self.compute_needs_group = authority, compute_needs_group
        self.sharded, self.overlap_gather, self.scatters = sharded, overlap_gather, scatters
        #: (Sharded) an optimizer step updated the shares since the parameters were last gathered.
        self.stale = False
        #: (Sharded) a gather an overlapped refresh started is in flight: the next computation waits for it.
        self.gathering = False
        self.ready_timeout = ready_timeout
        self.joining = False  # in join(), not admitted yet
        self.resumed: int | None = None  # the step of the fallback state this rank fetched (no replica was left)
        self.members = list(members)
        self.micro_batches, self.buckets = micro_batches, buckets
        self.member_schedule = {int(s): list(m) for s, m in (member_schedule or {}).items()}
        self.checkin_timeout, self.collective_timeout = checkin_timeout, collective_timeout
        self.log = logger if logger is not None else log
        self.generation = 0
        self.next_step = 0
        self.synced_step = -1  # the last step whose membership this rank agreed on
        self.agreed: dict[int, list[int]] = {}  # members of the next step, agreed in this step's all-reduce
        self.early: Regrouped | None = None  # a regroup before the next step began (:meth:`before_validation`)
        self.deal_base: tuple[int, list[int], list[list[int]]] | None = None  # (step, dealt over, lost per regroup)
        self._pending: tuple[int, StepReport, dict[int, list[int]], Any] | None = None

    @property
    def is_primary(self) -> bool:
        """This rank is its group's primary (the lowest member)."""
        return bool(self.members) and self.rank == self.members[0]

    @property
    def reads_requests(self) -> bool:
        """This rank's proposals read the join/leave requests: it is the primary, and no ``member_schedule`` decides the members."""
        return self.is_primary and not self.member_schedule

    # -- one step ----------------------------------------------------------------------------------------
    def assignment(self, step: int) -> dict[int, list[int]]:
        """Who computes which micro-batch of ``step``: dealt over the step's base, the ranks lost since redistributed."""
        base, rounds = self.members, []
        if self.deal_base is not None and self.deal_base[0] == step:
            _, base, rounds = self.deal_base
        return dealt_after_losses(self.micro_batches, base, rounds, self.members)

    def begin_step(self, step: int) -> Effects:
        """Agree on the members of ``step`` and compute this rank's micro-batches; returns the :class:`StepReport`.

        Raises:
            Retired: The member schedule removed this rank from the group at ``step``.
            Excluded: A failure's record (during a resize) left this rank out.
        """
        early = (yield from self._sync_membership(step)) or self.early
        self.early = None
        yield from self.refresh(step)
        yield Point("step", step)
        report = StepReport(step)
        if early is not None:  # the membership sync failed and the group re-formed before computing
            report.recoveries, report.dead = 1, list(early.dead)
        assignment = self.assignment(step)
        report.micro_batches = list(assignment[self.rank])
        # Stale parameters (the refresh failed, the group is gone): computed after the reduction's regroup.
        owed = tuple(report.micro_batches) if self.stale else ()
        try:
            local = yield Compute(step, () if owed else tuple(report.micro_batches))
        except GatherFailed as exc:  # as a failed refresh: computed after the reduction's regroup
            self.log.warning("dp_refresh_failed", step=step, error=str(exc)[:200])
            self.stale, owed = True, tuple(report.micro_batches)
            yield DropGroup()
            local = yield Compute(step, ())
        except ReplicaBroken as exc:
            yield from self._broken(step, 0, exc)
        self.gathering = False
        self._pending = (step, report, assignment, local, owed)
        return report

    def _broken(self, step: int, done: int, exc: ReplicaBroken) -> Effects:
        """This rank's computation failed (its replica lost a peer): check in broken and rejoin.

        The others leave its replica out (a record never keeps a broken rank; with only broken ranks left it
        dissolves the group); it rejoins with the state of another replica.

        Raises:
            Excluded: Always.
        """
        self.log.warning("dp_compute_failed", step=step, error=str(exc)[:200])
        yield from self._regroup(step, done, broken=True)  # raises Excluded once the record is there
        raise Excluded(f"rank {self.rank} (step {step}): its computation failed", None, step)  # (not reached)

    def finish_gradients(self) -> Effects:
        """All-reduce the step begun bucket by bucket, surviving failures; ends with :class:`SetGradients`.

        Returns:
            The step's :class:`StepReport`.

        Raises:
            RuntimeError: No step was begun.
            Excluded: A record left this rank out (alive but late, or behind).
        """
        if self._pending is None:
            raise RuntimeError("finish_gradients() without begin_step()")
        step, report, assignment, local, owed = self._pending
        self._pending = None
        reduced: list[Any] = [None] * self.buckets
        done = 0
        while True:
            try:
                for k in range(done, self.buckets):
                    yield Point("bucket", step, k)
                    last = k == self.buckets - 1
                    offer = None
                    if last and self.is_primary:  # the next step's members ride along in the last bucket
                        offer = tuple((yield from self._proposal(step + 1)))
                    reduced[k], agreed = yield Reduce(step, k, local, offer, last)
                    if last:
                        self.agreed = {step + 1: list(agreed)}
                    done = k + 1
                break
            except RuntimeError as exc:  # a collective failed (gloo's error) or the group was gone already
                self.log.warning("dp_collective_failed", step=step, bucket=done, error=str(exc)[:200])
                outcomes = yield from self._refreshed(step, (yield from self._regroup(step, done)))
                done = outcomes[-1].done
                report.recoveries += 1
                report.kept_buckets = done
                try:
                    for outcome in outcomes:  # one redistribution per regroup, as every member does
                        report.dead += outcome.dead
                        assignment, local = yield from self._reassign(step, report, assignment, local, outcome,
                                                                      announce=outcome is outcomes[-1])
                        owed = () if outcome.base is not None else owed  # (a resize recomputed the rank's share)
                    if owed:
                        local, owed = (yield Add(local, (yield Compute(step, owed, redo=True)))), ()
                except ReplicaBroken as broken:  # a peer of this replica was lost while it recomputed
                    yield from self._broken(step, done, broken)
        yield SetGradients(step, tuple(reduced))
        return report

    def _reassign(self, step: int, report: StepReport, assignment: dict[int, list[int]], local: Any,
                  outcome: Regrouped, announce: bool = True) -> Effects:
        """After a regroup: the lost ranks' micro-batches to the members, or the step dealt afresh (a resize)."""
        if outcome.base is not None:  # the primary's resize record: this step starts over, dealt afresh
            self.deal_base = (step, outcome.base, [outcome.dead] if outcome.dead else [])
            assignment = self.assignment(step)
            report.micro_batches = list(assignment[self.rank])
            local = yield Compute(step, tuple(report.micro_batches), redo=True)
        else:
            moved = redistribute(assignment, outcome.dead)
            extra = moved.get(self.rank, [])
            assignment = {r: assignment[r] + moved[r] for r in assignment if r not in outcome.dead}
            if extra:
                local = yield Add(local, (yield Compute(step, tuple(extra), redo=True)))
                report.micro_batches += extra
        if announce:
            yield Reassigned(step, self.generation, {r: tuple(sorted(js)) for r, js in assignment.items()})
        return assignment, local

    # -- regroup ---------------------------------------------------------------------------------------
    def _regroup(self, step: int, done: int, broken: bool = False) -> Effects:
        """Drop the group, follow the next generation's record, build its group (again if it does not form).

        Args:
            step: The step this rank is in.
            done: Buckets of ``step`` it completed.
            broken: Its computation of ``step`` failed (it checks in broken: never a member).

        Returns:
            What changed (:class:`Regrouped`).

        Raises:
            Excluded: This rank is alive but a record left it out (it checked
                in after the deadline, it is behind the members' step, it is
                broken, or the group dissolved).
        """
        bound = self.checkin_timeout * 2 + self.collective_timeout
        yield Pause(True, bound)  # before anything slow
        self.stale, self.gathering = self.stale or self.gathering, False  # (a gather in flight goes with the group)
        yield DropGroup()
        base: list[int] | None = None
        dead: list[int] = []
        formed, entered = False, list(self.members)
        while not formed:
            yield Pause(True, bound)  # each attempt is bounded
            self.generation += 1
            record = yield from self._await_record(self.generation, CheckIn(step, done, broken))
            yield Followed(record)
            if role(record, self.rank, step) == "joiner" or broken:
                raise Excluded(f"rank {self.rank} (step {step}) was left out of generation {record.generation} "
                               f"(members {list(record.members)}, step {record.step}): it must rejoin", record, step)
            if record.resize:  # the primary's resize (this rank failed the step's membership sync): deal afresh
                base, dead = list(record.members), []
            dead += [r for r in record.dead if r not in dead]
            self.members = list(record.members)
            # A bucket reduce-scattered over other members' shares is the wrong part of the sum: none is kept.
            done = 0 if self.scatters and self.members != entered else record.kept_buckets
            formed = yield from self._form(record, step)
        yield Formed(self.generation, tuple(self.members))
        yield Pause(False, None)
        self.log.warning("dp_group_reformed", generation=self.generation, dead=dead, survivors=self.members,
                         kept_buckets=done)
        return Regrouped(base, dead, done)

    def _await_record(self, generation: int, checkin: CheckIn) -> Effects:
        """Check in for ``generation`` and return its record, written once by whichever rank decides first.

        The wait ends when every previous member checked in or is known dead
        (:func:`~unicron_elastic.strategy.engine.membership.decide_record`), at the
        latest ``checkin_timeout`` after this rank checked in, or when the
        primary's resize record is there.
        """
        yield Point("checkin", checkin.step, generation)
        yield CheckInFor(generation, checkin)
        start = yield Now()
        while True:
            yield Point("poll", checkin.step, generation)
            stored = yield ReadRecord(generation)
            if stored is not None:
                return stored
            checked = yield ReadCheckIns(generation, tuple(self.members))
            alive = yield ReadAlive(tuple(self.members), exclude_waiting=True)
            # a broken rank has no stake in the record: it never leaves others out for being late (healthy
            # replicas check in only when their own collective fails, which may be a whole compute later),
            # unless nobody keeps liveness keys (then only the deadline ends any wait)
            passed = (yield Now()) - start >= self.checkin_timeout and (not checkin.broken or alive is None)
            record = decide_record(generation, self.members, checked, alive, passed)
            yield Decided(generation, tuple(self.members), checked, None if alive is None else frozenset(alive),
                          passed, record)
            if record is not None:  # create-only: the first writer wins, everyone follows what is stored
                yield Point("decided", checkin.step, generation)
                return (yield WriteRecord(record))
            yield Sleep(0.002)

    def _form(self, record: MembershipRecord, step: int) -> Effects:
        """Build the group of ``record`` once every member checked in; False when it will not form (regroup).

        See :func:`~unicron_elastic.strategy.engine.membership.formation`.
        """
        start = yield Now()
        while True:
            yield Point("form", step, record.generation)
            checked = yield ReadCheckIns(record.generation, tuple(record.members))
            alive = yield ReadAlive(tuple(record.members), exclude_waiting=False, trained=not self.joining)
            passed = (yield Now()) - start >= self.checkin_timeout
            verdict = formation(record, checked, alive, passed)
            if verdict == "build":
                return (yield BuildGroup(record))
            if verdict == "abandon":
                self.log.warning("dp_group_abandoned", generation=record.generation, members=list(record.members),
                                 checked_in={r: [c.step, c.done, c.broken] for r, c in checked.items()},
                                 alive=None if alive is None else sorted(alive), deadline_passed=passed)
                yield Abandon(record)
                return False
            yield Sleep(0.002)

    # -- membership between steps -------------------------------------------------------------------------
    def _proposal(self, step: int) -> Effects:
        """The primary's members for ``step``: the member schedule's, else the current ones less those asked to leave plus joiners."""
        if not self.reads_requests:  # a member schedule decides (only the primary calls this)
            return proposal(step, self.members, self.member_schedule, ())
        waiting, leaving = yield ReadRequests(tuple(self.members), step=step)
        return proposal(step, self.members, self.member_schedule, waiting, leaving)

    def _sync_membership(self, step: int) -> Effects:
        """Agree on this step's members; resize if they changed.

        Usually the members were agreed in the previous step's last bucket (the
        primary's proposal rides in it: no extra collective); otherwise (first
        step, after a join) a small all-reduce of the primary's proposal. Both are
        collectives, so a primary that died between steps cannot leave the others
        waiting: the collective fails and this step's reduction handles it.

        With ``compute_needs_group`` a failed sync regroups at once (the model cannot compute without its
        group): the step is then dealt over the members of the record followed.

        Returns:
            What that early regroup changed, else None.

        Raises:
            Retired: This rank is not a member from ``step`` on.
            Excluded: (``compute_needs_group``) the record of the early regroup left this rank out.
        """
        if step == self.synced_step:  # joined at this step: the others agreed on it already
            return None
        self.synced_step = step
        wanted = self.agreed.pop(step, None)
        if wanted is None:
            offer = tuple((yield from self._proposal(step))) if self.is_primary else None
            try:
                wanted = yield AgreeMembers(step, offer)
            except RuntimeError as exc:
                yield Pause(True, self.checkin_timeout + self.collective_timeout)  # regrouping: no hang
                self.log.warning("dp_membership_sync_failed", step=step, error=str(exc)[:200])
                if self.compute_needs_group:  # the model cannot compute without its group: regroup first
                    dead = yield from self._follow_between_steps(step, list(self.members))
                    return Regrouped(None, dead, 0)
                yield DropGroup()  # peers blocked on us fail now; this step's reduction regroups
                return None
        self.agreed.clear()
        if list(wanted) == self.members:
            return None
        yield from self._resize(sorted(wanted), step)
        return None

    def _resize(self, wanted: list[int], step: int) -> Effects:
        """Between steps: change the members to ``wanted`` (joiners admitted, the member schedule's).

        The primary writes the next generation's record create-only
        (:meth:`_propose_resize`); every member checks in and follows the
        stored record - the primary's, or a failure's when a rank was already
        recovering into that generation. A replica sends the state to the
        newcomers; if the group does not form, or the transfer fails, the
        members regroup again (without whoever failed).

        Raises:
            Retired: The record the rank follows is the resize and leaves it out.
            Excluded: A failure's record left this rank out.
        """
        previous = list(self.members)
        if self.rank == previous[0] and self.authority:
            yield from self._propose_resize(self.generation + 1, previous, wanted, step)
        else:
            yield from self._await_proposal(self.generation + 1, previous)
        yield from self._follow_between_steps(step, previous)
        self.log.info("dp_resized", step=step, members=self.members, generation=self.generation)

    def _follow_between_steps(self, step: int, previous: list[int]) -> Effects:
        """Regroup before ``step`` is computed (a resize, a failed membership sync) and finish what the record
        followed asks: the step dealt over a resize's members (a replica sends newcomers the state once they
        are ready) or over ``previous`` less the lost ranks (redistributed regroup by regroup).

        Returns:
            The ranks lost since ``previous``.

        Raises:
            Retired: The record followed is a resize that leaves this rank out.
            Excluded: A failure's record left this rank out.
        """
        base, dead, rounds = previous, [], []
        while True:
            try:
                outcome = yield from self._regroup(step, 0)
            except Excluded as exc:
                if exc.record is not None and exc.record.resize and self.rank not in exc.record.members:
                    self.log.info("dp_retired", step=step, members=list(exc.record.members))
                    raise Retired(f"rank {self.rank} leaves the data-parallel group at step {step}") from exc
                raise
            if outcome.base is not None:
                base, dead, rounds = outcome.base, [], []
            dead += outcome.dead
            rounds += [list(outcome.dead)] if outcome.dead else []
            self.deal_base = (step, base, rounds)
            # A resize's newcomers get the state from a replica (a failure's record has none).
            newcomers = sorted(set(self.members) - set(previous)) if outcome.base is not None else []
            try:
                if newcomers:  # once they are ready
                    yield from self._await_ready(newcomers)
                    yield TransferState(self.members.index(min(set(previous) & set(self.members))), apply=False)
                yield from self._refresh(step)
                return dead
            except RuntimeError as exc:
                event = "dp_resize_transfer_failed" if newcomers else "dp_refresh_failed"
                self.log.warning(event, step=step, error=str(exc)[:200])

    def _await_ready(self, newcomers: list[int]) -> Effects:
        """Wait (at most :attr:`ready_timeout`, a declared pause) until the newcomers built their model.

        A joiner is admitted, and its world built, before its model exists (megatron-core's layers need
        the world): the state broadcast would otherwise wait in a collective.
        """
        yield Pause(True, self.ready_timeout + self.collective_timeout)
        start = yield Now()
        while not (yield ReadReady(self.generation, tuple(newcomers))):
            if (yield Now()) - start >= self.ready_timeout:
                self.log.warning("dp_newcomers_not_ready", generation=self.generation, newcomers=newcomers)
                break
            yield Sleep(0.01)
        yield Pause(False, None)

    def _await_proposal(self, generation: int, previous: list[int]) -> Effects:
        """(A follower) before checking in for a resize, wait for the primary's record of ``generation``.

        The primary writes it only while nobody checked in for ``generation`` (a
        failure's recovery): a follower checking in first would make it defer, and
        the joiners miss the step. The wait ends when the record is there, some
        member checked in, the primary's liveness key is gone, or after ``checkin_timeout``.
        """
        yield Pause(True, self.checkin_timeout + self.collective_timeout)  # waiting for the primary: no hang
        start = yield Now()
        while (yield Now()) - start < self.checkin_timeout:
            if (yield ReadRecord(generation)) is not None or (yield AnyCheckedIn(generation, tuple(previous))):
                return
            if (alive := (yield ReadAlive(tuple(previous[:1]), exclude_waiting=False))) is not None and not alive:
                return  # the primary died: the members regroup without it
            yield Sleep(0.002)

    def _propose_resize(self, generation: int, previous: list[int], wanted: list[int], step: int) -> Effects:
        """(The primary) write the resize record of ``generation`` create-only and announce it to the joiners.

        Nothing is written when a rank already checked in for ``generation``:
        it is recovering from a failure, whose record decides (the joiners are
        proposed again at the next step).

        Raises:
            MembershipError: ``wanted`` keeps no member of ``previous`` (no replica would hold the state).
        """
        if (yield AnyCheckedIn(generation, tuple(previous))):
            self.log.info("dp_resize_deferred", generation=generation, step=step)
            return
        keep = set(previous) & set(wanted)
        if not keep:
            raise MembershipError(f"members {wanted} for step {step} keep none of {previous}: no replica holds the state")
        proposed = resize_record(generation, previous, wanted, step)
        if (yield WriteRecord(proposed)) == proposed:
            yield Announce(proposed, min(keep), "replica")

    # -- join ----------------------------------------------------------------------------------------------
    def join(self, timeout: float) -> Effects:
        """Wait until the group admits this rank, then load its state from a replica.

        When no replica is left (every member of the group that is still alive
        is itself waiting to join), the lowest waiting rank resumes from
        :class:`Fallback` and hands that state to the others.

        A rank whose node is leaving the task (its agent asked it to leave)
        does not ask to join: it ends like a rank that came too late.

        Returns:
            The step to continue from; None if training finished first, or this rank is asked to leave.

        Raises:
            TimeoutError: Not admitted within ``timeout``.
        """
        self.joining = True
        try:
            _, leaving = yield ReadRequests((self.rank,), proposal=False)
            if leaving:
                self.log.info("dp_join_skipped", reason="asked to leave")
                return None
            last = yield ReadMembers()
            floor = last[0] if last is not None else -1  # only a newer generation can admit us (not a stale one)
            yield RequestJoin()
            start = yield Now()
            while (yield Now()) - start < timeout:
                finished = yield ReadFinished()
                if finished is not None:
                    self.log.info("dp_join_too_late", finished_at=finished)
                    return None
                latest = yield ReadLatest()
                if latest is not None and self.rank in latest["members"] and \
                        latest["generation"] > max(floor, self.generation):
                    if (yield from self._enter(latest)):
                        self.synced_step = self.next_step
                        self.agreed.clear()  # what this rank agreed on before it was left out is stale
                        self.deal_base = None
                        yield Admitted(self.generation, latest.get("source", "replica"))
                        self.resumed = None
                        self.log.info("dp_joined", step=self.next_step, members=self.members,
                                      state_from=latest.get("source", "replica"))
                        return self.next_step
                    floor = max(floor, latest["generation"])  # that group did not form: wait for the next one
                yield from self._resume_if_no_replica()
                yield Sleep(0.01)
            raise TimeoutError(f"rank {self.rank} was not admitted to the data-parallel group in {timeout}s")
        finally:
            self.joining = False

    def _enter(self, latest: Mapping[str, Any]) -> Effects:
        """(A joiner) check in, form the announced group, receive the state from its replica.

        Returns:
            False when the group did not form or the state did not arrive (wait for the next admission).
        """
        record = yield ReadRecord(latest["generation"])
        if record is None or self.rank not in record.members:
            return False
        if _root(latest) == self.rank and latest.get("source", "replica") == "replica":
            return False  # a joiner holds no replica's state: this rank restarted while its group formed
        yield CheckInFor(record.generation, CheckIn(record.step, 0))
        self.generation, self.members = record.generation, list(record.members)
        if not (yield from self._form(record, record.step)):
            return False
        yield Formed(self.generation, tuple(self.members))
        try:
            if _root(latest) == self.rank and latest.get("source", "replica") != "replica" \
                    and self.resumed != record.step:  # the group resumes from this replica's fallback: our part
                step, _ = yield Fallback(record.step)
                self.resumed = self.next_step = int(step)
            yield MarkReady(record.generation)
            step = yield TransferState(self.members.index(_root(latest)), apply=True)
            yield from self._refresh(record.step)
        except RuntimeError as exc:  # the replica died while sending (or our part of a fallback is gone): wait
            self.log.warning("dp_join_transfer_failed", generation=self.generation, error=str(exc)[:200])
            yield DropGroup()
            return False
        self.next_step = int(step)
        return True

    def _resume_if_no_replica(self) -> Effects:
        """If every member waits to join, the lowest waiting rank restarts the group from :class:`Fallback`.

        With no group ever formed in this meeting space (a fresh round after
        torch's restart-all, or a node lost while the first group was being
        built), that is when every initial member waits or is known dead
        (liveness keys: without them only all waiting will do). Only the
        replica's :attr:`authority` decides; the other ranks of it fetch the
        same step's state of their shard when they form the group.

        A resume announced after the last group formed is under way (every rank of its replica must
        arrive): while its replica is alive nobody else resumes (another replica, the lowest waiting one
        meanwhile, would start a second group), and only that replica resumes again if its group did not form.
        """
        last = yield ReadMembers()
        latest = yield ReadLatest()
        resuming = None  # the replica resuming from the fallback, whose group has not formed yet
        if latest is not None and latest.get("source", "replica") != "replica" \
                and (last is None or latest["generation"] > last[0]):
            resuming = _root(latest)
            if resuming != self.rank:
                alive = yield ReadAlive((resuming,), exclude_waiting=False, trained=False)
                if alive is None or resuming in alive:
                    return  # it resumes the group: it will admit us
        waiting = yield ReadWaiting()
        if last is None:
            if not self.members:
                return
            alive = yield ReadAlive(tuple(self.members), exclude_waiting=False, trained=False)
            if alive is None and not set(self.members) <= set(waiting):
                return
            if any(r not in waiting and (alive is None or r in alive) for r in self.members):
                return  # an initial member still starts: it builds the first group with the others
            last = (-1, list(self.members))
        last_generation, last_members = last
        alive = yield ReadAlive(tuple(last_members), exclude_waiting=False, trained=False)
        with_state = [r for r in last_members if r not in waiting and (alive is None or r in alive)]
        if with_state or not waiting or not self.authority or self.rank not in waiting:
            return  # a member that holds the state is alive (or nobody waits to resume, or another decides)
        if self.rank != min(waiting) and resuming != self.rank:
            return  # the lowest waiting replica resumes (or this one again, whose resume did not form)
        step, source = yield Fallback()
        self.resumed = self.next_step = int(step)
        generation = yield FreeGeneration(max(last_generation, self.generation) + 1)
        self.log.warning("dp_no_replica_left", lost=list(last_members), resume_step=self.next_step, source=source)
        record = resize_record(generation, last_members, waiting, self.next_step)
        if (yield WriteRecord(record)) == record:
            yield Announce(record, self.rank, source)
