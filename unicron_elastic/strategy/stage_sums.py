"""What a step adds across the shards of a replica (TP x PP > 1): the tied weight's gradients, the gradient norm.

* **Tied weights** (:mod:`~unicron_elastic.strategy.tied`): the first and the
  last pipeline stage each hold a copy of the word embedding. They start equal
  (:meth:`ReplicaSums.tie`: the first stage's values are sent to the last,
  where megatron-core's constructor on a CPU leaves zeros), and after each
  shard's data-parallel reduce the two stages exchange the copy's reduced
  gradient sum point-to-point and both take ``first + last`` (megatron's
  word-embedding all-reduce). The sum is kept apart from the reduce buffer and
  written into it only when the step's gradients are set, so a commit retried
  after a failure sums the same reduced values again.
* **The replica's gradient norm**: each shard's sum of squares of its reduced
  gradient sum (each parameter counted once), which the step's commit adds up
  over the leading replica's shards; :attr:`ElasticDataParallel.grad_norm
  <unicron_elastic.strategy.elastic_dp.ElasticDataParallel.grad_norm>` divides
  its square root by B.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from unicron_elastic.api import ConfigError
from unicron_elastic.strategy.replicas import ModelParallel
from unicron_elastic.strategy.tied import TiedWeight, find_tied, norm_ranges, squared_norm

TIED_TAG = 7  # point-to-point tag of the tied weight's exchange (the pipeline's activations use 0)

Waiting = Callable[[str], AbstractContextManager[None]]


class ReplicaSums:
    """This shard's part of the tied weight's gradient sum and of the replica's gradient norm.

    Args:
        params: The parameters the engine sums, in its order.
        names: Their names.
        layout: The model's tensor x pipeline parallelism.
        rank: This launch rank.

    Raises:
        ConfigError: A weight tied across stages that cannot be kept tied (:func:`~unicron_elastic.strategy.tied.find_tied`).
    """

    def __init__(self, params: list[torch.nn.Parameter], names: list[str], layout: ModelParallel, rank: int) -> None:
        self.layout, self.rank = layout, rank
        self.stage = layout.stage(rank)
        self.tied: TiedWeight | None = find_tied(params, names, self.stage, layout.pipeline)
        self.params = params
        offsets = [0]
        for p in params:
            offsets.append(offsets[-1] + p.numel())
        self._offsets = offsets
        skip = self.tied.index if self.tied is not None else None
        self.ranges = norm_ranges(params, layout.tensor_rank(rank), skip=skip)
        self._tied_sum: torch.Tensor | None = None

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

    def squared_norm(self, reduced: torch.Tensor) -> float:
        """This shard's part of the replica's squared gradient norm (of the reduced sums, before / B)."""
        total = squared_norm(reduced, self.ranges)
        if self.tied is not None and self.tied.first and self._tied_sum is not None:
            total += squared_norm(self._tied_sum, [(0, self._tied_sum.numel())])
        return total

    def apply(self, reduced: torch.Tensor) -> None:
        """Write the tied weight's summed gradient into the reduced sum (the step's gradients are being set)."""
        if self._tied_sum is None:
            return
        start, end = self.span()
        reduced[start:end].copy_(self._tied_sum)
        self._tied_sum = None
