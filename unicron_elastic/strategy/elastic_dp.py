"""Data parallelism that survives the loss of ranks in the middle of a step (paper section 6).

:class:`ElasticDataParallel` runs one optimizer step as: compute this rank's
micro-batches (``deal``), accumulating gradients; all-reduce them bucket by
bucket (on copies: the local sums stay intact); divide by B; step. Gradients
are summed over micro-batches and divided by B, not by the DP size, so the
result does not depend on which rank computed which micro-batch.

When a peer dies (gloo raises on the broken connection):

* survivors destroy the broken group at once (closing its connections, so
  survivors blocked on *them* fail too), check in under a new *generation*
  with their step and the number of its buckets they completed, and follow
  that generation's membership record, written once by whichever survivor
  decides it first (:mod:`~unicron_elastic.strategy.membership`): a rank is
  left out when it is known dead (its liveness key is gone), when it is
  behind (the last bucket completed on others, who already stepped), or, if
  alive but stuck, when it missed the check-in deadline - it then rejoins
  (:class:`Excluded`);
* a group is built only once every member of the record checked in (a
  member that will not come - dead, behind - makes the others regroup under
  the next generation instead of waiting for gloo's timeout);
* scenario 1 (before the all-reduce, or in its first bucket): every bucket is
  redone; the dead rank's micro-batches are dealt round-robin to survivors,
  who add their gradients to the sums they kept;
* scenario 2 (during a bucketed all-reduce): buckets every survivor completed
  keep their reduced values (they contain the dead rank's part); the dead
  rank's micro-batches are recomputed and only the unreduced buckets are
  reduced again.

Reconfiguration happens between steps: the group's leader (lowest member)
proposes each step's membership (following a ``schedule`` - the coordinator's
plan) and, when it changes, writes the next generation's record create-only
(a *resize* record; a failure's record written first wins); ranks that are no
longer members retire; new ranks (``joining=True``, e.g. a worker the agent
restarted) ask to join; without a schedule the leader admits them at the next
step boundary, with one the schedule alone decides.
They receive the state (by default model, optimizer, RNG; the Lightning
strategy sends its whole checkpoint dict) and the step by broadcast from the
leader, a healthy replica. When no replica is left, the lowest joiner resumes
from ``fallback()`` and hands that state to the others. The global batch stays
the same, so the parameter trajectory does not depend on the DP size.

Several ranks may die at once (a node), and a rank may die during the
recovery from another failure: the next collective fails and the survivors
regroup again under the next generation.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import structlog
import torch
import torch.distributed as dist

from unicron_elastic.store.keys import MeetingKeys as K
from unicron_elastic.strategy.membership import (
    CheckIn,
    MembershipError,
    MembershipRecord,
    decide_record,
    formation,
    proposal,
    resize_record,
    role,
)
from unicron_elastic.strategy.microbatch import GlobalBatchPlan, deal, redistribute
from unicron_elastic.strategy.state_transfer import broadcast_state

log = structlog.get_logger(__name__)

Hook = Callable[..., None]
#: compare_set(key, _ABSENT, _ABSENT) returns the value, or _ABSENT when the key does not exist: a get that never waits.
_ABSENT = b"\x00unicron-absent"


@dataclass
class StepReport:
    """What one step did on this rank.

    Attributes:
        step: The step.
        micro_batches: Micro-batch indices whose gradients this rank contributed
            to the buckets that were (re)reduced last.
        recoveries: Failures survived during the step.
        dead: Ranks lost during the step.
        kept_buckets: Buckets kept from before the last failure (scenario 2).
    """

    step: int
    micro_batches: list[int] = field(default_factory=list)
    recoveries: int = 0
    dead: list[int] = field(default_factory=list)
    kept_buckets: int = 0


@dataclass(frozen=True)
class _Regrouped:
    """What a regroup changed for the step in progress.

    Attributes:
        base: Members the step's micro-batches are dealt over afresh (a resize
            record was followed), or None: the deal stands.
        dead: Ranks left out since (their micro-batches go to the members).
        done: Buckets of the step every member completed.
    """

    base: list[int] | None
    dead: list[int]
    done: int


class Retired(Exception):
    """This rank is no longer a member of the data-parallel group (scale-in)."""


class Excluded(Exception):
    """This rank is alive but a membership record left it out: it must rejoin (:meth:`ElasticDataParallel.join`).

    Attributes:
        record: The record that left it out.
    """

    def __init__(self, message: str, record: MembershipRecord | None = None) -> None:
        super().__init__(message)
        self.record = record


class ElasticDataParallel:
    """One data-parallel replica of a model, resilient to the loss of peers.

    Args:
        model: The model (same initial parameters on every rank).
        optimizer: Its optimizer.
        plan: The global-batch plan (B micro-batches per step).
        batch: ``indices -> batch`` (materialises any micro-batch).
        loss_fn: ``(model, batch) -> loss`` (mean over the micro-batch).
        store: A store every rank reaches that outlives workers (the agent's).
        rank: This rank in the initial group.
        world_size: Initial data-parallel size.
        bucket_numel: Elements per gradient bucket (None: one bucket).
        timeout: Timeout of collectives.
        checkin_timeout: After a failure, how long survivors wait for a rank that is alive but has
            not checked in (a stuck one: it is then left out and rejoins). Dead ranks are not waited for.
        hook: Called as ``hook(rank, step, micro_batch=j)`` before each
            micro-batch and ``hook(rank, step, bucket=k)`` before each bucket's
            reduction (fault injection: ``unicron_elastic.faults.maybe_fail``).
        members: Initial members (default ``0..world_size-1``).
        joining: This rank is not a member yet: :meth:`join` waits to be added.
        schedule: ``step -> members`` from that step on (the leader applies it).
        get_state: The state a replica hands to a joiner (default: model,
            optimizer, RNG); the step is added.
        set_state: Loads what ``get_state`` returned (default: the inverse).
        on_group: Called as ``on_group(members, generation)`` after every new
            group (failure, resize, join), before any state moves.
        on_drop: Called when this rank drops its group (a failure, or
            :meth:`close`): drop every other group of the same members too,
            so a rank blocked in one of them with this rank fails at once
            (the Lightning strategy destroys its world group: Lightning's own
            per-step broadcast would otherwise keep a survivor waiting).
        fallback: Called by a joiner when no replica is left (every member is
            waiting to join): returns the state to resume from (in-memory
            snapshot, then persisted checkpoint) or None.
        pause: Called as ``pause(True, bound_s)`` when a regroup begins and
            ``pause(False, None)`` when it ends (e.g. ``Worker.set_paused``:
            a regroup is a declared pause for the hang detector, bounded so a
            rank stuck in it is still found).
        grad_dtype: Dtype of the gradient sums and their all-reduce. float64
            makes the result independent of who computed which micro-batch
            (float32 sums depend on the order: after a failure the last bits
            differ, and Adam-like optimizers amplify that).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        plan: GlobalBatchPlan,
        batch: Callable[[list[int]], Any],
        loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
        store: dist.Store,
        rank: int,
        world_size: int,
        bucket_numel: int | None = None,
        timeout: timedelta = timedelta(seconds=30),
        checkin_timeout: float = 10.0,
        hook: Hook | None = None,
        members: list[int] | None = None,
        joining: bool = False,
        schedule: dict[int, list[int]] | None = None,
        get_state: Callable[[], dict[str, Any]] | None = None,
        set_state: Callable[[dict[str, Any]], None] | None = None,
        on_group: Callable[[list[int], int], None] | None = None,
        fallback: Callable[[], dict[str, Any] | None] | None = None,
        grad_dtype: torch.dtype = torch.float32,
        pause: Callable[[bool, float | None], None] | None = None,
        on_drop: Callable[[], None] | None = None,
    ) -> None:
        self.model, self.optimizer, self.plan = model, optimizer, plan
        self.batch, self.loss_fn, self.store = batch, loss_fn, store
        self.rank, self.timeout, self.checkin_timeout = rank, timeout, checkin_timeout
        self.hook = hook or (lambda *a, **k: None)
        self.world_size = world_size
        self.members = list(members if members is not None else range(world_size))
        self.generation = 0
        self.schedule = dict(schedule or {})
        self.next_step = 0
        self.get_state = get_state or self._default_state
        self.set_state = set_state or self._load_default_state
        self.on_group = on_group or (lambda members, generation: None)
        self.fallback = fallback or (lambda: None)
        self.grad_dtype = grad_dtype
        self.pause = pause or (lambda paused, bound: None)
        self.on_drop = on_drop or (lambda: None)
        self.state_source: str | None = None  # where a joiner's state came from
        self._resume_state: dict[str, Any] | None = None  # fallback state a joiner hands to the others
        self._synced_step = -1  # the last step whose membership this rank agreed on
        self._agreed: dict[int, list[int]] = {}  # members of the next step, agreed in this step's all-reduce
        self._pending: tuple[int, StepReport, dict[int, list[int]], torch.Tensor] | None = None
        self._deal_base: tuple[int, list[int], list[int]] | None = None  # (step, dealt over, lost since)
        self.params = [p for p in model.parameters() if p.requires_grad]
        numel = sum(p.numel() for p in self.params)
        size = bucket_numel or numel
        self.bounds = [(start, min(start + size, numel)) for start in range(0, numel, size)]
        self.pg: dist.ProcessGroupGloo | None = None
        self._incarnations: dict[int, bytes] = {}
        if not joining:
            self.pg = self._group()
            self._note_incarnations()
            if self.rank == self.members[0]:
                self._publish_members()

    # -- groups ----------------------------------------------------------------
    def _group(self) -> dist.ProcessGroupGloo:
        store = dist.PrefixStore(K.group(self.generation), self.store)
        return dist.ProcessGroupGloo(store, self.members.index(self.rank), len(self.members), self.timeout)

    def _publish_members(self) -> None:
        self.store.set(K.MEMBERS, json.dumps({"generation": self.generation, "members": self.members}))

    def _drop_group(self) -> None:
        """Destroy the broken group now, closing its connections.

        ``ProcessGroupGloo.abort()`` does not close them (torch 2.13): a
        survivor whose pending operation is with *this* rank stays blocked
        until the group object is destroyed. Dropping it at once makes every
        survivor see the failure within milliseconds instead of after a timeout.
        """
        if self.pg is None:
            return
        self.on_drop()
        pg, self.pg = self.pg, None
        try:
            pg.abort()
        except RuntimeError:
            pass
        held_elsewhere = sys.getrefcount(pg) > 2  # this name and getrefcount's argument
        del pg  # the destructor closes the sockets
        if held_elsewhere:  # e.g. a frame kept by a traceback: a full collection (slow with big models) frees it
            gc.collect()

    def _alive(self) -> set[int] | None:
        """Members that may still check in: liveness key of the same incarnation, not waiting to join."""
        alive = self._alive_among(self.members)
        return None if alive is None else alive - set(self.waiting())

    def _alive_among(self, ranks: list[int]) -> set[int] | None:
        """Those of ``ranks`` alive in the incarnation this rank trained with; None when no one keeps liveness keys.

        The liveness value names the incarnation: a rank restarted since the
        group formed is a joiner, not the member that must check in.
        """
        if not self.store.check([K.LIVENESS]):
            return None
        live = self._incarnations_of(ranks)
        return {r for r, seen in live.items() if self._incarnations.get(r, seen) == seen}

    def _incarnations_of(self, ranks: list[int]) -> dict[int, bytes]:
        """The liveness values of ``ranks`` that have one (read without waiting: a key may vanish any time)."""
        values = {r: bytes(self.store.compare_set(K.live(r), _ABSENT, _ABSENT)) for r in ranks}
        return {r: v for r, v in values.items() if v != _ABSENT}

    def _note_incarnations(self) -> None:
        """Remember which incarnation of each member this group was formed with."""
        self._incarnations = self._incarnations_of(self.members)

    def _checkins(self, generation: int, ranks: Sequence[int]) -> dict[int, CheckIn]:
        """The check-ins of ``ranks`` for ``generation`` (a malformed one is ignored, with a warning)."""
        found: dict[int, CheckIn] = {}
        for r in ranks:
            if not self.store.check([K.checkin(generation, r)]):
                continue
            try:
                found[r] = CheckIn.from_json(self.store.get(K.checkin(generation, r)))
            except MembershipError as exc:
                log.warning("dp_checkin_malformed", generation=generation, rank=r, error=str(exc)[:200])
        return found

    def _stored_record(self, generation: int) -> MembershipRecord | None:
        if not self.store.check([K.record(generation)]):
            return None
        return MembershipRecord.from_json(self.store.get(K.record(generation)))

    def _await_record(self, generation: int, checkin: CheckIn) -> MembershipRecord:
        """Check in for ``generation`` and return its record, written once by whichever rank decides first.

        The wait ends when every previous member checked in or is known dead
        (:func:`~unicron_elastic.strategy.membership.decide_record`), at the
        latest ``checkin_timeout`` after this rank checked in, or when the
        leader's resize record is there.
        """
        self.store.set(K.checkin(generation, self.rank), checkin.to_json())
        deadline = time.monotonic() + self.checkin_timeout
        while True:
            stored = self._stored_record(generation)
            if stored is not None:
                return stored
            record = decide_record(generation, self.members, self._checkins(generation, self.members),
                                   self._alive(), time.monotonic() > deadline)
            if record is not None:  # create-only: the first writer wins, everyone follows what is stored
                return MembershipRecord.from_json(self.store.compare_set(K.record(generation), "", record.to_json()))
            time.sleep(0.002)

    def _form(self, record: MembershipRecord) -> dist.ProcessGroupGloo | None:
        """Build the group of ``record`` once every member checked in; None when it will not form (regroup).

        See :func:`~unicron_elastic.strategy.membership.formation`.
        """
        deadline = time.monotonic() + self.checkin_timeout
        while True:
            verdict = formation(record, self._checkins(record.generation, record.members),
                                self._alive_among(list(record.members)), time.monotonic() > deadline)
            if verdict == "build":
                break
            if verdict == "abandon":
                log.warning("dp_group_abandoned", generation=record.generation, members=list(record.members))
                return None
            time.sleep(0.002)
        try:
            return self._group()
        except (RuntimeError, LookupError) as exc:  # a member died while the group formed
            log.warning("dp_group_build_failed", generation=record.generation, error=str(exc)[:200])
            return None

    def _regroup(self, step: int, done: int) -> _Regrouped:
        """Drop the group, follow the next generation's record, build its group (again if it does not form).

        Args:
            step: The step this rank is in.
            done: Buckets of ``step`` it completed.

        Returns:
            What changed (see :class:`_Regrouped`).

        Raises:
            Excluded: This rank is alive but a record left it out (it checked
                in after the deadline, or it is behind the members' step).
        """
        bound = self.checkin_timeout * 2 + self.timeout.total_seconds()
        self.pause(True, bound)  # before anything slow
        self._drop_group()
        base: list[int] | None = None
        dead: list[int] = []
        while self.pg is None:
            self.pause(True, bound)  # each attempt is bounded
            self.generation += 1
            record = self._await_record(self.generation, CheckIn(step, done))
            if role(record, self.rank, step) == "joiner":
                raise Excluded(f"rank {self.rank} (step {step}) was left out of generation {record.generation} "
                               f"(members {list(record.members)}, step {record.step}): it must rejoin", record)
            if record.resize:  # the leader's resize (this rank failed the step's membership sync): deal afresh
                base, dead = list(record.members), []
            dead += [r for r in record.dead if r not in dead]
            self.members, done = list(record.members), record.kept_buckets
            self.pg = self._form(record)
        self._note_incarnations()
        if self.rank == self.members[0]:
            self._publish_members()
        self.on_group(self.members, self.generation)
        self.pause(False, None)
        log.warning("dp_group_reformed", generation=self.generation, dead=dead,
                    survivors=self.members, kept_buckets=done)
        return _Regrouped(base, dead, done)

    # -- membership ----------------------------------------------------------------
    def _proposal(self, step: int) -> list[int]:
        """The leader's members for ``step``: the schedule's, else the current ones plus waiting joiners."""
        waiting = self.waiting() if not self.schedule and self.store.add(K.JOIN_REQUESTS, 0) > 0 else []
        return proposal(step, self.members, self.schedule, waiting)

    def _encode(self, members: list[int] | None, dtype: torch.dtype) -> torch.Tensor:
        slots = torch.zeros(self.world_size + 1, dtype=dtype)
        if members is not None:
            slots[0] = len(members)
            slots[1 : 1 + len(members)] = torch.tensor(members, dtype=dtype)
        return slots

    @staticmethod
    def _decode(slots: torch.Tensor) -> list[int]:
        return [int(r) for r in slots[1 : 1 + int(slots[0])].tolist()]

    def _sync_membership(self, step: int) -> None:
        """Agree on this step's members; resize if they changed.

        Usually the members were agreed during the previous step's all-reduce
        (the leader's proposal rides in the last bucket, so it costs no extra
        collective). Otherwise (first step, after a join) a small all-reduce of
        the leader's proposal agrees on them. Both are collectives, not store
        keys, so a leader that died between steps cannot leave the others
        waiting: the collective fails, the
        members stay as they were, and the failure is handled in this step's
        reduction like any other (scenario 1).

        Raises:
            Retired: This rank is not a member from ``step`` on.
        """
        if step == self._synced_step:  # joined at this step: the others agreed on it already
            return
        self._synced_step = step
        wanted = self._agreed.pop(step, None)
        if wanted is None:
            payload = self._encode(self._proposal(step) if self.rank == self.members[0] else None, torch.int64)
            try:
                self.pg.allreduce([payload]).wait()  # the leader's proposal + zeros from the others
            except RuntimeError as exc:
                self.pause(True, self.checkin_timeout + self.timeout.total_seconds())  # regrouping: no hang
                log.warning("dp_membership_sync_failed", step=step, error=str(exc)[:200])
                self._drop_group()  # peers blocked on us fail now; this step's reduction regroups
                return
            wanted = self._decode(payload)
        self._agreed.clear()
        if wanted == self.members:
            return
        self._resize(sorted(wanted), step)

    def _resize(self, wanted: list[int], step: int) -> None:
        """Between steps: change the members to ``wanted`` (joiners admitted, the schedule's members).

        The leader writes the next generation's record create-only
        (:meth:`_propose_resize`); every member checks in and follows the
        stored record - the leader's, or a failure's when a rank was already
        recovering into that generation. A replica sends the state to the
        newcomers; if the group does not form, the members regroup without them.

        Raises:
            Retired: The record the rank follows is the resize and leaves it out.
            Excluded: A failure's record left this rank out.
        """
        previous = list(self.members)
        if self.rank == previous[0]:
            self._propose_resize(self.generation + 1, previous, wanted, step)
        try:
            outcome = self._regroup(step, 0)
        except Excluded as exc:
            if exc.record is not None and exc.record.resize and self.rank not in exc.record.members:
                log.info("dp_retired", step=step, members=list(exc.record.members))
                raise Retired(f"rank {self.rank} leaves the data-parallel group at step {step}") from exc
            raise
        self._deal_base = (step, outcome.base or previous, outcome.dead)
        if outcome.base is not None:  # the resize's group formed: a replica sends the state to the newcomers
            root = min(set(previous) & set(self.members))
            self._broadcast_state(self.members.index(root), apply=False)
        log.info("dp_resized", step=step, members=self.members, generation=self.generation,
                 resized=outcome.base is not None)

    def _propose_resize(self, generation: int, previous: list[int], wanted: list[int], step: int) -> None:
        """(The leader) write the resize record of ``generation`` create-only and announce it to the joiners.

        Nothing is written when a rank already checked in for ``generation``:
        it is recovering from a failure, whose record decides (the joiners are
        proposed again at the next step).

        Raises:
            MembershipError: ``wanted`` keeps no member of ``previous`` (no replica would hold the state).
        """
        if self._checkins(generation, previous):
            log.info("dp_resize_deferred", generation=generation, step=step)
            return
        keep = set(previous) & set(wanted)
        if not keep:
            raise MembershipError(f"members {wanted} for step {step} keep none of {previous}: no replica holds the state")
        proposed = resize_record(generation, previous, wanted, step)
        stored = MembershipRecord.from_json(self.store.compare_set(K.record(generation), "", proposed.to_json()))
        if stored == proposed:
            self._announce(proposed, min(keep))

    def _announce(self, record: MembershipRecord, root: int, source: str = "replica") -> None:
        """Tell the ranks waiting in :meth:`join` that ``record`` admits them, ``root`` sending the state from ``source``."""
        self.store.set(K.LATEST, json.dumps({"generation": record.generation, "members": list(record.members),
                                             "step": record.step, "leader": root, "source": source}))

    def _enter(self, latest: dict[str, Any]) -> bool:
        """(A joiner) enter the group that ``latest`` announced and load the state from its replica.

        Returns:
            False when the group did not form (wait for the next admission).
        """
        record = self._stored_record(latest["generation"])
        if record is None or self.rank not in record.members:
            return False
        self.store.set(K.checkin(record.generation, self.rank), CheckIn(record.step, 0).to_json())
        self.generation, self.members = record.generation, list(record.members)
        self.pg = self._form(record)
        if self.pg is None:
            return False
        self._note_incarnations()
        if self.rank == self.members[0]:
            self._publish_members()
        self.on_group(self.members, self.generation)
        self._broadcast_state(self.members.index(latest["leader"]))
        return True

    def finish(self) -> None:
        """Training is over: ranks still waiting in :meth:`join` give up waiting (any member says so)."""
        if self.rank in self.members and self.pg is not None:
            self.store.set(K.FINISHED, str(self.next_step))

    def close(self) -> None:
        """Destroy this rank's group; call before the process exits.

        A gloo group still alive when the interpreter shuts down can abort the
        process ("terminate called without an active exception": its threads
        are torn down while running), so a finished rank would exit with SIGABRT.
        """
        self._drop_group()

    def join(self, timeout: float = 120.0) -> int | None:
        """Wait until the group admits this rank, then load its state from a replica.

        When no replica is left (every member of the group that is still alive
        is itself waiting to join), the lowest waiting rank resumes from
        ``fallback()`` (in-memory snapshot, else persisted checkpoint), else
        from step 0 with its fresh state and a warning, and hands that state to
        the others. :attr:`state_source` says which it was.

        Returns:
            The step to continue from; None if training finished first.

        Raises:
            TimeoutError: Not admitted within ``timeout`` seconds.
        """
        # only a generation newer than the group's current one can admit us (not a stale admission)
        floor = json.loads(self.store.get(K.MEMBERS))["generation"] if self.store.check([K.MEMBERS]) else -1
        self.store.set(K.join(self.rank), "1")
        self.store.add(K.JOIN_REQUESTS, 1)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.store.check([K.FINISHED]):
                log.info("dp_join_too_late", finished_at=int(self.store.get(K.FINISHED)))
                return None
            if self.store.check([K.LATEST]):
                latest = json.loads(self.store.get(K.LATEST))
                if self.rank in latest["members"] and latest["generation"] > max(floor, self.generation):
                    source = latest.get("source", "replica")
                    if self._enter(latest):
                        self.state_source = source
                        self._resume_state = None
                        self._synced_step = self.next_step
                        self.store.delete_key(K.join(self.rank))
                        self.store.add(K.JOIN_REQUESTS, -1)
                        log.info("dp_joined", step=self.next_step, members=self.members, state_from=source)
                        return self.next_step
                    floor = max(floor, latest["generation"])  # that group did not form: wait for the next one
            self._resume_if_no_replica()
            time.sleep(0.01)
        raise TimeoutError(f"rank {self.rank} was not admitted to the data-parallel group in {timeout}s")

    def waiting(self) -> list[int]:
        """Ranks waiting in :meth:`join` to be admitted."""
        return [r for r in range(self.world_size) if self.store.check([K.join(r)])]

    def _resume_if_no_replica(self) -> None:
        """If every member waits to join, the lowest waiting rank restarts the group from ``fallback``.

        Raises:
        When nothing is left (no replica, no snapshot, no checkpoint), it
        resumes from step 0 with its own fresh state and logs
        ``dp_restart_from_step_0``.
        """
        if not self.store.check([K.MEMBERS]):
            return
        last = json.loads(self.store.get(K.MEMBERS))
        waiting = self.waiting()
        alive = self._alive_among(last["members"])
        holders = [r for r in last["members"] if r not in waiting and (alive is None or r in alive)]
        if holders or not waiting or self.rank != min(waiting):
            return  # a member that holds the state is alive (or nobody waits to resume)
        state = self.fallback()
        if state is None:  # nothing persisted: this joiner's fresh state is step 0's
            log.warning("dp_restart_from_step_0", lost=last["members"],
                        reason="no replica, no in-memory snapshot and no checkpoint is left")
            state = {**self.get_state(), "step": 0, "source": "step0"}
        self._apply_state(state)
        self._resume_state = state  # what we broadcast: our own live state is only partly restored yet
        self.state_source = state.get("source", "fallback")
        generation = self._free_generation(max(last["generation"], self.generation) + 1)
        log.warning("dp_no_replica_left", lost=last["members"], resume_step=self.next_step, source=self.state_source)
        record = resize_record(generation, last["members"], waiting, self.next_step)
        stored = MembershipRecord.from_json(self.store.compare_set(K.record(generation), "", record.to_json()))
        if stored == record:
            self._announce(record, self.rank, self.state_source)

    def _free_generation(self, generation: int) -> int:
        """The first generation from ``generation`` on that has no record yet."""
        while self.store.check([K.record(generation)]):
            generation += 1
        return generation

    # -- state --------------------------------------------------------------------
    def _default_state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "rng": torch.get_rng_state()}

    def _load_default_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])

    def state(self) -> dict[str, Any]:
        """This replica's state at the current step boundary (what a joiner receives)."""
        if self._resume_state is not None:
            return self._resume_state
        return {**self.get_state(), "step": self.next_step}

    def _apply_state(self, state: dict[str, Any]) -> None:
        self.set_state(state)
        self.next_step = int(state["step"])

    def _broadcast_state(self, root: int, apply: bool = True) -> None:
        """The state (:meth:`state`) from the replica at ``root`` to every other member, tensor by tensor.

        A JSON skeleton first, then each tensor in its own broadcast, received
        into a preallocated tensor (:mod:`~unicron_elastic.strategy.state_transfer`):
        no blob, and receiving never unpickles anything.

        Args:
            root: Index of the sending member.
            apply: Load what arrives (False for members that hold the state already).

        Raises:
            StateEncodingError: (sender) The state holds a value the format cannot carry
                (the receivers are told at once and raise StateDecodingError).
            StateDecodingError: (receiver) What arrived is not a safe state.
        """
        index = self.members.index(self.rank)
        state = broadcast_state(self.pg, root, index, self.state() if index == root else None)
        if index != root and apply:
            self._apply_state(state)

    # -- one step ----------------------------------------------------------------
    def _compute(self, step: int, micro_batches: list[int]) -> torch.Tensor:
        total = torch.zeros(sum(p.numel() for p in self.params), dtype=self.grad_dtype)
        views, offset = [], 0
        for p in self.params:
            views.append(total[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        for j in micro_batches:
            self.hook(self.rank, step, micro_batch=j)
            for p in self.params:
                p.grad = None
            self.loss_fn(self.model, self.batch(self.plan.indices(step, j))).backward()
            for p, view in zip(self.params, views):
                view.add_(p.grad)  # in place into the sum's dtype: no temporary copies
        return total

    def _assignment(self, step: int) -> dict[int, list[int]]:
        """Who computes which micro-batch of ``step``: dealt over the step's base, the ranks lost since redistributed."""
        base, dead = self.members, []
        if self._deal_base is not None and self._deal_base[0] == step:
            _, base, dead = self._deal_base
        dealt = deal(self.plan.num_micro_batches, list(base))
        moved = redistribute(dealt, dead) if dead else {}
        return {r: dealt.get(r, []) + moved.get(r, []) for r in self.members}

    def begin_step(self, step: int) -> StepReport:
        """Agree on the members of ``step`` and compute this rank's micro-batches.

        Returns:
            The report, completed by :meth:`finish_gradients`.

        Raises:
            Retired: The plan removed this rank from the group at ``step``.
        """
        self._sync_membership(step)
        report = StepReport(step)
        assignment = self._assignment(step)
        report.micro_batches = list(assignment[self.rank])
        self._pending = (step, report, assignment, self._compute(step, report.micro_batches))
        return report

    def finish_gradients(self) -> StepReport:
        """All-reduce the gradients of the step begun, surviving failures; set ``p.grad`` to sum / B.

        Raises:
            RuntimeError: No step was begun.
        """
        if self._pending is None:
            raise RuntimeError("finish_gradients() without begin_step()")
        step, report, assignment, local = self._pending
        self._pending = None
        reduced: list[torch.Tensor | None] = [None] * len(self.bounds)
        done = 0
        while True:
            try:
                for k in range(done, len(self.bounds)):
                    self.hook(self.rank, step, bucket=k)
                    if self.pg is None:
                        raise RuntimeError("the group failed before this reduction (membership sync)")
                    start, end = self.bounds[k]
                    last = k == len(self.bounds) - 1
                    if last:  # the next step's members ride along (the leader's proposal, zeros elsewhere)
                        proposal = self._proposal(step + 1) if self.rank == self.members[0] else None
                        buf = torch.cat([local[start:end], self._encode(proposal, local.dtype)])
                    else:
                        buf = local[start:end].clone()  # reduce a copy: the local sum survives a failure
                    self.pg.allreduce([buf]).wait()
                    if last:
                        self._agreed = {step + 1: self._decode(buf[end - start :])}
                        buf = buf[: end - start]
                    reduced[k] = buf
                    done = k + 1
                break
            except RuntimeError as exc:
                log.warning("dp_collective_failed", step=step, bucket=done, error=str(exc)[:200])
                outcome = self._regroup(step, done)
                done = outcome.done
                report.recoveries += 1
                report.dead += outcome.dead
                report.kept_buckets = done
                if outcome.base is not None:  # the leader's resize record: this step starts over, dealt afresh
                    self._deal_base = (step, outcome.base, outcome.dead)
                    assignment = self._assignment(step)
                    report.micro_batches = list(assignment[self.rank])
                    local = self._compute(step, report.micro_batches)
                    continue
                moved = redistribute(assignment, outcome.dead)
                extra = moved.get(self.rank, [])
                assignment = {r: assignment[r] + moved[r] for r in self.members}
                if extra:
                    local = local + self._compute(step, extra)
                    report.micro_batches += extra
        grad = torch.cat([t for t in reduced if t is not None]) / self.plan.num_micro_batches
        offset = 0
        for p in self.params:
            p.grad = grad[offset : offset + p.numel()].view_as(p).to(p.dtype, copy=True)
            offset += p.numel()
        return report

    def train_step(self, step: int) -> StepReport:
        """Run optimizer step ``step`` over the whole global batch, whatever ranks die.

        Returns:
            What this rank did.

        Raises:
            Retired: The plan removed this rank from the group at ``step``.
        """
        self.begin_step(step)
        report = self.finish_gradients()
        self.hook(self.rank, step, at="before_optimizer_step")
        self.optimizer.step()
        self.next_step = step + 1
        self.hook(self.rank, step, at="after_optimizer_step")
        return report
