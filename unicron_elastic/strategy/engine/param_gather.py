"""A sharded optimizer's parameters gathered into the next forward (megatron-core's ``overlap_param_gather``).

An overlapped refresh (:class:`~unicron_elastic.strategy.engine.effects.Refresh`
with ``overlap``) starts the broadcast of every piece of the updated main
parameters without waiting (:meth:`OverlappedGather.start`). A forward
pre-hook on every module that holds parameters waits, before the module
computes, for the pieces up to the last one that covers its parameters, and
writes them into the model; the computation waits for the rest before its
first backward, and at its end (:meth:`OverlappedGather.finish`). Pieces are
waited for in the order they started, so a parameter is written before the
first module that owns it computes, and never after.

A failed wait ends the gather: every piece not written is dropped, and
:class:`~unicron_elastic.strategy.engine.effects.GatherFailed` tells the
protocol that this rank's parameters are stale (it computes its micro-batches
after the step's regroup, as after a failed refresh).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from unicron_elastic.strategy.engine.effects import GatherFailed
from unicron_elastic.strategy.engine.groups import GenerationGroups
from unicron_elastic.strategy.engine.shard_layout import Piece

__all__ = ["GatherPiece", "OverlappedGather"]


@dataclass(frozen=True)
class GatherPiece:
    """One piece in flight: ``write(values)`` sets its parameters once ``work`` filled ``values``.

    Attributes:
        params: The ids of the model parameters it covers.
        values: Its buffer (on the collectives' device).
        work: Its broadcast.
        write: Writes ``values`` into the model's parameters (cast to each one's dtype).
    """

    params: frozenset[int]
    values: torch.Tensor
    work: Any
    write: Callable[[torch.Tensor], None]


@dataclass
class _InFlight:
    key: int  # the groups' generation count the gather started under
    pieces: list[GatherPiece]
    done: Callable[[], None]  # called once every piece is written
    waited: int = 0
    last_of: dict[int, int] = field(default_factory=dict)  # parameter id -> index of the last piece covering it


class OverlappedGather:
    """The gather in flight, if any, and the forward pre-hooks that wait for it.

    Args:
        groups: The groups of the generation held: the gather runs in their data-parallel group, its work is
            settled when they are aborted, and a gather started under another generation count waits for nothing.
        waiting: ``waiting(what)``: a context that reports this rank's wait on its group (the group watch gives
            the group up once a member is gone, and the hang detector spares a rank waiting for peers).
        part_numel: Elements per broadcast at most (the gradient buckets' size: megatron-core gathers bucket
            by bucket); None: one broadcast per piece.
    """

    def __init__(self, groups: GenerationGroups, waiting: Callable[[str], AbstractContextManager[None]],
                 part_numel: int | None = None) -> None:
        self.groups, self.waiting, self.part_numel = groups, waiting, part_numel
        self._in_flight: _InFlight | None = None
        self._hooks: list[Any] = []

    @property
    def pending(self) -> int | None:
        """The generation count of the groups the gather in flight started under; None: none in flight."""
        return None if self._in_flight is None else self._in_flight.key

    def bind(self, model: torch.nn.Module) -> None:
        """Wait, before each of ``model``'s modules that holds parameters computes, for the pieces covering them."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for module in model.modules():
            own = frozenset(id(p) for p in module.parameters(recurse=False))
            if own:
                self._hooks.append(module.register_forward_pre_hook(
                    lambda mod, args, own=own: self._before(own)))

    def parts(self, piece: Piece) -> list[Piece]:
        """``piece`` cut into broadcasts of at most :attr:`part_numel` elements (the first forward waits for the
        first part only)."""
        size = self.part_numel or max(piece.end - piece.start, 1)
        return [Piece(piece.source, a, min(a + size, piece.end)) for a in range(piece.start, piece.end, size)]

    def start(self, key: int, pieces: list[GatherPiece], done: Callable[[], None]) -> None:
        """Hold ``pieces``, started under the groups' generation count ``key``; ``done()`` once all are written."""
        for piece in pieces:
            self.groups.started(piece.work)
        last_of = {param: i for i, piece in enumerate(pieces) for param in piece.params}
        self._in_flight = _InFlight(key, pieces, done, last_of=last_of)

    def discard(self) -> None:
        """Forget the gather in flight (its groups were aborted, or a wait failed): nothing more is written."""
        self._in_flight = None

    def finish(self) -> None:
        """Wait for every piece not written yet and write it.

        Raises:
            GatherFailed: A piece failed, or the gather's groups are gone.
        """
        if self._in_flight is not None:
            self._wait_through(len(self._in_flight.pieces) - 1)

    def _before(self, own: frozenset[int]) -> None:
        in_flight = self._in_flight
        if in_flight is None:
            return
        last = max((in_flight.last_of.get(param, -1) for param in own), default=-1)
        if last >= in_flight.waited:
            self._wait_through(last)

    def _wait_through(self, last: int) -> None:
        """Wait for the pieces up to ``last``, in order, writing each.

        Raises:
            GatherFailed: A piece failed, or the gather's groups are gone (the gather is dropped).
        """
        in_flight = self._in_flight
        failed = None
        try:
            while in_flight.waited <= last:
                piece = in_flight.pieces[in_flight.waited]
                self._wait(in_flight.key, piece.work)
                piece.write(piece.values)
                in_flight.waited += 1
        except RuntimeError as exc:
            failed = str(exc)[:300]
        if failed is not None:  # (raised outside the handler: no frame of the failed wait is kept)
            self.discard()
            raise GatherFailed(f"the parameters' gather failed: {failed}")
        if in_flight.waited == len(in_flight.pieces):
            self._in_flight = None
            in_flight.done()

    def _wait(self, key: int, work: Any) -> None:
        """Wait for one piece's broadcast (no local name keeps the group once it returns or raises).

        Raises:
            RuntimeError: It failed, or the groups it started in are gone.
        """
        if self.groups.built != key or self.groups.shard is None:
            raise RuntimeError("the group the gather started in is gone")
        with self.waiting("gather"):
            self.groups.transport.wait(self.groups.shard, work)  # (no local name holds the group)
        self.groups.waited(work)
