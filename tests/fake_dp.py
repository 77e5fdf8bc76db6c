"""An in-process run of the data-parallel recovery protocol over fake collectives and a fake clock (tests only).

The ranks run the engine's own parts, the very code
:class:`~unicron_elastic.strategy.engine.elastic_dp.ElasticDataParallel` runs:
its :class:`~unicron_elastic.strategy.engine.protocol.Protocol`, its effect loop
(:func:`~unicron_elastic.strategy.engine.effect_loop.execute`) and every store
effect through its :class:`~unicron_elastic.strategy.engine.store_effects.EngineStore`,
over :class:`FakeStore` (an in-memory c10d-like store). Only the collectives
(groups, reductions, the state's broadcast, the micro-batches' computation),
the clock and the hooks (fault points, pauses, the fallback state) are fakes:

* every rank is a generator; :meth:`Sim.run` advances the live ones in rounds,
  each one action per round in a seeded random order (a *slow* rank skips
  rounds at random, a *late* one waits before checking in);
* :class:`FakeGroup` matches collectives by sequence number, like gloo: an
  all-reduce completes when every member entered it; a rank waiting in one
  fails when a ring neighbour is dead or dropped the group (a survivor blocked
  on a *survivor* fails only once that survivor drops its group); building a
  group fails when any member is dead;
* :class:`FakeStore` is a c10d-like store (``compare_set(key, "", v)`` is
  create-only); liveness keys of dead ranks vanish ``liveness_delay`` rounds
  after the death (a lease TTL);
* micro-batch ``j`` of step ``s`` has an exact integer gradient
  (:func:`gradient`), so sums compare exactly and a micro-batch counted twice
  or never is visible (:func:`counts`).

Ranks die at *points* (start of a step, a micro-batch, entering or having
entered a bucket, checking in, polling, deciding, building a group, recomputing a moved
micro-batch), or together with another rank wherever they are (a node lost).
A rank waiting to join cannot die. A resize (a joiner admitted between steps)
is the leader's create-only record, like a failure's; when its group does not
form (a member died, or is behind), the members regroup under the next
generation and the joiners wait for the next admission. When no replica is
left (every member of the last group dead, liveness keys gone), the lowest
joiner resumes from step 0 (the engine: snapshot, checkpoint, else step 0) and
the others join it; without liveness keys nobody can know, and the run ends
with ``Sim.outcome == "no_replica"``; ``"all_dead"`` when every rank died.

Tensor x pipeline parallel replicas (``Scenario.model_parallel``, C = TP x PP > 1):
every simulated process is a launch rank (``replica * C + shard``) that runs
the protocol in *replica space* (its protocol rank is its replica) over a
:class:`~unicron_elastic.strategy.engine.replicas.ReplicaMembership` on the fake store,
as :class:`~unicron_elastic.strategy.engine.elastic_dp.ElasticDataParallel` does:

* each generation has one group per shard (that shard's K buckets, one
  rank per member replica) and one *commit* group of every rank of the members:
  the protocol's last pseudo-bucket (index K) is the commit all-reduce, which
  carries the offer of shard 0 of the leading replica (the other
  shards offer nothing; they also read no join or leave requests);
* the model's own collectives are lockstep within a replica: a micro-batch is
  computed when every rank of the replica reached it, and a rank waiting there
  fails with :class:`~unicron_elastic.strategy.engine.protocol.ReplicaBroken` when a
  rank of its replica is dead or no longer holds that generation's groups
  (dropped them, moved on, or was restarted); a recomputation after a failure
  runs (with PP) only the stages :func:`~unicron_elastic.strategy.engine.replicas.stages_to_backpropagate`
  names, the others' sums being zeros (forward only);
* liveness is read per incarnation (``live/<rank>`` holds ``incarnation-<n>``),
  as the real transport does: a rank restarted since a group formed is not the
  member that group waits for; with ``Scenario.restart_after`` a killed rank is
  restarted (a new incarnation, a joiner) that many rounds after its death, and
  its replica can be admitted again once every rank of it waits (a restarted
  incarnation does not die again); without it, dead ranks stay dead and the
  other ranks of their replica wait to join until training finishes;
* every shard's gradient is :func:`gradient` (K buckets each).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import Any

from unicron_elastic.store.keys import MeetingKeys as K
from unicron_elastic.strategy.engine import effects as E
from unicron_elastic.strategy.engine.effect_loop import execute
from unicron_elastic.strategy.engine.effects import Excluded, ReplicaBroken
from unicron_elastic.strategy.engine.membership import CheckIn, MembershipRecord
from unicron_elastic.strategy.engine.protocol import Protocol
from unicron_elastic.strategy.engine.replicas import ModelParallel, stages_to_backpropagate
from unicron_elastic.strategy.engine.store_effects import EngineStore

BASE = 1 << 8  # micro-batch j weighs BASE**j: counts below BASE decode exactly

Label = tuple[str, int, int | None]  # (kind, step, index) of a point
DeathSpec = int | tuple  # die at the n-th point, or at the first point whose label starts with the tuple


def gradient(step: int, micro_batch: int, buckets: int) -> tuple[int, ...]:
    """The exact gradient of ``micro_batch`` of ``step``: one integer per bucket."""
    return tuple((step * buckets + k + 1) * BASE**micro_batch for k in range(buckets))


def expected(step: int, micro_batches: int, buckets: int) -> tuple[int, ...]:
    """The failure-free sum of the gradients of ``step``."""
    return tuple(sum(gradient(step, j, buckets)[k] for j in range(micro_batches)) for k in range(buckets))


def counts(value: int, step: int, bucket: int, buckets: int, micro_batches: int) -> list[int]:
    """How many times each micro-batch is in a bucket's ``value`` (for messages)."""
    unit, out = step * buckets + bucket + 1, []
    rest, remainder = divmod(value, unit)
    for _ in range(micro_batches):
        rest, count = divmod(rest, BASE)
        out.append(count)
    return out + ([f"rest={rest},remainder={remainder}"] if rest or remainder else [])


class SimStuck(AssertionError):
    """The simulation made no progress within its round limit (a deadlock)."""


class ProtocolViolation(AssertionError):
    """Members of a group disagreed on a collective (different steps/buckets, two leaders)."""


class _Died(BaseException):
    """The rank dies here (not an ``Exception``: the effect loop does not throw it into the protocol)."""


