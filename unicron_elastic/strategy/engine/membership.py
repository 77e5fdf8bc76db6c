"""Who is in the data-parallel group: pure decisions, no I/O.

After a collective of generation ``N`` fails, every survivor drops the old
group (closing its connections, so peers blocked on it fail too), checks in for
generation ``N + 1`` with its step and the number of gradient buckets of that
step it completed (:class:`CheckIn`), and polls. Each poll evaluates :func:`decide_record` on what the store shows; the
first rank that gets a record writes it *create-only*, so exactly one record
exists per generation and every survivor follows it:

* a previous member is waited for until it has checked in or is known dead
  (its liveness key is gone: the agent deletes it when the process exits, the
  node's etcd lease when the node is lost) - no "n - 1" guess, no fixed wait;
* the deadline (``checkin_timeout``) bounds the wait for a rank that is alive
  but stuck; it is then left out and comes back as a joiner (:func:`role`);
* the members are the ranks at the newest step: when the *last* bucket's
  all-reduce completed on some survivors and failed on others, the first ones
  stepped their optimizer and fail in the next step; the others are *behind*
  (their step's result exists, but not in them) and come back as joiners, with
  the state of a replica;
* a rank whose own computation failed (a collective of its model: a tensor- or
  pipeline-parallel peer of its replica was lost) checks in *broken*: it is
  not waited for and not a member (its replica cannot finish the step) and
  rejoins; when only broken ranks are left the record *dissolves* the group
  (no members): everyone rejoins and, with no replica left, the lowest resumes
  from the snapshot or checkpoint.

With tensor/pipeline parallelism the "ranks" here are data-parallel
*replicas* (:mod:`~unicron_elastic.strategy.engine.replicas`): a replica checked in
when every rank of it did, and a record keeps, per shard of the model
(a tensor x pipeline shard), the buckets that shard's group reduced
(:attr:`MembershipRecord.kept`).

A resize between steps (joiners admitted, a member schedule's members) is a record
too: the primary writes it create-only for the next generation
(:func:`resize_record`), so a failure that a rank is still recovering from and
a resize can never both start the same generation.

Between steps the primary proposes the next step's members with
:func:`proposal` (a member schedule given by hand, else the current members plus
ranks waiting to join), agreed collectively by the engine.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from unicron_elastic.api import UnicronError


class MembershipError(UnicronError, ValueError):
    """A membership record is malformed."""


@dataclass(frozen=True)
class CheckIn:
    """What a survivor reports for a new generation.

    Attributes:
        step: The optimizer step it is in.
        done: Gradient buckets of ``step`` it completed (reduced) before the failure.
        broken: Its own computation of ``step`` failed (its model's collectives:
            a peer of its replica is lost); its sums are incomplete.
    """

    step: int
    done: int
    broken: bool = False

    def __post_init__(self) -> None:
        if not (_whole(self.step) and _whole(self.done)) or self.step < 0 or self.done < 0:
            raise MembershipError(f"step and done must be whole numbers >= 0: {self!r}")
        if not isinstance(self.broken, bool):
            raise MembershipError(f"broken must be a boolean: {self!r}")

    def to_json(self) -> str:
        """The check-in as stored."""
        doc = {"step": self.step, "done": self.done}
        if self.broken:
            doc["broken"] = True
        return json.dumps(doc)

    @classmethod
    def from_json(cls, text: str | bytes) -> CheckIn:
        """Parse a stored check-in.

        Raises:
            MembershipError: Not a valid check-in.
        """
        try:
            raw = json.loads(text)
            return cls(raw["step"], raw["done"], raw.get("broken", False))
        except MembershipError:
            raise
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            raise MembershipError(f"malformed check-in {text[:200]!r}: {exc}") from exc


@dataclass(frozen=True)
class MembershipRecord:
    """The members of one generation, written once.

    Attributes:
        generation: The generation this record starts.
        members: Sorted, distinct ranks; empty only when the group *dissolved*
            (every previous member is dead or broken: all of them rejoin).
        kept_buckets: Gradient buckets of ``step`` every member completed before the failure.
        dead: Previous members left out: dead, broken, not checked in by the
            deadline, or behind (checked in from an earlier step). Sorted, distinct.
        step: The step the members are in (a rank in another step is not a member).
        resize: Written by the primary between steps (:func:`resize_record`):
            the step's micro-batches are dealt over these members afresh.
        kept: With tensor/pipeline parallelism, the buckets kept per
            shard of the model (each shard's group has its own buckets);
            empty otherwise. :meth:`for_shard` gives one shard's view.
    """

    generation: int
    members: tuple[int, ...]
    kept_buckets: int
    dead: tuple[int, ...] = ()
    step: int = 0
    resize: bool = False
    kept: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if list(self.members) != sorted(set(self.members)) or not (self.members or self.dead):
            raise MembershipError(f"members {self.members!r} must be sorted and distinct, and not empty unless "
                                  f"the group dissolved (dead members)")
        if list(self.dead) != sorted(set(self.dead)):
            raise MembershipError(f"dead {self.dead!r} must be sorted and distinct")
        values = (self.generation, self.kept_buckets, self.step, *self.members, *self.dead, *self.kept)
        if any(not _whole(v) or v < 0 for v in values) or not isinstance(self.resize, bool):
            raise MembershipError(f"generation, buckets and ranks must be whole numbers >= 0: {self!r}")
        if set(self.dead) & set(self.members):
            raise MembershipError(f"ranks {sorted(set(self.dead) & set(self.members))} are both dead and members")

    @property
    def dissolved(self) -> bool:
        """No member is left: every previous member was dead or broken."""
        return not self.members

    @property
    def primary(self) -> int:
        """The lowest member: it publishes the group and sends the state to joiners.

        Raises:
            MembershipError: The group dissolved (no member).
        """
        if not self.members:
            raise MembershipError(f"generation {self.generation} dissolved the group: it has no primary")
        return self.members[0]

    def for_shard(self, shard: int) -> MembershipRecord:
        """This record as one shard's group sees it: ``kept_buckets`` is that shard's (and no ``kept``:
        the view equals the record that shard's protocol decided or proposed).

        Raises:
            MembershipError: The record keeps buckets per shard and has none for ``shard``.
        """
        if not self.kept:
            return self
        if not 0 <= shard < len(self.kept):
            raise MembershipError(f"record {self.generation} keeps buckets for {len(self.kept)} shards, "
                                  f"not for shard {shard}")
        return replace(self, kept_buckets=self.kept[shard], kept=())

    def to_json(self) -> str:
        """The record as stored."""
        doc = {"generation": self.generation, "members": list(self.members), "kept_buckets": self.kept_buckets,
               "dead": list(self.dead), "step": self.step, "resize": self.resize}
        if self.kept:
            doc["kept"] = list(self.kept)
        return json.dumps(doc)

    @classmethod
    def from_json(cls, text: str | bytes) -> MembershipRecord:
        """Parse a stored record.

        Raises:
            MembershipError: Not a valid record.
        """
        try:
            raw = json.loads(text)
            return cls(int(raw["generation"]) if _whole(raw["generation"]) else raw["generation"],
                       tuple(raw["members"]), raw["kept_buckets"], tuple(raw.get("dead", ())), raw.get("step", 0),
                       raw.get("resize", False), tuple(raw.get("kept", ())))
        except MembershipError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:  # RecursionError: deep nesting
            raise MembershipError(f"malformed membership record {text[:200]!r}: {exc}") from exc


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def decide_record(generation: int, previous: Sequence[int], checked_in: Mapping[int, CheckIn],
                  alive: Collection[int] | None, deadline_passed: bool) -> MembershipRecord | None:
    """The record of ``generation`` if it can be decided now, else None (keep waiting).

    Args:
        generation: The new generation.
        previous: Members of the generation that failed.
        checked_in: Rank -> its check-in, for the ranks that checked in
            (ranks that are not previous members are ignored).
        alive: Ranks whose liveness is known (their key exists); None when no
            liveness is kept (then only the deadline ends the wait for a rank
            that never checks in).
        deadline_passed: The check-in deadline has passed.

    Returns:
        The record: every previous member checked in or is known dead (or the
        deadline passed); members are the live ranks that checked in, not
        broken, from the newest step among them (the others are behind: left
        out, they rejoin). When no member is left (every previous member is
        dead or broken: with tensor/pipeline parallelism a replica is dead
        when one rank of it is), the record dissolves the group (no members;
        everyone rejoins). None while a live previous member has not checked
        in (with liveness keys, after the deadline too when nobody else
        could be a member).
    """
    def live(rank: int) -> bool:
        return alive is None or rank in alive

    waiting_for = [r for r in previous if r not in checked_in and live(r)]
    if waiting_for and not deadline_passed:
        return None
    candidates = [r for r in set(previous) if r in checked_in and live(r) and not checked_in[r].broken]
    if not candidates:
        if waiting_for and alive is not None:
            # Nobody can go on without them: a stuck one is the hang detector's to find. Without liveness keys
            # the deadline ends the wait.
            return None
        step = max((checked_in[r].step for r in previous if r in checked_in), default=0)
        return MembershipRecord(generation, (), 0, tuple(sorted(set(previous))), step)  # every member dead/broken
    step = max(checked_in[r].step for r in candidates)
    members = tuple(sorted(r for r in candidates if checked_in[r].step == step))
    dead = tuple(sorted(r for r in set(previous) if r not in members))
    return MembershipRecord(generation, members, min(checked_in[r].done for r in members), dead, step)


def resize_record(generation: int, previous: Sequence[int], wanted: Sequence[int], step: int) -> MembershipRecord:
    """The record the primary writes to change the members between steps (nothing reduced yet).

    Raises:
        MembershipError: ``wanted`` is empty or not distinct.
    """
    members = tuple(sorted(wanted))
    if len(set(members)) != len(members):
        raise MembershipError(f"wanted members {list(wanted)} are not distinct")
    return MembershipRecord(generation, members, 0, tuple(sorted(set(previous) - set(members))), step, resize=True)


def formation(record: MembershipRecord, checked_in: Mapping[int, CheckIn], alive: Collection[int] | None,
              deadline_passed: bool) -> str:
    """Whether the group of ``record`` can be built now (before any connection is made).

    Every member checks in for the record's generation first (a joiner
    admitted by it too): building a gloo group with a member that never
    arrives would block for the whole collective timeout.

    Args:
        record: The record whose group forms.
        checked_in: Rank -> check-in for ``record.generation``.
        alive: Ranks whose liveness key exists (None: not kept).
        deadline_passed: The formation deadline has passed.

    Returns:
        ``"build"`` when every member checked in from the record's step;
        ``"abandon"`` when one will not come (it checked in from another
        step: it is behind and rejoins; it checked in broken; it is known
        dead; or the deadline passed): the members then regroup under the next generation;
        ``"wait"`` otherwise.
    """
    missing = []
    for rank in record.members:
        checkin = checked_in.get(rank)
        if checkin is not None and (checkin.step != record.step or checkin.broken):
            return "abandon"
        if checkin is None:
            if alive is not None and rank not in alive:
                return "abandon"
            missing.append(rank)
    if not missing:
        return "build"
    return "abandon" if deadline_passed else "wait"


def role(record: MembershipRecord, rank: int, step: int | None = None) -> str:
    """What ``rank``, in ``step``, is under ``record``.

    Returns:
        ``"member"`` if ``rank`` is a member and (when given) ``step`` is the
        record's step, else ``"joiner"``: left out, or behind the members'
        step, it must rejoin with a replica's state.
    """
    if rank in record.members and (step is None or step == record.step):
        return "member"
    return "joiner"


def proposal(step: int, members: Sequence[int], member_schedule: Mapping[int, Sequence[int]],
             waiting: Collection[int], leaving: Collection[int] = ()) -> list[int]:
    """The primary's members for ``step``.

    Args:
        step: The step the members are for.
        members: The current members.
        member_schedule: ``step -> members`` from that step on (given by hand);
            when given, it alone decides.
        waiting: Ranks asking to join.
        leaving: Ranks asked to leave (their node leaves the task by the
            coordinator's plan). Ignored when none of the members would stay:
            a replica must hold the state.

    Returns:
        The member schedule's members for ``step``; without one the current
        members less the leaving ones (order kept), then the waiting ranks
        not yet members and not leaving (sorted).
    """
    if member_schedule:
        return list(member_schedule.get(step, members))
    gone = set(leaving)
    wanted = [r for r in members if r not in gone] or list(members)
    return wanted + [r for r in sorted(set(waiting) - gone) if r not in wanted]
