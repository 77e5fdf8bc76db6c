"""One micro-batch under Lightning, as the elastic engine computes it: its batch, its loss, a pipeline stage's forward.

:class:`MicroBatchForward` gives the engine what it calls for each
micro-batch: the batch (from the feed, through Lightning's transfer and the
precision's input conversion), the loss of the LightningModule's
``training_step`` or, with PP > 1, this stage's forward; each runs under the
micro-batch's own random streams and the precision's autocast. It keeps the
step's losses for Lightning's closure and logs the step's totals in
Megatron-LM's shape.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from unicron_elastic.api import ConfigError
from unicron_elastic.strategy.lightning.feed import MicroBatchFeed
from unicron_elastic.strategy.lightning.precision import scaled
from unicron_elastic.strategy.lightning.stages import MegatronStage, MicroBatchLoss, micro_batch_loss

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

    from unicron_elastic.strategy.engine.elastic_dp import ElasticDataParallel
    from unicron_elastic.strategy.engine.microbatch import GlobalBatchPlan
    from unicron_elastic.strategy.engine.replicas import ModelParallel
    from unicron_elastic.strategy.lightning.random_streams import RandomStreams

__all__ = ["MicroBatchForward", "megatron_shape"]


def megatron_shape(module: Any) -> bool:
    """Whether the module gives its step in Megatron-LM's shape (``forward_step``): the strategy logs its loss."""
    return callable(getattr(module, "forward_step", None))


