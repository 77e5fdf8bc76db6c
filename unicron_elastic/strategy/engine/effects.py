"""The vocabulary of the recovery protocol: the effects it yields, the outcomes it returns, the signals it raises.

:class:`~unicron_elastic.strategy.engine.protocol.Protocol` yields these frozen
dataclasses; a transport executes each and sends back its result
(:class:`~unicron_elastic.strategy.engine.elastic_dp.ElasticDataParallel` with gloo
groups and the c10d store; ``tests/fake_dp.py`` in one process).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from unicron_elastic.strategy.engine.membership import CheckIn, MembershipRecord


# -- what the protocol asks of a transport ------------------------------------------------------------
@dataclass(frozen=True)
class Point:
    """A named point of the protocol (fault injection; ``kind`` ``step``, ``bucket``, ``checkin``, ``poll``,
    ``decided``, ``form``). Returns nothing."""

    kind: str
    step: int
    index: int | None = None


@dataclass(frozen=True, eq=False)
class Compute:
    """Gradients of ``micro_batches`` of ``step``, summed into a fresh buffer (returned).

    ``redo``: they are moved or recomputed after a failure. Raises
    :class:`ReplicaBroken` when the model's own collectives failed (a tensor-
    or pipeline-parallel peer of this replica is lost).
    """

    step: int
    micro_batches: tuple[int, ...]
    redo: bool = False


@dataclass(frozen=True, eq=False)
class Add:
    """``total + extra`` (two gradient sums; returned)."""

    total: Any
    extra: Any


@dataclass(frozen=True, eq=False)
class Reduce:
    """All-reduce bucket ``bucket`` of the local sum ``local`` in the current group (a copy: ``local`` stays).

    The last bucket carries the primary's ``offer`` (the next step's members).
    Returns ``(reduced bucket, agreed members or None)``; raises ``RuntimeError`` when it fails.
    """

    step: int
    bucket: int
    local: Any
    offer: tuple[int, ...] | None
    last: bool


@dataclass(frozen=True)
class AgreeMembers:
    """A small all-reduce of the primary's ``offer`` (members of ``step``); returns the agreed list."""

    step: int
    offer: tuple[int, ...] | None


@dataclass(frozen=True)
class Pause:
    """A regroup begins (``paused``, at most ``bound`` seconds) or ends: a declared pause, not a hang."""

    paused: bool
    bound: float | None


@dataclass(frozen=True)
class DropGroup:
    """Destroy this rank's group now (closing its connections: peers blocked on this rank fail at once)."""


@dataclass(frozen=True)
class CheckInFor:
    """Store this rank's ``checkin`` for ``generation``."""

    generation: int
    checkin: CheckIn


@dataclass(frozen=True)
class ReadRecord:
    """The stored membership record of ``generation``, or None."""

    generation: int


@dataclass(frozen=True)
class ReadCheckIns:
    """The check-ins of ``ranks`` for ``generation`` (``rank -> CheckIn``)."""

    generation: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class ReadAlive:
    """Those of ``ranks`` alive in the incarnation this rank trained with (minus ranks waiting to join when
    ``exclude_waiting``); None when no one keeps liveness keys.

    ``trained``: judged by the incarnations noted when this rank's group
    formed (a member: a restarted peer is a joiner, not the member it trained
    with); False, by the liveness keys alone (a joiner trains with nobody: what
    it noted once is stale).
    """

    ranks: tuple[int, ...]
    exclude_waiting: bool
    trained: bool = True


@dataclass(frozen=True)
class Now:
    """The transport's clock (seconds for the real one); returns a float."""


@dataclass(frozen=True)
class Sleep:
    """Wait a little before polling again."""

    seconds: float


@dataclass(frozen=True)
class WriteRecord:
    """Write ``record`` create-only; returns the record stored (the first writer's)."""

    record: MembershipRecord


@dataclass(frozen=True)
class Abandon:
    """The group of ``record`` will not form (a member is dead or behind): this rank gives up building it."""

    record: MembershipRecord


@dataclass(frozen=True)
class BuildGroup:
    """Build the group of ``record`` (every member checked in); returns False when that fails."""

    record: MembershipRecord


@dataclass(frozen=True)
class Formed:
    """This rank is in the new group of ``generation`` (the transport notes incarnations, the primary publishes
    the members, ``on_group`` runs)."""

    generation: int
    members: tuple[int, ...]


@dataclass(frozen=True)
class ReadRequests:
    """Ranks waiting to join and ``members`` asked to leave (cheap when there are none); returns ``(joining, leaving)``.

    ``proposal``: read for the primary's proposal (with tensor/pipeline
    parallelism only one rank of the primary replica reads them; a rank asking
    whether it is itself asked to leave reads them whatever its shard).
    ``step``: the step whose members are proposed; the executor may answer
    from a read begun when the step before it began computing (what was asked
    before then is seen), so the read costs the step's end no round trip.
    """

    members: tuple[int, ...]
    proposal: bool = True
    step: int | None = None


