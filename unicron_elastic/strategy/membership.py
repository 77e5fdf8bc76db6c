"""Who is in the data-parallel group: pure decisions, no I/O (issue 10).

After a collective of generation ``N`` fails, every survivor drops the old
group (closing its connections, so peers blocked on it fail too), checks in for
generation ``N + 1`` with the number of gradient buckets it completed, and
polls. Each poll evaluates :func:`decide_record` on what the store shows; the
first rank that gets a record writes it *create-only*, so exactly one record
exists per generation and every survivor follows it:

* a previous member is waited for until it has checked in or is known dead
  (its liveness key is gone: the agent deletes it when the process exits, the
  node's etcd lease when the node is lost) - no "n - 1" guess, no fixed wait;
* the deadline (``checkin_timeout``) bounds the wait for a rank that is alive
  but stuck; it is then left out and comes back as a joiner (:func:`role`).

Between steps the leader proposes the next step's members with
:func:`proposal` (the coordinator's schedule, else the current members plus
ranks waiting to join), agreed collectively by the engine.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from unicron_elastic.api import UnicronError


class MembershipError(UnicronError, ValueError):
    """A membership record is malformed."""


@dataclass(frozen=True)
class MembershipRecord:
    """The members of one generation, written once.

    Attributes:
        generation: The generation this record starts.
        members: Sorted, distinct ranks; not empty.
        kept_buckets: Gradient buckets every member completed before the failure.
        dead: Previous members left out (dead, or not checked in by the deadline).
    """

    generation: int
    members: tuple[int, ...]
    kept_buckets: int
    dead: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.members or list(self.members) != sorted(set(self.members)):
            raise MembershipError(f"members {self.members!r} must be sorted, distinct and not empty")
        if any(not _whole(v) or v < 0 for v in (self.generation, self.kept_buckets, *self.members, *self.dead)):
            raise MembershipError(f"generation, buckets and ranks must be whole numbers >= 0: {self!r}")
        if set(self.dead) & set(self.members):
            raise MembershipError(f"ranks {sorted(set(self.dead) & set(self.members))} are both dead and members")

    @property
    def leader(self) -> int:
        """The lowest member: it publishes the group and sends the state to joiners."""
        return self.members[0]

    def to_json(self) -> str:
        """The record as stored."""
        return json.dumps({"generation": self.generation, "members": list(self.members),
                           "kept_buckets": self.kept_buckets, "dead": list(self.dead)})

    @classmethod
    def from_json(cls, text: str | bytes) -> MembershipRecord:
        """Parse a stored record.

        Raises:
            MembershipError: Not a valid record.
        """
        try:
            raw = json.loads(text)
            return cls(int(raw["generation"]) if _whole(raw["generation"]) else raw["generation"],
                       tuple(raw["members"]), raw["kept_buckets"], tuple(raw.get("dead", ())))
        except MembershipError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:  # RecursionError: deep nesting
            raise MembershipError(f"malformed membership record {text[:200]!r}: {exc}") from exc


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def decide_record(generation: int, previous: Sequence[int], checked_in: Mapping[int, int],
                  alive: Collection[int] | None, deadline_passed: bool) -> MembershipRecord | None:
    """The record of ``generation`` if it can be decided now, else None (keep waiting).

    Args:
        generation: The new generation.
        previous: Members of the generation that failed.
        checked_in: Rank -> buckets completed, for the ranks that checked in
            (ranks that are not previous members are ignored).
        alive: Ranks whose liveness is known (their key exists); None when no
            liveness is kept (then only the deadline ends the wait for a rank
            that never checks in).
        deadline_passed: The check-in deadline has passed.

    Returns:
        The record: every previous member checked in or is known dead (or the
        deadline passed); members are the live ranks that checked in. None
        while a live previous member has not checked in, or when no live
        member checked in at all.
    """
    def live(rank: int) -> bool:
        return alive is None or rank in alive

    waiting_for = [r for r in previous if r not in checked_in and live(r)]
    if waiting_for and not deadline_passed:
        return None
    members = tuple(sorted(r for r in set(previous) if r in checked_in and live(r)))
    if not members:
        return None
    dead = tuple(sorted(r for r in set(previous) if r not in members))
    return MembershipRecord(generation, members, min(checked_in[r] for r in members), dead)


def role(record: MembershipRecord, rank: int) -> str:
    """``"member"`` if ``rank`` is in ``record``, else ``"joiner"`` (alive but left out: it must rejoin)."""
    return "member" if rank in record.members else "joiner"


def proposal(step: int, members: Sequence[int], schedule: Mapping[int, Sequence[int]],
             waiting: Collection[int]) -> list[int]:
    """The leader's members for ``step``.

    Args:
        step: The step the members are for.
        members: The current members.
        schedule: ``step -> members`` from that step on (the coordinator's plan);
            when given, it alone decides.
        waiting: Ranks asking to join.

    Returns:
        The schedule's members for ``step`` (else the current ones) plus, when
        there is no schedule, the waiting ranks not yet members (sorted).
    """
    wanted = list(schedule.get(step, members))
    if not schedule:
        wanted += [r for r in sorted(set(waiting)) if r not in wanted]
    return wanted
