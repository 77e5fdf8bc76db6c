"""Where a sharded optimizer's state lives: instances, each member's share, and the pieces a move copies.

Pure decisions (no I/O) for :mod:`~unicron_elastic.strategy.engine.optimizer_shards`,
after Megatron-LM's distributed optimizer with ``num_distributed_optimizer_instances``:
the data-parallel members are split into *instances* of consecutive members;
inside an instance the optimizer state (fp32 main parameters and the
optimizer's per-element state) is split into one contiguous share per
member, and every instance holds the whole state, so each share has a copy
in every other instance.

A *move* makes every rank hold what it should from what the ranks hold now
(:func:`plan_pieces`): after a lost rank (its share is taken from another
instance), after a change of the data-parallel size (every share is cut
anew), and, with every rank's target the whole range, to gather the updated
parameters into every rank's model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from unicron_elastic.api import ShardLostError

__all__ = ["Piece", "ShardLayout", "plan_pieces", "share"]


def share(numel: int, index: int, parts: int) -> tuple[int, int]:
    """The ``index``-th of ``parts`` contiguous, nearly equal shares of ``range(numel)``: ``(start, end)``."""
    return numel * index // parts, numel * (index + 1) // parts


@dataclass(frozen=True)
class ShardLayout:
    """The data-parallel members split into instances of consecutive members.

    Attributes:
        members: The data-parallel members (replicas with TP x PP > 1), sorted.
        instances: How many instances; fewer when there are fewer members (each instance has one at least).
    """

    members: tuple[int, ...]
    instances: int

    def __post_init__(self) -> None:
        if self.instances < 1:
            raise ValueError(f"instances must be >= 1, got {self.instances}")
        if list(self.members) != sorted(set(self.members)):
            raise ValueError(f"members must be distinct and sorted, got {list(self.members)}")

    @property
    def copies(self) -> int:
        """How many instances there are, so how many copies of each share (at most one per member)."""
        return min(self.instances, len(self.members))

    def instance(self, k: int) -> tuple[int, ...]:
        """The members of instance ``k``: a contiguous block (Megatron-LM's intra-instance groups are too)."""
        start, end = share(len(self.members), k, self.copies)
        return self.members[start:end]

    def range_of(self, member: int, numel: int) -> tuple[int, int]:
        """The ``(start, end)`` of ``range(numel)`` that ``member`` keeps; ``(0, 0)`` for a rank that is not a member.

        Raises:
            ValueError: ``numel`` is negative.
        """
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        for k in range(self.copies):
            block = self.instance(k)
            if member in block:
                return share(numel, block.index(member), len(block))
        return 0, 0


@dataclass(frozen=True)
class Piece:
    """``[start, end)`` of a flat range, sent by the rank at ``source`` (its index in the group)."""

    source: int
    start: int
    end: int


def plan_pieces(held: Sequence[tuple[int, int]], numel: int) -> list[Piece]:
    """Cover ``range(numel)`` with pieces of what the ranks hold, in order, each from one rank.

    At each point the rank whose holding reaches furthest sends (the lowest
    index on a tie), so a layout whose shares line up is sent in as many
    pieces as one instance has members.

    Args:
        held: ``held[i]``: the ``(start, end)`` the rank at index ``i`` holds (``start == end``: nothing).
        numel: The length of the flat range.

    Returns:
        The pieces, in order, that cover ``range(numel)`` exactly.

    Raises:
        ShardLostError: Part of the range is held by no rank (every copy of it was lost).
    """
    pieces: list[Piece] = []
    at = 0
    while at < numel:
        reach = [(end, -i) for i, (start, end) in enumerate(held) if start <= at < end]
        if not reach:
            resumes = min((start for start, end in held if start > at and end > start), default=numel)
            raise ShardLostError(at, resumes)
        end, negative = max(reach)
        pieces.append(Piece(-negative, at, end))
        at = end
    return pieces