@dataclass(frozen=True)
class AnyCheckedIn:
    """Whether any rank of ``ranks`` checked in for ``generation`` (with tensor/pipeline parallelism: any
    rank of those replicas, even if not all of them did yet); returns a bool."""

    generation: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class ReadWaiting:
    """Ranks waiting to join; returns a list."""


@dataclass(frozen=True)
class Announce:
    """Tell waiting ranks that ``record`` admits them, the member ``root`` sending the state from ``source``."""

    record: MembershipRecord
    root: int
    source: str


@dataclass(frozen=True)
class TransferState:
    """Broadcast the state from the member at index ``root``; with ``apply`` a receiver loads it and every
    rank, the root included, gets the step of the state it now holds (else None). Raises ``RuntimeError``
    when the broadcast fails."""

    root: int
    apply: bool


@dataclass(frozen=True, eq=False)
class SetGradients:
    """The step's reduced buckets: set the gradients (sum / B)."""

    step: int
    reduced: tuple[Any, ...]


@dataclass(frozen=True)
class Refresh:
    """(A sharded optimizer) make this rank hold its share of the members' optimizer state (copied from the ranks
    that hold it) and every parameter of its model equal to the updated main parameter that holds it.

    A collective over the group; raises ``RuntimeError`` when it fails, and
    :class:`~unicron_elastic.api.ShardLostError` when every copy of part of
    the state was lost. Returns nothing.

    With ``overlap`` (``overlap_param_gather``) the gather is only started: the
    next :class:`Compute` waits for each piece before the first use of its
    parameters, and raises :class:`GatherFailed` when one fails. A refresh
    without ``overlap`` first finishes a gather started in the same group.
    """

    step: int
    overlap: bool = False


@dataclass(frozen=True)
class MarkReady:
    """(A joiner admitted by ``generation``) its model is built: the members may send it the state now."""

    generation: int


@dataclass(frozen=True)
class ReadReady:
    """Whether every rank of the replicas ``ranks`` admitted by ``generation`` said :class:`MarkReady`; a bool."""

    generation: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class ReadMembers:
    """The last published ``(generation, members)``, or None."""


@dataclass(frozen=True)
class RequestJoin:
    """Ask to be admitted (a join request)."""


@dataclass(frozen=True)
class ReadFinished:
    """The step at which training finished, or None."""


@dataclass(frozen=True)
class ReadLatest:
    """The latest admission (``{"generation", "members", "step", "root", "source"}``), or None."""


@dataclass(frozen=True)
class Admitted:
    """This joiner is in (its request is withdrawn); its state came from ``source``."""

    generation: int
    source: str


@dataclass(frozen=True)
class Fallback:
    """No replica is left: fetch the state to resume from (snapshot, checkpoint, else step 0), of ``step``
    when given (the step the resuming replica's first rank chose; else the newest); returns ``(step, source)``."""

    step: int | None = None


@dataclass(frozen=True)
class FreeGeneration:
    """The first generation from ``generation`` on that has no record yet."""

    generation: int


@dataclass(frozen=True)
class Decided:
    """(Information) one evaluation of :func:`decide_record`: its inputs and result."""

    generation: int
    previous: tuple[int, ...]
    checked_in: Mapping[int, CheckIn]
    alive: frozenset[int] | None
    deadline_passed: bool
    result: MembershipRecord | None


@dataclass(frozen=True)
class Followed:
    """(Information) this rank follows ``record``."""

    record: MembershipRecord


@dataclass(frozen=True)
class Reassigned:
    """(Information) after a recovery in ``step``, who computes which micro-batch (in ``generation``)."""

    step: int
    generation: int
    assignment: Mapping[int, tuple[int, ...]]


# -- outcomes -------------------------------------------------------------------------------------------
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
class Regrouped:
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


class ReplicaBroken(RuntimeError):
    """(Raised by a transport's :class:`Compute`) the model's own collectives failed: a tensor- or
    pipeline-parallel peer of this replica is lost, so this replica cannot finish the step."""


class GatherFailed(RuntimeError):
    """(Raised by a transport's :class:`Compute`) the gather an overlapped :class:`Refresh` started failed: this
    rank's parameters are stale and nothing it computed counts."""


class Excluded(Exception):
    """This rank is alive but a membership record left it out: it must rejoin (:meth:`Protocol.join`).

    Attributes:
        record: The record that left it out.
        step: The step this rank was in.
        rejoin: Uncaught in a worker, the worker asks its agent to start it again as a
            joiner (``unicron_elastic.worker``'s exception hook): no failure, no restart counted.
    """

    rejoin = True

    def __init__(self, message: str, record: MembershipRecord | None = None, step: int | None = None) -> None:
        super().__init__(message)
        self.record, self.step = record, step
