"""A micro-batch pipeline schedule over ``torch.distributed`` point-to-point (gloo on CPU).

megatron-core's schedules (``pipeline_parallel/schedules.py``) call ``torch.cuda``
unconditionally, so on CPU the strategy needs a schedule of its own. This
module is the building block: a pure schedule (which forward or backward each
stage runs next: :func:`gpipe` or :func:`one_f_one_b`, the same micro-batch
order as megatron-core's non-interleaved 1F1B), a pure check that a schedule
cannot deadlock (:func:`simulate`), and :func:`run_pipeline`, which runs one
step of a stage's part of the model: activations go forward and their
gradients backward as tensors, each preceded by a small header (shape, dtype),
sends are asynchronous and receives blocking.

Not wired into :class:`~unicron_elastic.strategy.lightning.UnicronMegatronStrategy`
yet (it refuses PP > 1): see docs/strategy.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from unicron_elastic.api import ConfigError

Kind = Literal["F", "B"]
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
_HEADER = 8  # dtype code, ndim, up to 6 dims


@dataclass(frozen=True)
class Op:
    """One unit of a stage's schedule: the forward (``F``) or backward (``B``) of micro-batch ``j``."""

    kind: Kind
    j: int


class PipelineDeadlock(RuntimeError):
    """A schedule whose stages would wait on each other forever (:func:`simulate`)."""


def _check(stage: int, stages: int, micro_batches: int) -> None:
    if stages < 1 or micro_batches < 1 or not 0 <= stage < stages:
        raise ConfigError(f"pipeline stage {stage} of {stages} with {micro_batches} micro-batches: need "
                          "stages >= 1, micro-batches >= 1 and 0 <= stage < stages")


def gpipe(stage: int, stages: int, micro_batches: int) -> list[Op]:
    """GPipe: every forward, then every backward in the same micro-batch order.

    Raises:
        ConfigError: Sizes < 1 or a stage outside ``0..stages-1``.
    """
    _check(stage, stages, micro_batches)
    return [Op("F", j) for j in range(micro_batches)] + [Op("B", j) for j in range(micro_batches)]


def one_f_one_b(stage: int, stages: int, micro_batches: int) -> list[Op]:
    """Non-interleaved 1F1B (PipeDream-Flush, megatron-core's default order).

    Stage ``s`` runs ``min(stages - s - 1, m)`` warm-up forwards, then
    alternates one forward and one backward, then drains the remaining
    backwards: at most ``stages - s`` micro-batches' activations are held.

    Raises:
        ConfigError: Sizes < 1 or a stage outside ``0..stages-1``.
    """
    _check(stage, stages, micro_batches)
    warmup = min(stages - stage - 1, micro_batches)
    ops = [Op("F", j) for j in range(warmup)]
    forward, backward = warmup, 0
    while forward < micro_batches:
        ops += [Op("F", forward), Op("B", backward)]
        forward, backward = forward + 1, backward + 1
    ops += [Op("B", j) for j in range(backward, micro_batches)]
    return ops


