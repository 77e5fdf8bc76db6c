"""An in-process fake of the data-parallel recovery protocol (tests only).

It plays what :mod:`unicron_elastic.strategy.elastic_dp` does with real gloo
groups and a c10d store, with the pure decisions it uses
(:func:`~unicron_elastic.strategy.membership.decide_record`,
:func:`~unicron_elastic.strategy.membership.role`,
:func:`~unicron_elastic.strategy.membership.proposal`,
:func:`~unicron_elastic.strategy.microbatch.deal`,
:func:`~unicron_elastic.strategy.microbatch.redistribute`) and nothing else
of the engine:

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
generation and the joiners wait for the next admission.
"""

from __future__ import annotations

import json
import random
from collections.abc import Generator, Mapping
from dataclasses import dataclass, field
from typing import Any

from unicron_elastic.store.keys import MeetingKeys as K
from unicron_elastic.strategy.membership import (
    CheckIn,
    MembershipRecord,
    decide_record,
    formation,
    proposal,
    resize_record,
    role,
)
from unicron_elastic.strategy.microbatch import deal, redistribute

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


class _Died(Exception):
    pass


class _Failed(Exception):
    """A collective failed on this rank (gloo's RuntimeError)."""


class _Excluded(Exception):
    """The record left this live rank out: it becomes a joiner."""


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
        partial: Chance that a rank whose neighbour is down fails a bucket that
            completed (the others got it): only some members complete it.
        partial_last: ``partial`` applies to the last bucket too.
        seed: The interleaving.
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
    partial: float = 0.0
    partial_last: bool = False
    seed: int = 0


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

    def __init__(self, sim: Sim, generation: int, members: list[int]) -> None:
        self.sim, self.generation, self.members = sim, generation, list(members)
        self.dropped: set[int] = set()
        self.ops: dict[int, _Op] = {}
        self.seq = dict.fromkeys(members, 0)

    def drop(self, rank: int) -> None:
        """``rank`` destroyed its group object: its connections close."""
        self.dropped.add(rank)

    def _down(self) -> set[int]:
        return (self.sim.dead | self.dropped) & set(self.members)

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
                raise ProtocolViolation(f"generation {self.generation} collective {seq}: members disagree "
                                        f"{ {r: e[0] for r, e in op.entered.items()} }")
            if len(payloads) > 1:
                raise ProtocolViolation(f"generation {self.generation} collective {seq}: two leaders {payloads}")
            op.result = (sum(entry[1] for entry in op.entered.values()), payloads[0] if payloads else None)
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