class _Failed(RuntimeError):
    """A collective failed on this rank (gloo raises a RuntimeError)."""


class _ModelError(RuntimeError):
    """(C > 1) The model's computation failed otherwise than by a lost peer (thrown into the protocol as is)."""


@dataclass(frozen=True)
class Scenario:
    """One run of the fake.

    Attributes:
        world: Ranks at the start (0..world-1).
        buckets: K, gradient buckets all-reduced in order.
        micro_batches: B per step.
        steps: Optimizer steps to run.
        deaths: ``rank -> DeathSpec``.
        together: Ranks that die with the first of them that dies (a node).
        slow: Ranks that skip rounds at random.
        late: ``rank -> rounds`` it waits after a failure before checking in.
        liveness: Liveness keys are kept (else ``alive`` is None).
        liveness_delay: Rounds between a death and its liveness key vanishing.
        deadline: Polls after its check-in when a rank's deadline passes; None: never.
        joiner_at: Round at which a new rank (``world``) asks to join; None: no one.
        leaving: ``rank -> round`` at which its agent asks it to leave (the plan
            takes its node away): it retires at a step boundary.
        unformed: Ranks lost before the first group formed (their node died at
            start-up): the others start as joiners (they were restarted after
            building the first group failed), no group and no members record exist.
        partial: Chance that a rank whose neighbour is down fails a bucket that
            completed (the others got it): only some members complete it.
        partial_last: ``partial`` applies to the last bucket too (with TP x PP > 1: the commit).
        seed: The interleaving.
        model_parallel: ``(TP, PP)``; with ``TP x PP = C > 1`` the ranks form replicas of C ranks
            (``world`` counts launch ranks and must be a multiple of C; ``deaths``, ``together``,
            ``slow``, ``late``, ``leaving``, ``unformed`` name launch ranks; a joiner is a whole replica).
        restart_after: (C > 1) rounds after its death at which a killed rank starts again as a joiner.
        sharded: (C = 1) the optimizer is sharded: after each step's optimizer step (a point ``update``) the
            parameters are stale until the protocol's refresh, a collective of the group (a point ``refresh``);
            a rank that computes with stale parameters violates the protocol.
        eager_refresh: (sharded) each rank refreshes right after its optimizer step (the Lightning strategy's
            order), not when the next step begins (the engine's ``train_step``).
        validate: (sharded, ``eager_refresh``) after that refresh every rank validates (the Lightning
            strategy's ``on_validation_start``: :meth:`Protocol.before_validation`); a rank that validates
            stale parameters violates the protocol.
        overlap_gather: (sharded) a step's refresh only enters its collective (``overlap_param_gather``); the
            next computation waits for it first (a failure there is
            :class:`~unicron_elastic.strategy.engine.effects.GatherFailed`), as does a refresh that waits.
        scatters: (sharded) the buckets are reduce-scattered over the members' shares: a step whose gradients
            hold a bucket reduced under other members than its last bucket's violates the protocol.
    """

    world: int
    buckets: int
    micro_batches: int
    steps: int = 2
    deaths: Mapping[int, DeathSpec] = field(default_factory=dict)
    together: frozenset[int] = frozenset()
    slow: frozenset[int] = frozenset()
    late: Mapping[int, int] = field(default_factory=dict)
    liveness: bool = True
    liveness_delay: int = 0
    deadline: int | None = None
    joiner_at: int | None = None
    leaving: Mapping[int, int] = field(default_factory=dict)
    unformed: frozenset[int] = frozenset()
    partial: float = 0.0
    partial_last: bool = False
    seed: int = 0
    model_parallel: tuple[int, int] = (1, 1)
    restart_after: int | None = None
    sharded: bool = False
    eager_refresh: bool = False
    validate: bool = False
    overlap_gather: bool = False
    scatters: bool = False


@dataclass(frozen=True)
class Poll:
    """One evaluation of ``decide_record`` by one rank, and what it saw."""

    round: int
    rank: int
    generation: int
    previous: tuple[int, ...]
    checked_in: dict[int, CheckIn]
    alive: frozenset[int] | None
    deadline_passed: bool
    really_alive: frozenset[int]
    result: MembershipRecord | None


@dataclass
class Death:
    """A rank's death: when, where, and whether it was the leader of its group then."""

    rank: int
    round: int
    label: Label | None  # None: killed with its node while elsewhere
    was_leader: bool
    in_recovery: bool