class MicroBatchForward:
    """This rank's computation of micro-batches for the engine.

    Args:
        streams: This rank's random streams.
        layout: The model's tensor x pipeline parallelism.
        rank: This launch rank.
        device: The strategy's root device.
        precision: Returns Lightning's precision plugin.
        to_device: Lightning's ``batch_to_device`` (the module's transfer hooks).

    Attributes:
        engine: The elastic engine (set once it is built: it is built with this object's methods).
        feed: Where micro-batches come from (None before the train dataloader).
    """

    def __init__(self, streams: RandomStreams, layout: ModelParallel, rank: int, device: torch.device,
                 precision: Callable[[], Any], to_device: Callable[[Any, torch.device], Any]) -> None:
        self.streams, self.layout, self.rank, self.device = streams, layout, rank, device
        self.precision, self.to_device = precision, to_device
        self.stage = layout.stage(rank)
        self.engine: ElasticDataParallel | None = None
        self.feed: MicroBatchFeed | None = None
        self._stage_fn: Callable[[Any, torch.Tensor | None], Any] | None = None
        self._losses: list[torch.Tensor] = []

    def use(self, dataloader: DataLoader, batch_plan: GlobalBatchPlan, replica: int) -> None:
        """Feed micro-batches from the train dataloader's dataset and settings (a previous feed is closed).

        Every rank of a replica computes the replica's micro-batches (TP: the same inputs; PP: each stage's part).

        Args:
            dataloader: The train dataloader.
            batch_plan: The global-batch plan over its dataset.
            replica: This rank's data-parallel replica.
        """
        self.close()
        engine = self.engine
        self.feed = MicroBatchFeed(dataloader, batch_plan, replica, lambda: engine.members)

    def bind_stage(self, module: Any) -> None:
        """With PP > 1: this stage's forward, the module's ``forward_step`` or its ``pipeline_forward``.

        Raises:
            ConfigError: See :class:`~unicron_elastic.strategy.lightning.stages.MegatronStage`.
        """
        if self.layout.pipeline == 1:
            return
        last = self.stage == self.layout.pipeline - 1
        self._stage_fn = MegatronStage(module, last) if megatron_shape(module) else module.pipeline_forward

    def batch(self, indices: list[int]) -> Any:
        """The batch of the micro-batch being computed (samples ``indices``), on this rank's device.

        It goes through Lightning's transfer (the module's ``on_before/after_batch_transfer`` hooks) on
        every device alike, then the precision's input conversion, as Lightning's loop does for each batch.
        """
        assert self.feed is not None, "no train dataloader was processed"
        step, j = self.engine.computation.current_micro_batch
        batch = self.to_device(self.feed.get(step, j, indices), self.device)
        return self.precision().convert_input(batch)

    def loss(self, module: Any, batch: Any) -> torch.Tensor:
        """What the backward of one micro-batch runs on: the loss of the module's ``training_step`` (PP = 1).

        Raises:
            ConfigError: See :meth:`_backward_loss`.
        """
        j = self.engine.computation.current_micro_batch[1]
        # The precision's autocast covers the forward only.
        with self._rng(0), self.precision().train_step_context():
            loss = micro_batch_loss(module.training_step(batch, j))
        return self._backward_loss(loss)

    def stage_forward(self, module: Any, batch: Any, input_tensor: torch.Tensor | None) -> torch.Tensor:
        """One micro-batch through this rank's pipeline stage; the loss on the last.

        The module's ``forward_step`` in Megatron-LM's shape
        (:class:`~unicron_elastic.strategy.lightning.stages.MegatronStage`), or its
        ``pipeline_forward(batch, input_tensor)``.

        Raises:
            ConfigError: The last stage's ``pipeline_forward`` returned no loss, or another stage no tensor.
        """
        with self._rng(self.stage), self.precision().train_step_context():
            output = self._stage_fn(batch, input_tensor)
        if self.stage == self.layout.pipeline - 1:
            return self._backward_loss(micro_batch_loss(output))
        if not isinstance(output, torch.Tensor):
            raise ConfigError(f"pipeline_forward on stage {self.stage} must return the activations for the next "
                              f"stage (a tensor), got {type(output).__name__}")
        return output

    def begin_step(self) -> None:
        """Forget the losses of the previous step."""
        self._losses = []

    def step_loss(self) -> torch.Tensor:
        """The mean loss of this rank's micro-batches of the step (zero when it computed none)."""
        return torch.stack(self._losses).mean() if self._losses else torch.zeros(())

    def log_totals(self, module: Any) -> None:
        """(Megatron-LM's shape) log the step's loss and report over its whole global batch, as Megatron-LM logs them.

        ``train_loss`` is the loss (with per-token loss the token-weighted
        mean), then each report key (``lm loss``). Every rank holds the same
        values: the step's reduce or commit summed them.

        Args:
            module: The LightningModule (it logs).
        """
        totals = self.engine.reduction.totals
        if totals is None or not megatron_shape(module):
            return
        for name, value in {"train_loss": totals.loss, **totals.reported()}.items():
            module.log(name, value, on_step=True, on_epoch=False, batch_size=1)

    def close(self) -> None:
        """Close the feed, if any (the DataLoader's worker processes)."""
        if self.feed is not None:
            self.feed.close()

    def _rng(self, stage: int) -> AbstractContextManager[None]:
        """The random streams of the micro-batch being computed (with PP > 1, of this stage)."""
        step, j = self.engine.computation.current_micro_batch
        stage_seed = stage if self.layout.pipeline > 1 else None
        return self.streams.micro_batch(step, j, stage_seed, self.device, self.layout.tensor_rank(self.rank))

    def _backward_loss(self, loss: MicroBatchLoss) -> torch.Tensor:
        """What one micro-batch's backward runs on (with a loss scaler, ``16-mixed``, the scaled loss).

        The micro-batch's totals go into the step's (:mod:`~unicron_elastic.strategy.engine.step_totals`).

        Raises:
            ConfigError: Per-token loss without a token count, or a report with other keys than ``report_keys``.
        """
        reductions = self.engine.reductions
        per_token = reductions.per_token
        backward = loss.to_backward(per_token)
        self._losses.append(loss.mean.detach())
        if reductions.totals is not None:
            self.engine.computation.record(reductions.totals.encode(loss.count(per_token), backward, loss.report))
        return scaled(self.precision(), backward)