class _Rank:
    """One worker: the engine's step loop, recovery and join, over the fakes."""

    def __init__(self, sim: Sim, rank: int, members: list[int], joining: bool) -> None:
        self.sim, self.rank = sim, rank
        self.members = list(members)
        self.generation = 0
        self.group: FakeGroup | None = None if joining else sim.group(0, self.members)
        self.next_step = 0
        self.points = 0
        self.joining = joining
        self.in_recovery = False
        self.agreed: tuple[int, list[int]] | None = None
        self.deal_base: tuple[int, list[int], list[int]] | None = None
        self.last_label: Label | None = None

    # -- points where a rank may die -------------------------------------------------
    def point(self, kind: str, step: int, index: int | None = None) -> Generator[None, None, None]:
        label: Label = (kind, step, index)
        n, self.points = self.points, self.points + 1
        self.last_label = label
        spec = self.sim.scenario.deaths.get(self.rank)
        if spec is not None and _matches(spec, n, label):
            raise _Died(label)
        yield

    # -- the run -----------------------------------------------------------------------
    def main(self) -> Generator[None, None, None]:
        sc = self.sim.scenario
        if self.joining and not (yield from self.join()):
            return
        while self.next_step < sc.steps:
            try:
                yield from self.train_step(self.next_step)
            except _Excluded:
                if not (yield from self.join()):
                    return
        self.sim.store.set(K.FINISHED, str(self.next_step))  # any member (ElasticDataParallel.finish)

    def assignment(self, s: int) -> dict[int, list[int]]:
        """``ElasticDataParallel._assignment``: dealt over the step's base, the ranks lost since redistributed."""
        base, dead = self.members, []
        if self.deal_base is not None and self.deal_base[0] == s:
            _, base, dead = self.deal_base
        dealt = deal(self.sim.scenario.micro_batches, list(base))
        moved = redistribute(dealt, dead) if dead else {}
        return {r: dealt.get(r, []) + moved.get(r, []) for r in self.members}

    def train_step(self, s: int) -> Generator[None, None, None]:
        sc = self.sim.scenario
        if self.agreed is not None and self.agreed[0] == s and self.agreed[1] != self.members:
            wanted, self.agreed = self.agreed[1], None
            yield from self.resize(wanted, s)
        self.agreed = None
        yield from self.point("step", s)
        assignment = self.assignment(s)
        local = [0] * sc.buckets
        for j in assignment[self.rank]:
            yield from self.point("micro", s, j)
            _add(local, gradient(s, j, sc.buckets))
        reduced: list[int | None] = [None] * sc.buckets
        done = 0
        while True:
            try:
                for k in range(done, sc.buckets):
                    yield from self.point("bucket", s, k)
                    last = k == sc.buckets - 1
                    offer = None
                    if last and self.rank == self.members[0]:
                        offer = proposal(s + 1, self.members, {}, self.sim.waiting())
                    seq = self.group.enter(self.rank, (s, k), local[k], offer)
                    yield from self.point("sent", s, k)
                    total, agreed = yield from self.group.wait(
                        self.rank, seq, sc.partial if (not last or sc.partial_last) else 0.0)
                    reduced[k], done = total, k + 1
                    if last:
                        self.agreed = (s + 1, list(agreed))
                break
            except _Failed:
                base, dead, done = yield from self.reform(s, done)
                if base is not None:  # the leader's resize record: the step starts over, dealt afresh
                    self.deal_base = (s, base, dead)
                    assignment = self.assignment(s)
                    local = [0] * sc.buckets
                    for j in assignment[self.rank]:
                        yield from self.point("redo", s, j)
                        _add(local, gradient(s, j, sc.buckets))
                else:
                    moved = redistribute(assignment, dead)
                    assignment = {r: assignment[r] + moved[r] for r in self.members}
                    for j in moved.get(self.rank, []):
                        yield from self.point("redo", s, j)
                        _add(local, gradient(s, j, sc.buckets))
                self.sim.assignments.setdefault((s, self.generation), {})[self.rank] = {
                    r: sorted(js) for r, js in assignment.items()}
        self.sim.reduced.setdefault(s, {})[self.rank] = tuple(reduced)
        self.next_step = s + 1

    def checkins(self, g: int, ranks: list[int] | tuple[int, ...]) -> dict[int, CheckIn]:
        store = self.sim.store
        return {r: CheckIn.from_json(store.get(K.checkin(g, r))) for r in ranks if store.check([K.checkin(g, r)])}

    def form(self, record: MembershipRecord, s: int) -> Generator[None, None, bool]:
        """Wait until every member checked in, then build the group (``ElasticDataParallel._form``); False: not formed."""
        sim, sc = self.sim, self.sim.scenario
        polls, verdict = 0, "wait"
        while verdict == "wait":
            yield from self.point("form", s, record.generation)
            verdict = formation(record, self.checkins(record.generation, record.members),
                                sim.alive_among(list(record.members)), sc.deadline is not None and polls >= sc.deadline)
            polls += 1
        if verdict == "abandon":  # it never connects: members already building fail (gloo: after its timeout)
            sim.abandoned.append((record.generation, self.rank))
            sim.group(record.generation, list(record.members)).drop(self.rank)
            return False
        self.group = sim.group(record.generation, self.members)
        try:
            seq = self.group.enter(self.rank, ("form",), 0, build=True)
            yield from self.group.wait(self.rank, seq, build=True)
        except _Failed:
            self.group.drop(self.rank)
            self.group = None
            return False
        return True

    def reform(self, s: int, done: int) -> Generator[None, None, tuple[list[int] | None, list[int], int]]:
        """Drop the group, follow the next generation's record, build its group (``ElasticDataParallel._regroup``)."""
        sim, sc, store = self.sim, self.sim.scenario, self.sim.store
        self.in_recovery = True
        if self.group is not None:
            self.group.drop(self.rank)
        self.group = None
        for _ in range(sc.late.get(self.rank, 0)):
            yield
        base: list[int] | None = None
        dead: list[int] = []
        while True:
            self.generation += 1
            g = self.generation
            yield from self.point("checkin", s, g)
            store.set(K.checkin(g, self.rank), CheckIn(s, done).to_json())
            polls = 0
            while True:
                yield from self.point("poll", s, g)
                if store.check([K.record(g)]):
                    record = MembershipRecord.from_json(store.get(K.record(g)))
                    break
                checked = self.checkins(g, self.members)
                alive = sim.alive_among(self.members)
                if alive is not None:
                    alive -= set(sim.waiting())
                passed = sc.deadline is not None and polls >= sc.deadline
                polls += 1
                record = decide_record(g, self.members, checked, alive, passed)
                sim.polls.append(Poll(sim.round, self.rank, g, tuple(self.members), checked,
                                      None if alive is None else frozenset(alive), passed,
                                      frozenset(set(self.members) - sim.dead), record))
                if record is not None:  # create-only: everyone follows what is stored
                    yield from self.point("decided", s, g)  # another rank may decide (otherwise) meanwhile
                    stored = store.compare_set(K.record(g), "", record.to_json())
                    sim.written.setdefault(g, sim.round)
                    record = MembershipRecord.from_json(stored)
                    break
            sim.adopted.setdefault(g, {})[self.rank] = record
            if role(record, self.rank, s) == "joiner":
                sim.excluded.append((g, self.rank, "behind" if s < record.step else "left out"))
                self.in_recovery = False
                raise _Excluded
            if record.resize:
                base, dead = list(record.members), []
            dead += [r for r in record.dead if r not in dead]
            self.members, done = list(record.members), record.kept_buckets
            if (yield from self.form(record, s)):
                break
        if self.rank == self.members[0]:
            store.set(K.MEMBERS, json.dumps({"generation": self.generation, "members": self.members}))
        self.in_recovery = False
        return base, dead, done

    def resize(self, wanted: list[int], s: int) -> Generator[None, None, None]:
        """Between steps: the leader's resize record, followed by all (``ElasticDataParallel._resize``)."""
        store = self.sim.store
        previous = list(self.members)
        assert set(previous) <= set(wanted), "the fake has no schedule: members only grow between steps"
        g = self.generation + 1
        if self.rank == previous[0] and not self.checkins(g, previous):
            proposed = resize_record(g, previous, wanted, s)
            if MembershipRecord.from_json(store.compare_set(K.record(g), "", proposed.to_json())) == proposed:
                store.set(K.LATEST, json.dumps({"generation": g, "members": list(proposed.members), "step": s,
                                                "leader": previous[0]}))
        base, dead = previous, []
        while True:
            new_base, lost, _ = yield from self.reform(s, 0)
            if new_base is not None:
                base, dead = new_base, []
            dead += lost
            self.deal_base = (s, base, dead)
            if new_base is None:
                return
            root = min(set(previous) & set(self.members))
            try:  # the replica sends the state (here: the step) to the newcomers
                seq = self.group.enter(self.rank, ("state",), 0, s if self.rank == root else None)
                yield from self.group.wait(self.rank, seq)
                return
            except _Failed:
                self.sim.resize_failures.append((s, self.rank))

    def enter(self, latest: dict) -> Generator[None, None, bool]:
        """(A joiner) check in, form the announced group, receive the state (``ElasticDataParallel._enter``)."""
        store = self.sim.store
        g = latest["generation"]
        record = MembershipRecord.from_json(store.get(K.record(g))) if store.check([K.record(g)]) else None
        if record is None or self.rank not in record.members:
            return False
        store.set(K.checkin(g, self.rank), CheckIn(record.step, 0).to_json())
        self.generation, self.members = g, list(record.members)
        if not (yield from self.form(record, record.step)):
            return False
        try:
            seq = self.group.enter(self.rank, ("state",), 0)
            _, sent = yield from self.group.wait(self.rank, seq)
        except _Failed:
            self.group.drop(self.rank)
            self.group = None
            return False
        self.next_step = sent
        return True

    def join(self) -> Generator[None, None, bool]:
        """Ask to join; wait for an admission (``ElasticDataParallel.join``). False: training finished first."""
        store = self.sim.store
        self.joining = True
        floor = json.loads(store.get(K.MEMBERS))["generation"] if store.check([K.MEMBERS]) else -1
        store.set(K.join(self.rank), "1")
        self.sim.join_requests.append((self.sim.round, self.rank))
        while True:
            if store.check([K.FINISHED]):
                self.joining = False
                return False
            if store.check([K.LATEST]):
                latest = json.loads(store.get(K.LATEST))
                if self.rank in latest["members"] and latest["generation"] > max(floor, self.generation):
                    if (yield from self.enter(latest)):
                        self.sim.admitted.append((latest["generation"], self.rank))
                        store.delete_key(K.join(self.rank))
                        self.joining = False
                        return True
                    floor = max(floor, latest["generation"])  # that group did not form: wait for the next one
            yield


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
        self.deaths: list[Death] = []
        self.reduced: dict[int, dict[int, tuple]] = {}  # step -> rank -> reduced gradient
        self.assignments: dict[tuple[int, int], dict[int, dict[int, list[int]]]] = {}
        self.outcome = "running"
        members = list(range(scenario.world))
        if scenario.liveness:
            self.store.set(K.LIVENESS, "1")
        self.ranks = {r: _Rank(self, r, members, joining=False) for r in members}
        self.running = {r: rank.main() for r, rank in self.ranks.items()}
        for r in members:
            self._set_live(r)
        self.store.set(K.MEMBERS, json.dumps({"generation": 0, "members": members}))

    # -- what ranks read ---------------------------------------------------------------
    def group(self, generation: int, members: list[int]) -> FakeGroup:
        g = self.groups.setdefault(generation, FakeGroup(self, generation, members))
        if g.members != list(members):
            raise ProtocolViolation(f"generation {generation} built with {g.members} and {members}")
        return g

    def alive_among(self, ranks: list[int]) -> set[int] | None:
        if not self.store.check([K.LIVENESS]):
            return None
        return {r for r in ranks if self.store.check([K.live(r)])}

    def waiting(self) -> list[int]:
        return [r for r in self.ranks if self.store.check([K.join(r)])]

    def _set_live(self, rank: int) -> None:
        if self.scenario.liveness:
            self.store.set(K.live(rank), "incarnation-0")

    # -- the scheduler -----------------------------------------------------------------
    def _kill(self, rank: int, label: Label | None) -> None:
        r = self.ranks[rank]
        leader = bool(r.members) and r.members[0] == rank and not r.joining
        self.deaths.append(Death(rank, self.round, label, leader, r.in_recovery))
        self.dead.add(rank)
        self.running.pop(rank).close()
        self.vanish[rank] = self.round + self.scenario.liveness_delay

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
        while self.running:
            self.round += 1
            if self.round > self.max_rounds:
                raise SimStuck(f"stuck after {self.max_rounds} rounds: {self.describe()}")
            for rank, when in list(self.vanish.items()):
                if when <= self.round:
                    self.store.delete_key(K.live(rank))
                    del self.vanish[rank]
            if sc.joiner_at is not None and self.round == sc.joiner_at and sc.world not in self.ranks:
                self.ranks[sc.world] = _Rank(self, sc.world, [], joining=True)
                self.running[sc.world] = self.ranks[sc.world].main()
                self._set_live(sc.world)
            order = sorted(self.running)
            self.rng.shuffle(order)
            for rank in order:
                if rank in self.running and not (rank in sc.slow and self.rng.random() < 0.6):
                    self._advance(rank)
            if self.running and all(self.ranks[r].joining for r in self.running):
                if self.store.check([K.FINISHED]):
                    continue  # they see it at their next turn
                self.outcome = "no_replica"  # only joiners are left: nobody holds the state
                return self
        self.outcome = "finished"
        return self

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


def _matches(spec: DeathSpec, n: int, label: Label) -> bool:
    if isinstance(spec, int):
        return n == spec
    return tuple(label[: len(spec)]) == tuple(spec)


def _add(local: list[int], grad: tuple[int, ...]) -> None:
    for k, v in enumerate(grad):
        local[k] += v