class FakeStore:
    """A c10d-like key-value store (strings), with the create-only writes counted."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self.creates: dict[str, int] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value

    def get(self, key: str) -> str:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def delete_key(self, key: str) -> bool:
        return self.data.pop(key, None) is not None

    def add(self, key: str, delta: int) -> int:
        value = int(self.data.get(key, "0")) + int(delta)
        self.data[key] = str(value)
        return value

    def compare_set(self, key: str, expected_value: str, desired: str) -> str:
        current = self.data.get(key)
        if (current is None and expected_value == "") or (current is not None and current == expected_value):
            self.data[key] = desired
            self.creates[key] = self.creates.get(key, 0) + 1
            return desired
        return current if current is not None else expected_value


@dataclass
class _Op:
    entered: dict[int, tuple[Any, int, Any]] = field(default_factory=dict)
    result: tuple[int, Any] | None = None
    aborted: bool = False


class FakeGroup:
    """One generation's group: collectives matched by sequence number, like gloo."""

    def __init__(self, sim: Sim, generation: int, members: list[int], kind: Any = None) -> None:
        self.sim, self.generation, self.members, self.kind = sim, generation, list(members), kind
        self.dropped: set[int] = set()
        self.ops: dict[int, _Op] = {}
        self.seq = dict.fromkeys(members, 0)

    def drop(self, rank: int) -> None:
        """``rank`` destroyed its group object: its connections close."""
        self.dropped.add(rank)

    def _down(self) -> set[int]:
        # (a rank restarted since this generation: its old process, the one this group was made for, is gone)
        defunct = {r for r, upto in self.sim.defunct.items() if self.generation <= upto}
        return (self.sim.dead | self.dropped | defunct) & set(self.members)

    def broken_for(self, rank: int, any_member: bool = False) -> bool:
        """``rank`` sees the failure: a ring neighbour (any member when building the group) is down."""
        down = self._down() - {rank}
        if any_member:
            return bool(down)
        i, n = self.members.index(rank), len(self.members)
        return bool({self.members[(i - 1) % n], self.members[(i + 1) % n]} & down)

    def enter(self, rank: int, label: Any, value: int, payload: Any = None, build: bool = False) -> int:
        """Contribute to the next collective of ``rank``; returns its sequence number.

        Raises:
            _Failed: The group is broken for ``rank``.
        """
        seq = self.seq[rank]
        self.seq[rank] += 1
        op = self.ops.setdefault(seq, _Op())
        if self.broken_for(rank, build):
            op.aborted = True
            raise _Failed
        op.entered[rank] = (label, value, payload)
        if len(op.entered) == len(self.members) and not op.aborted:
            labels = {repr(entry[0]) for entry in op.entered.values()}
            payloads = [entry[2] for entry in op.entered.values() if entry[2] is not None]
            if len(labels) > 1:
                raise ProtocolViolation(f"generation {self.generation} {self.kind or ''} collective {seq}: members "
                                        f"disagree "
                                        f"{ {r: e[0] for r, e in op.entered.items()} }")
            if len(payloads) > 1:
                raise ProtocolViolation(f"generation {self.generation} collective {seq}: two leaders {payloads}")
            op.result = (sum(entry[1] for entry in op.entered.values()), payloads[0] if payloads else None)
            if not build:  # (forming a group trains nothing: a group that did not form whole may complete it)
                self.sim.collectives.append((self.sim.tick(), self.generation, self.kind, seq))
        return seq

    def wait(self, rank: int, seq: int, partial: float = 0.0, build: bool = False) -> Generator[None, None, tuple]:
        """Wait for collective ``seq``: its (sum, the leader's payload).

        Raises:
            _Failed: The group broke for ``rank`` first (or, with chance
                ``partial``, after the result was complete: only some members got it).
        """
        op = self.ops[seq]
        while True:
            if op.result is not None:
                if partial and self.broken_for(rank, build) and self.sim.rng.random() < partial:
                    raise _Failed
                return op.result
            if self.broken_for(rank, build):
                op.aborted = True  # a member gave up on it: it can no longer complete for anyone
                raise _Failed
            yield