SCHEDULES: dict[str, Callable[[int, int, int], list[Op]]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def simulate(schedules: Sequence[Sequence[Op]]) -> int:
    """Run the stages' schedules against each other with asynchronous sends and blocking receives.

    ``F j`` on stage ``s > 0`` waits for ``F j`` of stage ``s - 1``; ``B j``
    on a stage before the last waits for ``B j`` of the next stage.

    Returns:
        The number of rounds (each stage runs at most one op per round).

    Raises:
        PipelineDeadlock: No stage can go on while some have ops left.
    """
    done: set[tuple[int, Kind, int]] = set()
    position = [0] * len(schedules)
    last = len(schedules) - 1
    rounds = 0
    while any(p < len(ops) for p, ops in zip(position, schedules)):
        ready = []
        for s, ops in enumerate(schedules):
            if position[s] == len(ops):
                continue
            op = ops[position[s]]
            needs = (s - 1, "F", op.j) if op.kind == "F" and s > 0 else \
                (s + 1, "B", op.j) if op.kind == "B" and s < last else None
            local = op.kind == "F" or (s, "F", op.j) in done
            if local and (needs is None or needs in done):
                ready.append((s, op))
        if not ready:
            raise PipelineDeadlock(f"stages wait on each other at {[ops[p] if p < len(ops) else None for p, ops in zip(position, schedules)]}")
        for s, op in ready:
            done.add((s, op.kind, op.j))
            position[s] += 1
        rounds += 1
    return rounds


@dataclass(frozen=True)
class StageLinks:
    """The ranks next to this stage in its pipeline (None at the ends) and the group they talk in."""

    previous: int | None
    next: int | None
    group: Any = None

    @property
    def first(self) -> bool:
        return self.previous is None

    @property
    def last(self) -> bool:
        return self.next is None


def _send(tensor: torch.Tensor, peer: int, group: Any, pending: list[Any]) -> None:
    """Send a header (dtype, shape) and then the tensor, asynchronously (handles go to ``pending``).

    Raises:
        ConfigError: A dtype or a rank the header cannot describe.
    """
    if tensor.dtype not in _DTYPES or tensor.dim() > _HEADER - 2:
        raise ConfigError(f"pipeline tensors must be one of {_DTYPES} with at most {_HEADER - 2} dims "
                          f"(got {tensor.dtype}, {tensor.dim()} dims)")
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
    header[2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    payload = tensor.detach().contiguous()
    pending.append(dist.isend(header, peer, group=group))
    pending.append(dist.isend(payload, peer, group=group))
    pending.append(payload)  # (kept alive until the send completed)


def _recv(peer: int, group: Any, device: torch.device) -> torch.Tensor:
    header = torch.zeros(_HEADER, dtype=torch.int64)
    dist.recv(header, peer, group=group)
    ndim = int(header[1])
    tensor = torch.empty([int(d) for d in header[2:2 + ndim]], dtype=_DTYPES[int(header[0])])
    dist.recv(tensor, peer, group=group)
    return tensor.to(device)


def run_pipeline(module: torch.nn.Module, schedule: Sequence[Op], links: StageLinks,
                 inputs: Callable[[int], Any], loss: Callable[[int, Any], torch.Tensor],
                 device: torch.device = torch.device("cpu")) -> list[torch.Tensor]:
    """Run one step of this stage: forwards and backwards in ``schedule`` order; gradients accumulate.

    Args:
        module: This stage's part of the model (its input is the previous
            stage's output, or ``inputs(j)`` on the first stage).
        schedule: This stage's ops (:func:`gpipe`, :func:`one_f_one_b`).
        links: The neighbouring stages' ranks.
        inputs: Micro-batch ``j``'s input of the first stage.
        loss: On the last stage, micro-batch ``j``'s loss from the stage's output
            (scale it by the number of micro-batches for a mean).
        device: Where received tensors go.

    Returns:
        The last stage's losses (detached) in micro-batch order; empty on other stages.

    Raises:
        ConfigError: A tensor the stages cannot exchange.
        RuntimeError: A neighbour failed (gloo's error).
    """
    held: dict[int, tuple[torch.Tensor | None, Any]] = {}  # j -> (input needing its grad, output or loss)
    losses: dict[int, torch.Tensor] = {}
    pending: list[Any] = []
    for op in schedule:
        if op.kind == "F":
            received = None if links.first else _recv(links.previous, links.group, device).requires_grad_()
            output = module(inputs(op.j) if received is None else received)
            if links.last:
                output = loss(op.j, output)
                losses[op.j] = output.detach()
            else:
                _send(output, links.next, links.group, pending)
            held[op.j] = (received, output)
        else:
            received, output = held.pop(op.j)
            if links.last:
                output.backward()
            else:
                output.backward(_recv(links.next, links.group, device))
            if received is not None:
                _send(received.grad, links.previous, links.group, pending)
    for work in pending:
        if hasattr(work, "wait"):
            work.wait()
    return [losses[j] for j in sorted(losses)]
