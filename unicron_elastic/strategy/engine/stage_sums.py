"""What a step adds across the shards of a replica (TP x PP > 1): tied and tensor-partial gradients, the norm.

* **Tied weights** (:mod:`~unicron_elastic.strategy.engine.tied`): the first and the
  last pipeline stage each hold a copy of the word embedding. They start equal
  (:meth:`ReplicaSums.tie`: the first stage's values are sent to the last,
  where megatron-core's constructor on a CPU leaves zeros), and after each
  shard's data-parallel reduce the two stages exchange the copy's reduced
  gradient sum point-to-point and both take ``first + last`` (megatron's
  word-embedding all-reduce). The sum is kept apart from the reduce buffer and
  written into it only when the step's gradients are set, so a commit retried
  after a failure sums the same reduced values again.
* **Gradients partial on each tensor rank** (:class:`~unicron_elastic.strategy.engine.engine_options.TensorReduced`): a
  parameter every tensor rank holds whole but computes only part of the
  gradient of (with sequence parallelism a layer norm sees only its sequence
  chunk; a qk-layernorm only its heads). megatron-core's ``finalize_model_grads``
  sums these over the tensor group (averages those marked
  ``average_gradients_across_tp_domain``); the engine does the same after the
  data-parallel reduce, by point-to-point exchange with the stage's other
  tensor ranks, adding the parts in tensor-rank order so every tensor rank holds
  the same bytes. Like the tied sum it is kept apart until the step's gradients
  are set.
* **The replica's gradient norm**: each shard's sum of squares of its reduced
  gradient sum (each parameter counted once), which the step's commit adds up
  over the primary replica's shards; :attr:`StepReduction.grad_norm
  <unicron_elastic.strategy.engine.reduction.StepReduction.grad_norm>` divides
  its square root by B.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from unicron_elastic.api import ConfigError
from unicron_elastic.strategy.engine.engine_options import TensorReduced
from unicron_elastic.strategy.engine.replicas import ModelParallel
from unicron_elastic.strategy.engine.tied import TiedWeight, find_tied, norm_ranges, squared_norm

TIED_TAG = 7  # point-to-point tag of the tied weight's exchange (the pipeline's activations use 0)
TENSOR_TAG = 8  # point-to-point tag of the tensor group's exchange of partial gradients

Waiting = Callable[[str], AbstractContextManager[None]]


class ReplicaSums:
    """This shard's part of the tied weight's gradient sum and of the replica's gradient norm.

    Args:
        params: The parameters the engine sums, in its order.
        names: Their names.
        layout: The model's tensor x pipeline parallelism.
        rank: This launch rank.
        tensor_reduced: The parameters whose gradients are reduced over the tensor group (TP > 1).

    Raises:
        ConfigError: A weight tied across stages that cannot be kept tied (:func:`~unicron_elastic.strategy.engine.tied.find_tied`),
            or a parameter to reduce over the tensor group that is itself split over it.
    """

    def __init__(self, params: list[torch.nn.Parameter], names: list[str], layout: ModelParallel, rank: int,
                 tensor_reduced: TensorReduced = TensorReduced()) -> None:
        self.layout, self.rank = layout, rank
        self.stage = layout.stage(rank)
        self.tensor_rank = layout.tensor_rank(rank)
        self.tied: TiedWeight | None = find_tied(params, names, self.stage, layout.pipeline)
        self.params = params
        offsets = [0]
        for p in params:
            offsets.append(offsets[-1] + p.numel())
        self._offsets = offsets
        self.tensor_reduced = tensor_reduced if layout.tensor > 1 else TensorReduced()
        for index in (*self.tensor_reduced.summed, *self.tensor_reduced.averaged):
            if getattr(params[index], "tensor_model_parallel", False):
                raise ConfigError(f"{names[index]} is split over the tensor-parallel group and also marked to have its "
                                  "gradient summed over it (sequence_parallel or a q/k layer norm): one or the other")
        reduced = sorted((*self.tensor_reduced.summed, *self.tensor_reduced.averaged))
        #: ``(start, end, averaged)`` of each parameter reduced over the tensor group, in the flat gradient sum.
        self._tensor_spans = [(offsets[i], offsets[i + 1], i in self.tensor_reduced.averaged) for i in reduced]
        skip = set(reduced) | ({self.tied.index} if self.tied is not None else set())
        self.ranges = norm_ranges(params, self.tensor_rank, skip=skip)
        self._tied_sum: torch.Tensor | None = None
        self._tensor_sum: torch.Tensor | None = None

    # -- the ends of the pipeline -------------------------------------------------------------------
    @property
    def pipeline_end(self) -> int | None:
        """The other end's stage when this rank is on the first or the last of several stages, else None."""
        last = self.layout.pipeline - 1
        if last == 0 or self.stage not in (0, last):
            return None
        return last if self.stage == 0 else 0

    def span(self) -> tuple[int, int]:
        """``(start, end)`` of the tied weight in the flat gradient sum."""
        assert self.tied is not None
        return self._offsets[self.tied.index], self._offsets[self.tied.index + 1]

    def tie(self, group: Any, peer: int, waiting: Waiting) -> None:
        """Make the last stage's copy of the tied weight equal the first stage's (at the start of training).

        Both ends first say how many elements their copy has (0: none), so a
        model tied on one end only is refused on both instead of waiting.

        Raises:
            ConfigError: The two ends do not hold matching copies.
            RuntimeError: The peer failed (gloo's error).
        """
        tied = self.tied
        numel = self.params[tied.index].numel() if tied is not None else 0
        mine = torch.tensor([numel], dtype=torch.int64, device=self._device())
        theirs = torch.zeros_like(mine)
        with waiting("tie"):
            sent = group.send([mine], peer, TIED_TAG)
            group.recv([theirs], peer, TIED_TAG).wait()
            sent.wait()
        if int(theirs) != numel:
            raise ConfigError(f"the first and the last pipeline stage do not hold matching copies of the tied word "
                              f"embedding (stage {self.stage}: {numel} elements, stage {self.pipeline_end}: "
                              f"{int(theirs)}; 0: none): set share_embeddings_and_output_weights the same on every "
                              "stage and config.pipeline_model_parallel_size to the strategy's")
        if tied is None:
            return
        weight = self.params[tied.index]
        with waiting("tie"), torch.no_grad():
            if tied.first:
                group.send([weight.detach().contiguous()], peer, TIED_TAG).wait()
            else:
                received = torch.empty_like(weight.detach())
                group.recv([received], peer, TIED_TAG).wait()
                weight.copy_(received)

    def _device(self) -> torch.device:
        return self.params[0].device

    # -- each step ----------------------------------------------------------------------------------
    def exchange(self, reduced: torch.Tensor, group: Any, peer: int, waiting: Waiting) -> None:
        """Sum the tied weight's reduced gradient with the other stage's (kept until :meth:`apply`).

        Raises:
            RuntimeError: The peer failed (gloo's error).
        """
        start, end = self.span()
        mine = reduced[start:end]
        theirs = torch.empty_like(mine)
        with waiting("tied"):
            sent = group.send([mine], peer, TIED_TAG)
            group.recv([theirs], peer, TIED_TAG).wait()
            sent.wait()
        self._tied_sum = mine + theirs if self.tied.first else theirs + mine  # the same bytes on both ends

    def exchange_tensor(self, reduced: torch.Tensor, group: Any, peers: list[int], waiting: Waiting) -> None:
        """Reduce the tensor-partial gradients over this stage's tensor ranks (kept until :meth:`apply`).

        Args:
            reduced: This shard's reduced gradient sum (left untouched: a retried commit sums it again).
            group: The group of every rank.
            peers: The group ranks of this replica's stage, by tensor rank (this rank's included).
            waiting: The group watch's context for a wait on peers.

        Raises:
            RuntimeError: A peer failed (gloo's error).
        """
        if not self._tensor_spans:
            return
        mine = torch.cat([reduced[start:end] for start, end, _ in self._tensor_spans])
        parts: list[torch.Tensor | None] = [None] * len(peers)
        parts[self.tensor_rank] = mine
        with waiting("tensor"):
            sent = [group.send([mine], peer, TENSOR_TAG) for t, peer in enumerate(peers) if t != self.tensor_rank]
            for t, peer in enumerate(peers):
                if t != self.tensor_rank:
                    parts[t] = torch.empty_like(mine)
                    group.recv([parts[t]], peer, TENSOR_TAG).wait()
            for work in sent:
                work.wait()
        total = parts[0].clone()
        for part in parts[1:]:  # tensor rank 0, 1, ...: the same bytes on every tensor rank
            total += part
        offset = 0
        for start, end, averaged in self._tensor_spans:
            if averaged:
                total[offset : offset + end - start].div_(len(peers))
            offset += end - start
        self._tensor_sum = total

    def squared_norm(self, reduced: torch.Tensor) -> float:
        """This shard's part of the replica's squared gradient norm (of the reduced sums, before / B)."""
        total = squared_norm(reduced, self.ranges)
        if self.tied is not None and self.tied.first and self._tied_sum is not None:
            total += squared_norm(self._tied_sum, [(0, self._tied_sum.numel())])
        if self.tensor_rank == 0 and self._tensor_sum is not None:  # (whole on every tensor rank: counted once)
            total += squared_norm(self._tensor_sum, [(0, self._tensor_sum.numel())])
        return total

    def apply(self, reduced: torch.Tensor) -> None:
        """Write the tied weight's and the tensor-partial gradients' sums into the reduced sum (the step's
        gradients are being set)."""
        if self._tensor_sum is not None:
            offset = 0
            for start, end, _ in self._tensor_spans:
                reduced[start:end].copy_(self._tensor_sum[offset : offset + end - start])
                offset += end - start
            self._tensor_sum = None
        if self._tied_sum is None:
            return
        start, end = self.span()
        reduced[start:end].copy_(self._tied_sum)
        self._tied_sum = None
