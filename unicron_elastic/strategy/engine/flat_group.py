"""One optimizer parameter group as a flat range, laid out in the order of the engine's flat gradient sum.

A sharded optimizer (:mod:`~unicron_elastic.strategy.engine.optimizer_shards`)
gives each data-parallel member one contiguous share of the flat gradient sum
(:class:`~unicron_elastic.strategy.engine.gradients.GradientBuffer`: the
parameters in the reverse of their registration order), as megatron-core's
distributed optimizer shards its gradient buffer. A :class:`FlatGroup` orders
its parameters as that sum does, so a member's share of the sum holds one
contiguous range of each group (:meth:`FlatGroup.project`): the member's main
parameter of the group, what the pieces of a move copy and what a
reduce-scatter delivers are then the same elements.

The group keeps the optimizer's own order of its parameters too
(:attr:`FlatGroup.order`): state dicts name parameters by that order.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from unicron_elastic.strategy.engine.gradients import HALF, optimizer_gradient

__all__ = ["FlatGroup", "ParamBuffer"]


class FlatGroup:
    """One parameter group as a flat range in the flat gradient sum's order.

    Args:
        params: The group's parameters, in the optimizer's order.
        flat_start: Where each parameter's gradient starts in the flat sum (``id(p) -> offset``).
    """

    def __init__(self, params: list[torch.nn.Parameter], flat_start: dict[int, int]) -> None:
        #: Positions in the optimizer's order of the parameters, in the flat sum's order.
        self.order = sorted(range(len(params)), key=lambda i: flat_start[id(params[i])])
        #: The parameters, in the flat sum's order.
        self.params = [params[i] for i in self.order]
        self.flat_starts = [flat_start[id(p)] for p in self.params]
        self.offsets = [0]
        for p in self.params:
            self.offsets.append(self.offsets[-1] + p.numel())

    @property
    def numel(self) -> int:
        return self.offsets[-1]

    @property
    def half(self) -> bool:
        """Some of its parameters are half-precision: a whole state holds their float32 main parameters."""
        return any(p.dtype in HALF for p in self.params)

    def in_flat_order(self, per_param: Sequence) -> list:
        """``per_param`` (one item per parameter, in the optimizer's order) in the flat sum's order."""
        return [per_param[i] for i in self.order]

    def project(self, flat_lo: int, flat_hi: int) -> tuple[int, int]:
        """The range of this group that lies in ``[flat_lo, flat_hi)`` of the flat sum (contiguous: the group's
        parameters follow the sum's order)."""
        def before(x: int) -> int:
            return sum(min(max(x - f, 0), p.numel()) for p, f in zip(self.params, self.flat_starts))

        start, end = before(flat_lo), before(flat_hi)
        return (start, end) if end > start else (0, 0)

    def parts(self, start: int, end: int) -> Iterator[tuple[torch.nn.Parameter, int, int, int, int]]:
        """``(param, a, b, i, j)`` for each parameter overlapping ``[start, end)``: its elements ``[a, b)`` are
        elements ``[i, j)`` of the range."""
        for _, p, a, b, i, j in self._parts(start, end):
            yield p, a, b, i, j

    def _parts(self, start: int, end: int) -> Iterator[tuple[int, torch.nn.Parameter, int, int, int, int]]:
        """:meth:`parts`, each with the flat sum's position of the part's first element first."""
        for p, f, lo, hi in zip(self.params, self.flat_starts, self.offsets, self.offsets[1:]):
            a, b = max(lo, start), min(hi, end)
            if a < b:
                yield f + a - lo, p, a - lo, b - lo, a - start, b - start

    def flat_span(self, start: int, end: int) -> tuple[int, int] | None:
        """Where ``[start, end)`` lies in the flat sum when it is one contiguous run of it, else None (another
        group's parameters lie between)."""
        runs = [(at, b - a) for at, _, a, b, _, _ in self._parts(start, end)]
        if not runs:
            return None
        if any(x + n != y for (x, n), (y, _) in zip(runs, runs[1:])):
            return None
        return runs[0][0], runs[0][0] + (end - start)

    def read(self, start: int, end: int, grad: bool = False) -> torch.Tensor:
        """Elements ``[start, end)`` of the parameters (or of their reduced gradients, zeros for none) as fp32."""
        device = self.params[0].device if self.params else torch.device("cpu")
        out = torch.zeros(end - start, dtype=torch.float32, device=device)
        for p, a, b, i, j in self.parts(start, end):
            source = optimizer_gradient(p) if grad else p.detach()
            if source is not None:
                out[i:j].copy_(source.reshape(-1)[a:b])
        return out

    def read_share(self, start: int, end: int, share: torch.Tensor, origin: int) -> torch.Tensor:
        """Elements ``[start, end)`` of a reduced share of the flat sum (``share`` begins at flat position
        ``origin``) as float32: a view where they are one contiguous float32 run of it, else a copy."""
        span = self.flat_span(start, end)
        if span is not None and share.dtype == torch.float32:
            return share[span[0] - origin:span[1] - origin]
        out = torch.zeros(end - start, dtype=torch.float32, device=share.device)
        for at, _, a, b, i, j in self._parts(start, end):
            out[i:j].copy_(share[at - origin:at - origin + (b - a)])
        return out

    @torch.no_grad()
    def write(self, start: int, values: torch.Tensor) -> None:
        """Set the parameters' elements ``[start, start + len(values))`` (cast to each parameter's dtype)."""
        for p, a, b, i, j in self.parts(start, start + values.numel()):
            p.view(-1)[a:b].copy_(values[i:j])


class ParamBuffer:
    """The model's float32 parameters as views of one flat buffer, in the flat gradient sum's order.

    megatron-core's distributed optimizer keeps its parameters in such a buffer: a float32 main parameter is
    then a view of the model's own parameters (no copy of the share), and the gather lands in the parameters
    themselves (no staging copy). :meth:`backs` says whether every parameter still is its view (something
    that replaces a parameter's ``.data`` ends it); where it does not, the shards copy, as without a buffer.

    Args:
        params: The parameters, in the flat sum's order (all float32, on one device).
    """

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.flat = torch.empty(sum(p.numel() for p in params), dtype=torch.float32, device=params[0].device)
        at = 0
        with torch.no_grad():
            for p in params:
                view = self.flat[at:at + p.numel()].view_as(p)
                view.copy_(p)
                p.data = view  # (the Parameter object stays: the optimizer, hooks and modules keep it)
                at += p.numel()

    @staticmethod
    def of(params: list[torch.nn.Parameter]) -> ParamBuffer | None:
        """The buffer of ``params``; None where they are not all float32 on one device (half-precision
        parameters have separate float32 main parameters)."""
        if not params or any(p.dtype != torch.float32 or p.device != params[0].device for p in params):
            return None
        return ParamBuffer(params)

    def backs(self) -> bool:
        """Whether every parameter still is its view of the buffer."""
        at, base = 0, self.flat.data_ptr()
        for p in self.params:
            if p.data_ptr() != base + at * 4 or not p.is_contiguous():
                return False
            at += p.numel()
        return True

    def view(self, span: tuple[int, int] | None) -> torch.Tensor | None:
        """The buffer's elements ``[start, end)`` of the flat sum (None: ``span`` is None)."""
        return None if span is None else self.flat[span[0]:span[1]]