class _Quiet:
    """A logger that drops everything (the protocol logs; thousands of simulated runs need not)."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


class _Rank:
    """One worker: the engine's own protocol (:class:`~unicron_elastic.strategy.engine.protocol.Protocol`) over the fakes.

    It executes the protocol's effects as the real transport does with gloo
    and a c10d store, yielding to the scheduler where a real rank would wait.
    The fake clock of a rank counts its polls (:class:`~unicron_elastic.strategy.engine.protocol.Sleep`),
    so the check-in deadline is ``Scenario.deadline`` polls.
    """

    def __init__(self, sim: Sim, rank: int, members: list[int], joining: bool, incarnation: int = 0) -> None:
        sc = sim.scenario
        self.sim, self.rank, self.incarnation = sim, rank, incarnation
        self.protocol = Protocol(self._protocol_rank(), members, sc.micro_batches, self._protocol_buckets(),
                                 checkin_timeout=math.inf if sc.deadline is None else sc.deadline, logger=_Quiet(),
                                 **self._protocol_options())
        self.group: FakeGroup | None = None
        self.gather: tuple[FakeGroup, int] | None = None  # an overlapped refresh's collective, not waited for
        self.scattered: dict[tuple[int, int], tuple[int, ...]] = {}  # (step, bucket) -> the members it was reduced in
        if not joining:
            self._first_groups(list(members))
        self.points = 0
        self.step: int | None = None  # the step begun last (None: never, or joining)
        self.was_broken = False  # (C > 1) its computation of the step failed (ReplicaBroken)
        self.joining = joining
        self.in_recovery = False
        self.last_label: Label | None = None
        self.clock = 0
        #: The engine's own store effects (over the fake store): only collectives and the clock are fakes.
        self.store_effects = EngineStore(sim.store, sim.layout, rank, sim.max_replicas)
        self.handlers: dict[type, Callable[[Any], Any]] = {
            **self.store_effects.handlers(),
            E.Point: lambda e: self.point(e.kind, e.step, e.index), E.Compute: self.compute,
            E.Add: lambda e: [a + b for a, b in zip(e.total, e.extra)], E.Reduce: self.reduce,
            E.AgreeMembers: self.agree, E.Pause: self.pause, E.DropGroup: self.drop,
            E.Now: lambda e: self.clock, E.Sleep: self.sleep, E.WriteRecord: self.write_record,
            E.Abandon: self.abandon, E.BuildGroup: self.build, E.Formed: self.formed,
            E.TransferState: self.transfer, E.SetGradients: self.set_gradients,
            E.RequestJoin: self.request_join, E.Admitted: self.admitted, E.Fallback: self.fallback,
            E.Decided: self.decided, E.Followed: self.followed, E.Reassigned: self.reassigned,
            E.Refresh: self.refresh,
        }
        self.handlers = {kind: _failing_as_collectives(handler) for kind, handler in self.handlers.items()}

    def _protocol_rank(self) -> int:
        return self.rank

    def _protocol_options(self) -> dict[str, bool]:
        sc = self.sim.scenario
        return {"sharded": sc.sharded, "overlap_gather": sc.overlap_gather, "scatters": sc.scatters}

    def _protocol_buckets(self) -> int:
        return self.sim.scenario.buckets

    def _first_groups(self, members: list[int]) -> None:
        self.group = self.sim.group(0, members)

    @property
    def members(self) -> list[int]:
        return self.protocol.members

    @property
    def generation(self) -> int:
        return self.protocol.generation

    # -- points where a rank may die -------------------------------------------------
    def point(self, kind: str, step: int, index: int | None = None) -> Generator[None, None, None]:
        label: Label = (kind, step, index)
        n, self.points = self.points, self.points + 1
        self.last_label = label
        spec = self.sim.scenario.deaths.get(self.rank)
        if spec is not None and self.incarnation == 0 and _matches(spec, n, label):
            raise _Died(label)
        yield

    # -- the run -----------------------------------------------------------------------
    def main(self) -> Generator[None, None, None]:
        sc = self.sim.scenario
        if self.joining and not (yield from self.join()):
            return
        while self.protocol.next_step < sc.steps:
            s = self.protocol.next_step
            self.step = s
            try:
                yield from self.run(self.protocol.begin_step(s))
                yield from self.run(self.protocol.finish_gradients())
                if sc.sharded:  # the optimizer steps this rank's share: the parameters are stale
                    yield from self.point("update", s)
                    self.protocol.stale = True
                self.protocol.next_step = s + 1
                if sc.sharded and sc.eager_refresh:
                    yield from self.run(self.protocol.refresh(s + 1))
                if sc.sharded and sc.eager_refresh and sc.validate:
                    yield from self.run(self.protocol.before_validation(s + 1))
                    if self.protocol.stale or self.gather is not None:
                        raise ProtocolViolation(f"rank {self.rank} validates after step {s} with stale parameters")
            except E.Retired:  # asked to leave: out at a step boundary, exits 0
                self.store_effects.withdraw_leave_request()  # (as ElasticDataParallel.begin_step)
                self.sim.retired.append((s, self.rank))
                return
            except Excluded as exc:
                reason = "broken" if self.was_broken else "behind" if s < exc.record.step else "left out"
                self.was_broken = False
                self.sim.excluded.append((exc.record.generation, self.rank, reason))
                self.sim.excluded_at.append((self.sim.round, self.rank, s))
                self.in_recovery = False
                if not (yield from self.join()):
                    return
        try:  # (ElasticDataParallel.finish) the parameters gathered, then any member says training is over
            yield from self.run(self.protocol.refresh(self.protocol.next_step, last=True))
        except Excluded as exc:
            self.sim.excluded.append((exc.record.generation, self.rank, "left out at the end"))
            return
        self.store_effects.record_finished(self.protocol.next_step)

    def join(self) -> Generator[None, None, bool]:
        """Ask to join; wait for an admission (the protocol's join). False: training finished first."""
        self.joining, self.step = True, None
        step = yield from self.run(self.protocol.join(math.inf))
        self.joining = False
        return step is not None

    def run(self, effects: Generator[Any, Any, Any]) -> Generator[None, None, Any]:
        """Execute the effects of one protocol generator with the engine's own loop, yielding to the scheduler."""
        return (yield from execute(effects, self.handlers))

    # -- effects -------------------------------------------------------------------------
    def compute(self, e: E.Compute) -> Generator[None, None, list[int]]:
        if self.protocol.stale and e.micro_batches:
            raise ProtocolViolation(f"rank {self.rank} computes step {e.step} with stale parameters")
        try:
            yield from self._gathered()
        except _Failed:
            raise E.GatherFailed(f"rank {self.rank}: the gather before step {e.step} failed") from None
        total = [0] * self.sim.scenario.buckets
        for j in e.micro_batches:
            yield from self.point("redo" if e.redo else "micro", e.step, j)
            _add(total, gradient(e.step, j, self.sim.scenario.buckets))
        return total

    def reduce(self, e: E.Reduce) -> Generator[None, None, tuple]:
        if self.group is None:
            raise _Failed
        sc = self.sim.scenario
        seq = self.group.enter(self.rank, (e.step, e.bucket), e.local[e.bucket], e.offer)
        yield from self.point("sent", e.step, e.bucket)
        total, agreed = yield from self.group.wait(self.rank, seq, sc.partial if (not e.last or sc.partial_last) else 0.0)
        if e.last and agreed is None:
            raise ProtocolViolation(f"step {e.step}: the last bucket carried no leader's proposal")
        self.scattered[(e.step, e.bucket)] = tuple(self.protocol.members)  # (the layout it was scattered over)
        return total, (list(agreed) if e.last else None)

    def agree(self, e: E.AgreeMembers) -> Generator[None, None, list[int]]:
        if self.group is None:
            raise _Failed
        seq = self.group.enter(self.rank, ("sync", e.step), 0, e.offer)
        _, agreed = yield from self.group.wait(self.rank, seq)
        if agreed is None:
            raise ProtocolViolation(f"step {e.step}: the membership sync carried no leader's proposal")
        return list(agreed)

    def pause(self, e: E.Pause) -> None:
        self.in_recovery = e.paused

    def refresh(self, e: E.Refresh) -> Generator[None, None, None]:
        """(Sharded) the reshard and the parameters' gather: one collective of the group (with ``overlap``
        entered only: :meth:`_gathered` waits; a refresh that waits finishes one entered in the same group)."""
        if self.group is None:
            raise _Failed
        if self.gather is not None and not e.overlap and self.gather[0] is self.group:
            yield from self._gathered()
            return
        self.gather = None
        seq = self.group.enter(self.rank, ("refresh", e.step), 0)
        yield from self.point("refresh", e.step)
        if e.overlap:
            self.gather = (self.group, seq)
            return
        yield from self.group.wait(self.rank, seq, self.sim.scenario.partial)

    def _gathered(self) -> Generator[None, None, None]:
        """Wait for the collective of an overlapped refresh, if one is in flight (its group dropped: failed)."""
        if self.gather is None:
            return
        (group, seq), self.gather = self.gather, None
        if group is not self.group:
            raise _Failed
        yield from group.wait(self.rank, seq, self.sim.scenario.partial)

    def drop(self, e: E.DropGroup) -> Generator[None, None, None]:
        if self.group is not None:
            self.group.drop(self.rank)
        self.group = None
        for _ in range(self.sim.scenario.late.get(self.rank, 0)):
            yield

    def sleep(self, e: E.Sleep) -> Generator[None, None, None]:
        self.clock += 1
        yield

    def write_record(self, e: E.WriteRecord) -> MembershipRecord:
        stored = self.store_effects.membership.write_record(e.record)
        self.sim.written.setdefault(e.record.generation, self.sim.round)
        return stored

    def abandon(self, e: E.Abandon) -> None:
        """It never connects: members already building fail (gloo: after its timeout)."""
        self.sim.abandoned.append((e.record.generation, self.rank))
        self.sim.group(e.record.generation, list(e.record.members)).drop(self.rank)

    def build(self, e: E.BuildGroup) -> Generator[None, None, bool]:
        self.group = self.sim.group(e.record.generation, list(e.record.members))
        try:
            seq = self.group.enter(self.rank, ("form",), 0, build=True)
            yield from self.group.wait(self.rank, seq, build=True)
        except _Failed:
            self.group.drop(self.rank)
            self.group = None
            return False
        return True

    def formed(self, e: E.Formed) -> None:
        self.store_effects.formed(e.generation, list(e.members))

    def transfer(self, e: E.TransferState) -> Generator[None, None, int | None]:
        """The replica at ``root`` sends its state (here: its step) to the others."""
        if self.group is None:
            raise _Failed
        root = self.members[e.root]
        try:
            seq = self.group.enter(self.rank, ("state",), 0, self.protocol.next_step if self.rank == root else None)
            _, sent = yield from self.group.wait(self.rank, seq)
        except _Failed:
            if not e.apply:
                self.sim.resize_failures.append((self.protocol.synced_step, self.rank))
            raise
        return sent if e.apply else None  # the root's own step, which it sent

    def set_gradients(self, e: E.SetGradients) -> None:
        layouts = {self.scattered.get((e.step, k)) for k in range(len(e.reduced))}
        if self.sim.scenario.scatters and len(layouts) > 1:
            raise ProtocolViolation(f"rank {self.rank}, step {e.step}: buckets reduce-scattered over different "
                                    f"members {sorted(layouts, key=str)}")
        self.sim.reduced.setdefault(e.step, {})[self.rank] = tuple(e.reduced)

    def request_join(self, e: E.RequestJoin) -> None:
        self.store_effects.request_join(e)
        self.sim.join_requests.append((self.sim.round, self.rank))

    def admitted(self, e: E.Admitted) -> None:
        self.store_effects.admitted(e)
        self.sim.admitted.append((e.generation, self.rank))

    def fallback(self, e: E.Fallback) -> tuple[int, str]:
        """No replica is left: resume from step 0 (the engine: snapshot, checkpoint, else step 0)."""
        sim = self.sim
        published = self.store_effects.read_members(E.ReadMembers())  # (what the last group's primary published)
        last = published[1] if published is not None else self.members
        if any(not sim.ranks[r].joining for r in set(last) & set(sim.running)):  # (others train in a stale group)
            raise ProtocolViolation(f"rank {self.rank} found no replica while a member trains: {sim.describe()}")
        sim.fallbacks.append((sim.round, self.rank))
        self.protocol.next_step = 0
        return 0, "step0"

    def decided(self, e: E.Decided) -> None:
        sim = self.sim
        sim.polls.append(Poll(sim.round, self.rank, e.generation, e.previous, dict(e.checked_in), e.alive,
                              e.deadline_passed, frozenset(set(e.previous) - sim.dead), e.result))

    def followed(self, e: E.Followed) -> None:
        self.sim.adopted.setdefault(e.record.generation, {})[self.rank] = e.record

    def reassigned(self, e: E.Reassigned) -> None:
        self.sim.assignments.setdefault((e.step, e.generation), {})[self.rank] = {
            r: list(js) for r, js in e.assignment.items()}


class _ReplicaRank(_Rank):
    """One launch rank of a tensor x pipeline parallel replica: the protocol in replica space.

    Its store side is the real :class:`~unicron_elastic.strategy.engine.replicas.ReplicaMembership`;
    its groups, its model's lockstep computation and its liveness reads are
    those of :class:`~unicron_elastic.strategy.engine.elastic_dp.ElasticDataParallel`
    with ``TP x PP > 1`` (see the module's docstring).
    """

    def __init__(self, sim: Sim, rank: int, members: list[int], joining: bool, incarnation: int = 0) -> None:
        self.layout = sim.layout
        self.replica, self.shard = self.layout.replica(rank), self.layout.shard(rank)
        self.shard_group: FakeGroup | None = None  # this shard's data-parallel group of the generation held
        self.commit: FakeGroup | None = None  # every rank of the members (the commit, the membership sync)
        self.held: int | None = None  # the generation whose groups this rank holds
        self.commits: set[tuple[int, int]] = set()  # (epoch, step) whose commit it entered
        super().__init__(sim, rank, members, joining, incarnation)
        self.membership = self.store_effects.membership

    def _protocol_rank(self) -> int:
        return self.replica

    def _protocol_options(self) -> dict[str, bool]:  # (ElasticDataParallel with TP x PP > 1)
        return {"authority": self.shard == 0, "compute_needs_group": True}

    def _protocol_buckets(self) -> int:
        return self.sim.scenario.buckets + 1  # the commit is the last pseudo-bucket

    def _first_groups(self, members: list[int]) -> None:
        self._hold(0, members)

    def _hold(self, generation: int, members: list[int]) -> tuple[FakeGroup, FakeGroup]:
        layout, sim = self.layout, self.sim
        shard = sim.group(generation, [layout.rank(r, self.shard) for r in members], ("shard", self.shard))
        commit = sim.group(generation, [rank for r in members for rank in layout.ranks(r)], "commit")
        self.shard_group, self.commit, self.held = shard, commit, generation
        return shard, commit

    def _release(self) -> None:
        for group in (self.shard_group, self.commit):
            if group is not None:
                group.drop(self.rank)
        self.shard_group = self.commit = self.held = None

    @property
    def noted(self) -> dict[int, str]:
        """The incarnations of the members' ranks its group formed with (the engine's store effects noted them)."""
        return self.store_effects.incarnations

    # -- the model's computation: lockstep within the replica -----------------------------------
    def _peers_down(self) -> list[int]:
        sim = self.sim
        return [p for p in self.layout.ranks(self.replica)
                if p != self.rank and (p in sim.dead or sim.ranks[p].held != self.held)]

    def compute(self, e: E.Compute) -> Generator[None, None, list[int]]:
        sc, layout = self.sim.scenario, self.layout
        total = [0] * sc.buckets
        backward = set(range(layout.pipeline))
        record = self.membership.record
        if e.redo and layout.pipeline > 1 and record is not None and record.kept:
            backward = stages_to_backpropagate(layout, record.kept, [sc.buckets] * layout.size)
        if not backward or not e.micro_batches:  # (Computation._pipeline: nothing runs)
            return total
        if self.held is None:
            if layout.pipeline > 1:  # Computation._pipeline: not a peer failure, raised as is
                raise _ModelError(f"rank {self.rank}: the group failed before this stage's pipeline ran")
            self.sim.broken.append((self.sim.round, self.rank, e.step))
            self.was_broken = True
            raise ReplicaBroken(f"rank {self.rank}: its model's groups are gone")
        mine = layout.stage(self.rank) in backward
        if not mine:
            self.sim.forward_only.append((e.step, self.rank))
        computing = self.sim.computing.setdefault((self.replica, self.held), {})
        computing[self.rank] = e.step
        if len(set(computing.values())) > 1:  # (its shards hold different steps' states: they would never meet)
            raise ProtocolViolation(f"replica {self.replica} computes different steps {computing} "
                                    f"(generation {self.held})")
        try:
            return (yield from self._lockstep(e, total, mine))
        finally:
            computing.pop(self.rank, None)

    def _lockstep(self, e: E.Compute, total: list[int], mine: bool) -> Generator[None, None, list[int]]:
        sc, layout = self.sim.scenario, self.layout
        for position, j in enumerate(e.micro_batches):
            yield from self.point("redo" if e.redo else "micro", e.step, j)
            key = (self.replica, self.held, e.step, e.redo, position)
            entered = self.sim.lockstep.setdefault(key, {})
            entered[self.rank] = j
            while len(entered) < layout.size:
                down = self._peers_down()
                if down:
                    self.sim.broken.append((self.sim.round, self.rank, e.step))
                    self.was_broken = True
                    raise ReplicaBroken(f"rank {self.rank}: ranks {down} of replica {self.replica} are lost")
                yield
            if len(set(entered.values())) > 1:
                raise ProtocolViolation(f"replica {self.replica} computes different micro-batches {entered}")
            if mine:  # (a stage below every unreduced stage runs forward only: no gradients)
                _add(total, gradient(e.step, j, sc.buckets))
        return total

    # -- groups ------------------------------------------------------------------------------------
    def reduce(self, e: E.Reduce) -> Generator[None, None, tuple]:
        sc = self.sim.scenario
        commit = e.bucket == sc.buckets
        if e.last != commit:
            raise ProtocolViolation(f"step {e.step}: bucket {e.bucket} of {sc.buckets} + the commit is last={e.last}")
        group = self.commit if commit else self.shard_group
        if group is None:
            raise _Failed
        partial = sc.partial if (not commit or sc.partial_last) else 0.0
        if commit:
            seq = group.enter(self.rank, ("commit", e.step), 0, e.offer if self.shard == 0 else None)
            self.commits.add((self.sim.epoch, e.step))
        else:
            seq = group.enter(self.rank, (e.step, e.bucket), e.local[e.bucket])
        yield from self.point("sent", e.step, e.bucket)
        total, agreed = yield from group.wait(self.rank, seq, partial)
        if not commit:
            return total, None
        if agreed is None:
            raise ProtocolViolation(f"step {e.step}: the commit carried no leader's proposal")
        return 0, list(agreed)

    def agree(self, e: E.AgreeMembers) -> Generator[None, None, list[int]]:
        if self.commit is None:
            raise _Failed
        seq = self.commit.enter(self.rank, ("sync", e.step), 0, e.offer if self.shard == 0 else None)
        _, agreed = yield from self.commit.wait(self.rank, seq)
        if agreed is None:
            raise ProtocolViolation(f"step {e.step}: the membership sync carried no leader's proposal")
        return list(agreed)

    def drop(self, e: E.DropGroup) -> Generator[None, None, None]:
        self._release()
        for _ in range(self.sim.scenario.late.get(self.rank, 0)):
            yield

    def abandon(self, e: E.Abandon) -> None:
        self.sim.abandoned.append((e.record.generation, self.rank))
        layout, members = self.layout, e.record.members
        self.sim.group(e.record.generation, [layout.rank(r, self.shard) for r in members],
                       ("shard", self.shard)).drop(self.rank)
        self.sim.group(e.record.generation, [rank for r in members for rank in layout.ranks(r)],
                       "commit").drop(self.rank)

    def build(self, e: E.BuildGroup) -> Generator[None, None, bool]:
        self._release()
        groups = self._hold(e.record.generation, list(e.record.members))
        try:
            for group in groups:  # (GenerationGroups._build: the shard's group, then the commit's)
                seq = group.enter(self.rank, ("form",), 0, build=True)
                yield from group.wait(self.rank, seq, build=True)
        except _Failed:
            self._release()
            return False
        return True

    def formed(self, e: E.Formed) -> None:
        self.sim.formed.setdefault(e.generation, {})[self.rank] = self.sim.round
        self.sim.formed_at.setdefault(e.generation, self.sim.tick())
        super().formed(e)

    def transfer(self, e: E.TransferState) -> Generator[None, None, int | None]:
        """The same shard of the replica at ``root`` sends its state (here: its step) in the shard's group."""
        if self.shard_group is None:
            raise _Failed
        root = self.members[e.root]
        try:
            seq = self.shard_group.enter(self.rank, ("state",), 0, self.protocol.next_step if self.replica == root else None)
            _, sent = yield from self.shard_group.wait(self.rank, seq)
        except _Failed:
            if not e.apply:
                self.sim.resize_failures.append((self.protocol.synced_step, self.rank))
            raise
        return sent if e.apply else None

    def set_gradients(self, e: E.SetGradients) -> None:
        sim = self.sim
        sim.reduced.setdefault(e.step, {})[self.rank] = tuple(e.reduced[: sim.scenario.buckets])
        sim.completed.append((sim.round, sim.epoch, e.step, self.rank))

    def fallback(self, e: E.Fallback) -> tuple[int, str]:
        sim = self.sim
        if e.step is not None:  # another shard of this replica chose the step: this shard's state of it
            sim.fallbacks.append((sim.round, self.rank))
            return e.step, "snapshot" if e.step else "step0"
        published = self.store_effects.read_members(E.ReadMembers())  # (what the last group's primary published)
        last = published[1] if published is not None else self.members
        # (a whole replica trains in a stale group; a replica that lost a rank is lost, its other ranks
        # find out at their next collective)
        if any(all(p in sim.running and not sim.ranks[p].joining for p in self.layout.ranks(r)) for r in last):
            raise ProtocolViolation(f"rank {self.rank} found no replica while a member trains: {sim.describe()}")
        step = sim.snapshot_step()
        sim.fallbacks.append((sim.round, self.rank))
        sim.epoch += 1
        return step, "snapshot" if step else "step0"

    def decided(self, e: E.Decided) -> None:
        sim = self.sim
        def same(p: int) -> bool:  # alive, in the incarnation this rank's group formed with
            now = _incarnation(sim.ranks[p].incarnation)
            return p not in sim.dead and self.noted.get(p, now) == now

        whole = {r for r in e.previous if all(same(p) for p in self.layout.ranks(r))}
        sim.polls.append(Poll(sim.round, self.rank, e.generation, e.previous, dict(e.checked_in), e.alive,
                              e.deadline_passed, frozenset(whole), e.result))


class Sim:
    """Runs a :class:`Scenario`; what happened is left in its attributes for the tests."""

    def __init__(self, scenario: Scenario, max_rounds: int = 2_000) -> None:  # runs take < 400
        self.scenario, self.max_rounds = scenario, max_rounds
        self.rng = random.Random(scenario.seed)
        self.store = FakeStore()
        self.round = 0
        self.dead: set[int] = set()
        self.groups: dict[int, FakeGroup] = {}
        self.vanish: dict[int, int] = {}  # rank -> round its liveness key goes
        self.polls: list[Poll] = []
        self.adopted: dict[int, dict[int, MembershipRecord]] = {}  # generation -> rank -> record followed
        self.written: dict[int, int] = {}  # generation -> round its record was stored
        self.excluded: list[tuple[int, int, str]] = []  # (generation, rank, "behind" | "left out") while alive
        self.admitted: list[tuple[int, int]] = []  # (generation, rank) joiners admitted
        self.join_requests: list[tuple[int, int]] = []  # (round, rank)
        self.resize_failures: list[tuple[int, int]] = []  # (step, rank): a resize whose state transfer failed
        self.abandoned: list[tuple[int, int]] = []  # (generation, rank): a group that did not form
        self.fallbacks: list[tuple[int, int]] = []  # (round, rank): no replica left, resumed from step 0
        self.retired: list[tuple[int, int]] = []  # (step, rank): left the group at that step, as asked
        self.deaths: list[Death] = []
        self.reduced: dict[int, dict[int, tuple]] = {}  # step -> rank -> reduced gradient
        self.assignments: dict[tuple[int, int], dict[int, dict[int, list[int]]]] = {}
        self.outcome = "running"
        # tensor x pipeline parallel replicas (C > 1); with C = 1 the attributes below stay empty
        self.layout = ModelParallel(*scenario.model_parallel)
        self.replicated = self.layout.size > 1
        if scenario.restart_after is not None and not self.replicated:
            raise ValueError("restart_after needs model_parallel with TP x PP > 1")
        replicas = self.layout.replicas(scenario.world)
        self.max_replicas = replicas + (scenario.joiner_at is not None)
        self.lockstep: dict[tuple, dict[int, int]] = {}  # (replica, generation, step, redo, position) -> rank -> j
        self.forward_only: list[tuple[int, int]] = []  # (step, rank): a recomputation ran its stage forward only
        self.computing: dict[tuple[int, int], dict[int, int]] = {}  # (replica, generation) -> rank -> step it computes
        self.broken: list[tuple[int, int, int]] = []  # (round, rank, step): its computation failed (ReplicaBroken)
        self.excluded_at: list[tuple[int, int, int]] = []  # (round, rank, step) an Excluded ended
        self.formed: dict[int, dict[int, int]] = {}  # generation -> launch rank -> round it formed
        self.formed_at: dict[int, int] = {}  # generation -> tick its group first formed (a rank's Formed)
        self.collectives: list[tuple[int, int, Any, int]] = []  # (tick, generation, kind, seq): completed
        self._ticks = 0
        self.completed: list[tuple[int, int, int, int]] = []  # (round, epoch, step, rank): SetGradients
        self.losses: list[tuple[int, int, int, int, bool]] = []  # (round, rank, step, epoch, entered the commit)
        self.epoch = 0  # fallbacks so far (each restarts the steps)
        self.restarts: dict[int, int] = {}  # rank -> round it starts again
        self.restarted: list[tuple[int, int]] = []  # (round, rank)
        self.defunct: dict[int, int] = {}  # rank -> last generation its dead incarnation took part in
        kind = _ReplicaRank if self.replicated else _Rank
        members = list(range(replicas))
        if scenario.liveness:
            self.store.set(K.LIVENESS, "1")
        if scenario.unformed:  # the first group never formed: survivors restarted as joiners, the others gone
            self.dead |= set(scenario.unformed)
            self.ranks = {r: kind(self, r, members, joining=True) for r in range(scenario.world)
                          if r not in scenario.unformed}
        else:
            self.ranks = {r: kind(self, r, members, joining=False) for r in range(scenario.world)}
        self.running = {r: rank.main() for r, rank in self.ranks.items()}
        for r in self.ranks:
            self._set_live(r)
        for rank in self.ranks.values():
            if not rank.joining:  # (ElasticDataParallel.__init__: the first group formed)
                rank.store_effects.note_incarnations(rank.members)
        if not scenario.unformed:
            self.store.set(K.MEMBERS, json.dumps({"generation": 0, "members": members}))

    # -- what ranks read ---------------------------------------------------------------
    def group(self, generation: int, members: list[int], kind: Any = None) -> FakeGroup:
        """The group of ``generation`` (C > 1: of ``kind``, ``("shard", shard)`` or ``"commit"``)."""
        key = generation if kind is None else (generation, kind)
        if key not in self.groups:
            self.groups[key] = FakeGroup(self, generation, members, kind)
        g = self.groups[key]
        if g.members != list(members):
            raise ProtocolViolation(f"generation {generation} {kind or ''} built with {g.members} and {members}")
        return g

    def _set_live(self, rank: int) -> None:
        if self.scenario.liveness:
            self.store.set(K.live(rank), _incarnation(self.ranks[rank].incarnation))

    # -- the scheduler -----------------------------------------------------------------
    def _kill(self, rank: int, label: Label | None) -> None:
        r = self.ranks[rank]
        leader = bool(r.members) and r.members[0] == r.protocol.rank and not r.joining
        self.deaths.append(Death(rank, self.round, label, leader, r.in_recovery))
        self.dead.add(rank)
        self.running.pop(rank).close()
        self.vanish[rank] = self.round + self.scenario.liveness_delay
        if isinstance(r, _ReplicaRank):
            if r.step is not None:
                self.losses.append((self.round, rank, r.step, self.epoch, (self.epoch, r.step) in r.commits))
            if self.scenario.restart_after is not None:
                self.restarts[rank] = self.round + self.scenario.restart_after

    def _restart(self, rank: int) -> None:
        """(C > 1) its agent starts the killed rank again: a new incarnation, a joiner."""
        old = self.ranks[rank]
        self.defunct[rank] = max(self.defunct.get(rank, -1), old.generation)
        self.dead.discard(rank)
        self.vanish.pop(rank, None)
        self.ranks[rank] = _ReplicaRank(self, rank, [], joining=True, incarnation=old.incarnation + 1)
        self.running[rank] = self.ranks[rank].main()
        self._set_live(rank)
        self.restarted.append((self.round, rank))

    def _advance(self, rank: int) -> None:
        try:
            next(self.running[rank])
        except StopIteration:  # it exited: its agent deletes its liveness key
            del self.running[rank]
            self.store.delete_key(K.live(rank))
        except _Died as died:
            self._kill(rank, died.args[0])
            if rank in self.scenario.together:
                for other in sorted(self.scenario.together):
                    if other in self.running and not self.ranks[other].joining:
                        self._kill(other, None)

    def run(self) -> Sim:
        """Run to the end.

        Raises:
            SimStuck: No end within ``max_rounds``.
            ProtocolViolation: Members disagreed on a collective.
        """
        sc = self.scenario
        while self.running or self.restarts:
            self.round += 1
            if self.round > self.max_rounds:
                raise SimStuck(f"stuck after {self.max_rounds} rounds: {self.describe()}")
            for rank, when in list(self.vanish.items()):
                if when <= self.round:
                    self.store.delete_key(K.live(rank))
                    del self.vanish[rank]
            for rank, when in sc.leaving.items():
                if when == self.round and rank in self.running:
                    # Its node's agent asks it to leave: the counter first, as the agent's meeting point does.
                    self.store.add(K.JOIN_REQUESTS, 1)
                    self.store.set(K.leave(rank), "1")
            for rank, when in sorted(self.restarts.items()):
                if when <= self.round:
                    del self.restarts[rank]
                    self._restart(rank)
            if sc.joiner_at is not None and self.round == sc.joiner_at and sc.world not in self.ranks:
                kind = _ReplicaRank if self.replicated else _Rank
                for rank in range(sc.world, sc.world + self.layout.size):  # (C > 1: a whole replica)
                    self.ranks[rank] = kind(self, rank, [], joining=True)
                    self.running[rank] = self.ranks[rank].main()
                    self._set_live(rank)
            order = sorted(self.running)
            self.rng.shuffle(order)
            for rank in order:
                if rank in self.running and not (rank in sc.slow and self.rng.random() < 0.6):
                    self._advance(rank)
            if self.running and all(self.ranks[r].joining for r in self.running) and \
                    (not sc.liveness or self._no_whole_replica()):
                if self.store.check([K.FINISHED]):
                    continue  # they see it at their next turn
                # only joiners are left and nobody knows the members died (C > 1: or no replica can be whole again)
                self.outcome = "no_replica"
                return self
        self.outcome = "finished" if self.store.check([K.FINISHED]) else "all_dead"
        return self

    def tick(self) -> int:
        """An event counter (finer than rounds: orders what happens within one round)."""
        self._ticks += 1
        return self._ticks

    def snapshot_step(self) -> int:
        """(C > 1) The step the newest snapshot common to every shard resumes from: after the last step that
        every shard completed in this epoch (0: none)."""
        done: dict[int, set[int]] = {}
        for _, epoch, step, rank in self.completed:
            if epoch == self.epoch:
                done.setdefault(step, set()).add(self.layout.shard(rank))
        common = [step for step, shards in done.items() if len(shards) == self.layout.size]
        return max(common) + 1 if common else 0

    def _no_whole_replica(self) -> bool:
        """(C > 1) No replica can be whole again: each has a rank dead for good (no restart to come)."""
        sc = self.scenario
        if not self.replicated or self.restarts or (sc.joiner_at is not None and self.round < sc.joiner_at):
            return False  # (a rank restarts, or a new replica comes)
        replicas = {self.layout.replica(r) for r in self.ranks}
        return all(set(self.layout.ranks(r)) & self.dead for r in replicas)

    def describe(self) -> str:
        """Where every running rank is (for failure messages)."""
        where = {r: (self.ranks[r].last_label, "joining" if self.ranks[r].joining else self.ranks[r].generation)
                 for r in sorted(self.running)}
        return f"dead={sorted(self.dead)} running={where} records={ {g: r for g, r in self.records().items()} }"

    def records(self) -> dict[int, MembershipRecord]:
        """The stored record of each generation."""
        out = {}
        for key, value in self.store.data.items():
            if key.endswith("/record"):
                record = MembershipRecord.from_json(value)
                out[record.generation] = record
        return dict(sorted(out.items()))


def _failing_as_collectives(handler: Callable[[Any], Any]) -> Callable[[Any], Generator[None, None, Any]]:
    """``handler``, letting only a collective's failure reach the protocol.

    The effect loop throws any ``Exception`` a handler raises into the
    protocol, which takes a ``RuntimeError`` for a failed collective and
    recovers. In the fake a collective fails with :class:`_Failed`,
    :class:`~unicron_elastic.strategy.engine.effects.ReplicaBroken` or
    :class:`_ModelError`; any other exception (a bug in a store effect, or
    in the fake) is a :class:`ProtocolViolation`, which the protocol lets through.
    """
    def checked(effect: Any) -> Generator[None, None, Any]:
        try:
            result = handler(effect)
            if isinstance(result, Generator):
                result = yield from result
        except (_Failed, ReplicaBroken, E.GatherFailed, _ModelError, ProtocolViolation):
            raise
        except Exception as exc:
            raise ProtocolViolation(f"{type(effect).__name__}: a handler raised {exc!r}") from exc
        return result

    return checked


def _incarnation(n: int) -> str:
    """The value of a rank's liveness key in its ``n``-th incarnation."""
    return f"incarnation-{n}"


def _matches(spec: DeathSpec, n: int, label: Label) -> bool:
    if isinstance(spec, int):
        return n == spec
    return tuple(label[: len(spec)]) == tuple(spec)


def _add(local: list[int], grad: tuple[int, ...]) -> None:
    for k, v in enumerate(grad):
        local[k] += v
