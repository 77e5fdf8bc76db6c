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

The elastic engine runs it for a pipeline-parallel model on CPU
(:class:`~unicron_elastic.strategy.engine.elastic_dp.ElasticDataParallel` with
``pipeline > 1``): each micro-batch's gradients are added up after its
backward (``on_backward``), and when a failure's recomputation needs only
later stages' gradients, the earlier stages run :func:`forward_only`.
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


def schedule_for(name: str, stage: int, stages: int, micro_batches: int) -> list[Op]:
    """The ops of ``stage`` under the schedule called ``name``.

    Raises:
        ConfigError: An unknown schedule, or bad sizes.
    """
    if name not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    return SCHEDULES[name](stage, stages, micro_batches)


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


def forward_only(micro_batches: int) -> list[Op]:
    """Every forward, no backward: a stage whose gradients are not needed again (a recomputation after a
    failure, when this stage and every stage before it already reduced theirs)."""
    return [Op("F", j) for j in range(micro_batches)]


@dataclass(frozen=True)
class StageLinks:
    """The ranks next to this stage in its pipeline (None at the ends) and the group they talk in.

    Attributes:
        previous: Rank (in ``group``) of the previous stage.
        next: Rank (in ``group``) of the next stage.
        group: A ``torch.distributed`` process group object (default: the default group).
        send_gradients: Send the gradient of this stage's input to the previous
            stage (False when the previous stage runs forward only).
        waiting: ``waiting(what)``, a context manager around each wait on a
            neighbour (the engine's :meth:`~unicron_elastic.strategy.engine.group_watch.GroupWatch.waiting`);
            None: none.
    """

    previous: int | None
    next: int | None
    group: Any = None
    send_gradients: bool = True
    waiting: Any = None

    def wait(self, work: Any, what: str) -> None:
        """Wait for ``work`` (a receive or send) inside :attr:`waiting`."""
        if self.waiting is None:
            work.wait()
            return
        with self.waiting(what):
            work.wait()

    @property
    def first(self) -> bool:
        return self.previous is None

    @property
    def last(self) -> bool:
        return self.next is None

    def process_group(self) -> Any:
        """The group the stages talk in (the default group when none was given)."""
        return self.group if self.group is not None else dist.distributed_c10d._get_default_group()


def _send(tensor: torch.Tensor, peer: int, group: Any, pending: list[Any]) -> None:
    """Send a header (dtype, shape) and then the tensor, asynchronously (handles go to ``pending``).

    Raises:
        ConfigError: A dtype or a rank the header cannot describe.
    """
    if tensor.dtype not in _DTYPES or tensor.dim() > _HEADER - 2:
        raise ConfigError(f"pipeline tensors must be one of {_DTYPES} with at most {_HEADER - 2} dims "
                          f"(got {tensor.dtype}, {tensor.dim()} dims)")
    header = torch.zeros(_HEADER, dtype=torch.int64, device=tensor.device)
    header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
    header[2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    payload = tensor.detach().contiguous()
    pending.append(group.send([header], peer, 0))
    pending.append(group.send([payload], peer, 0))
    pending.append((header, payload))  # (kept alive until the sends completed)


def _recv(peer: int, group: Any, device: torch.device, links: StageLinks) -> torch.Tensor:
    header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    links.wait(group.recv([header], peer, 0), "pipeline_recv")
    ndim = int(header[1])
    tensor = torch.empty([int(d) for d in header[2:2 + ndim]], dtype=_DTYPES[int(header[0])], device=device)
    links.wait(group.recv([tensor], peer, 0), "pipeline_recv")
    return tensor


def run_pipeline(forward: Callable[[int, torch.Tensor | None], torch.Tensor], ops: Sequence[Op],
                 links: StageLinks, device: torch.device = torch.device("cpu"),
                 on_backward: Callable[[int], None] | None = None) -> list[torch.Tensor]:
    """Run one step of this stage: forwards and backwards in the order of ``ops`` (its pipeline schedule).

    Args:
        forward: ``forward(j, input)`` runs this stage on micro-batch ``j``
            (``input`` is None on the first stage, else the previous stage's
            output) and returns its output; on the last stage, the loss of
            micro-batch ``j`` (a scalar; the backward starts from it).
        ops: This stage's ops (:func:`gpipe`, :func:`one_f_one_b`,
            :func:`forward_only`), over micro-batches ``0..m-1``.
        links: The neighbouring stages' ranks.
        device: Where received tensors go.
        on_backward: Called as ``on_backward(j)`` after the backward of
            micro-batch ``j`` (its gradients are in ``.grad``: e.g. add them
            up per micro-batch); without it gradients accumulate in ``.grad``.

    Returns:
        The last stage's losses (detached) in micro-batch order; empty on other stages.

    Raises:
        ConfigError: A tensor the stages cannot exchange.
        RuntimeError: A neighbour failed (gloo's error).
    """
    group = links.process_group()
    backward = any(op.kind == "B" for op in ops)
    wants_input_grad = links.send_gradients and backward
    held: dict[int, tuple[torch.Tensor | None, Any]] = {}  # j -> (input needing its grad, output or loss)
    losses: dict[int, torch.Tensor] = {}
    pending: list[Any] = []
    for op in ops:
        if op.kind == "F":
            received = None if links.first else _recv(links.previous, group, device, links)
            if received is not None and wants_input_grad:
                received.requires_grad_()
            with torch.set_grad_enabled(backward):  # forward only: no graph, no activations held
                output = forward(op.j, received)
            if links.last:
                losses[op.j] = output.detach()
            else:
                _send(output, links.next, group, pending)
            if backward:
                held[op.j] = (received, output)
        else:
            received, output = held.pop(op.j)
            if links.last:
                output.backward()
            else:
                output.backward(_recv(links.next, group, device, links))
            if on_backward is not None:
                on_backward(op.j)
            if received is not None and wants_input_grad:
                _send(received.grad, links.previous, group, pending)
    for work in pending:
        if hasattr(work, "wait"):
            links.wait(work, "pipeline_send")
    return [losses[j] for j in sorted(losses)]
