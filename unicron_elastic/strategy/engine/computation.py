"""A rank's micro-batches of one step: forward and backward, gradients summed into the engine's buffer.

:class:`Computation` runs the micro-batches the protocol deals this rank
(its ``Compute`` effect), one after the other or, with pipeline
parallelism, through the replica's pipeline (our schedule over gloo
point-to-point). Gradients accumulate into the gradient buffer
(:class:`~unicron_elastic.strategy.engine.gradients.GradientBuffer`), whose
sums survive a failed reduction; the step's totals (loss sum, token count)
ride after them (:meth:`Computation.record`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist

from unicron_elastic.strategy.engine.engine_options import FaultPoint, StageFn
from unicron_elastic.strategy.engine.gradients import GradientBuffer
from unicron_elastic.strategy.engine.microbatch import GlobalBatchPlan
from unicron_elastic.strategy.engine.overlap import BucketLauncher
from unicron_elastic.strategy.engine.pipeline import StageLinks, forward_only, run_pipeline, schedule_for
from unicron_elastic.strategy.engine.replicas import ModelParallel

__all__ = ["Computation"]


class Computation:
    """This rank's forward and backward passes of the micro-batches dealt to it.

    Args:
        layout: The model's tensor x pipeline parallelism.
        rank: This launch rank.
        batch: ``indices -> batch`` (materialises any micro-batch).
        loss_fn: ``(model, batch) -> loss`` (pipeline parallelism: ``stage_fn``).
        stage_fn: With PP > 1, a stage's output for one micro-batch (the loss on the last stage).
        fault_point: Called before each micro-batch (fault injection).
        pipeline_schedule: ``"1f1b"`` or ``"gpipe"``.
        waiting: The group watch's context for a wait on a peer (``GroupWatch.waiting``).
        device: Where the pipeline's activations travel (the transport's device).
    """

    def __init__(self, layout: ModelParallel, rank: int, batch: Callable[[list[int]], Any],
                 loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None, stage_fn: StageFn | None,
                 fault_point: FaultPoint, pipeline_schedule: str,
                 waiting: Callable[[str], AbstractContextManager[None]], device: torch.device) -> None:
        self.layout, self.rank = layout, rank
        self.batch, self.loss_fn, self.stage_fn = batch, loss_fn, stage_fn
        self.fault_point, self.pipeline_schedule, self.waiting = fault_point, pipeline_schedule, waiting
        self.device = device
        self.model: torch.nn.Module | None = None
        self.gradients: GradientBuffer | None = None
        self.launcher: BucketLauncher | None = None
        #: Called before each micro-batch's backward and at the end of each computation: an overlapped gather of the
        #: parameters (:class:`~unicron_elastic.strategy.engine.param_gather.OverlappedGather`) is finished there.
        self.settle: Callable[[], None] = lambda: None
        #: ``(step, j)``: the micro-batch whose forward runs now (``batch``, ``loss_fn`` and ``stage_fn`` may read it).
        self.current_micro_batch: tuple[int, int] | None = None
        #: Steps whose recomputation ran this stage forward only (PP, after a failure in the reduction).
        self.forward_only: list[int] = []
        self._extras: torch.Tensor | None = None

    def bind(self, model: torch.nn.Module, gradients: GradientBuffer, launcher: BucketLauncher | None = None) -> None:
        """The model whose micro-batches run, the buffer its gradients sum into and what starts its buckets from
        the last micro-batch's backward (None: nothing)."""
        self.model, self.gradients, self.launcher = model, gradients, launcher

    def run(self, step: int, micro_batches: list[int], redo: bool, batch_plan: GlobalBatchPlan, backward: set[int],
            every_rank: dist.ProcessGroup | None, members: list[int]) -> torch.Tensor:
        """Compute ``micro_batches`` of ``step`` and return this rank's sum (gradients, then the totals).

        Args:
            step: The step.
            micro_batches: The micro-batches dealt to this rank.
            redo: A recomputation after a failure (the sum's buffer is not reused).
            batch_plan: The global-batch plan (which samples each micro-batch holds).
            backward: With PP > 1, the stages whose backward is needed (a recomputation may need fewer).
            every_rank: With PP > 1, the group the pipeline's stages talk in.
            members: The data-parallel members (replicas).

        Raises:
            RuntimeError: A collective of the model failed, or the group is gone (pipeline).
        """
        gradients = self.gradients
        assert gradients is not None  # A model is bound before any step.
        total, views = gradients.zeros(reuse=not redo)
        bound = gradients.bind(views)
        self._extras = gradients.extras_of(total) if gradients.extras else None
        try:
            if self.layout.pipeline > 1:
                self._pipeline(step, micro_batches, batch_plan, views, bound, backward, every_rank, members)
            else:
                # (not beside megatron's float32 main_grad buffers, which are added to a float64 sum afterwards)
                hooks = self.launcher is not None and not redo and (bound or not gradients.main_grad)
                last = micro_batches[-1] if micro_batches and hooks else None
                for j in self._each(step, micro_batches):
                    if j == last:  # its backward starts each bucket once summed
                        self.launcher.arm(step, total, views, adds=not bound)
                    loss = self.loss_fn(self.model, self.batch(batch_plan.indices(step, j)))
                    self.settle()  # (an overlapped gather: every parameter written before backward reads it)
                    loss.backward()
                    if not bound:
                        gradients.accumulate(views)
            self.settle()
            if bound:
                # A .grad that is not its view (a hook set it to None) is added here.
                gradients.accumulate(views)
        finally:
            if self.launcher is not None:
                self.launcher.disarm()
            gradients.release()
            self._extras = None
        return total

    def _each(self, step: int, micro_batches: list[int]) -> Iterator[int]:
        for j in micro_batches:
            self.current_micro_batch = (step, j)
            self.fault_point(self.rank, step, micro_batch=j)
            yield j

    def record(self, totals: torch.Tensor) -> None:
        """Add one micro-batch's totals (:meth:`TotalsLayout.encode
        <unicron_elastic.strategy.engine.step_totals.TotalsLayout.encode>`) to the running computation's sum.

        Called by the loss function (or the last stage's) of each micro-batch it computes.

        Raises:
            RuntimeError: No computation of micro-batches is running, or the model was bound without totals.
        """
        if self._extras is None:
            raise RuntimeError("record(): no micro-batch is being computed, or the engine carries no step totals")
        self._extras.add_(totals.to(self._extras.dtype))

    def _pipeline(self, step: int, micro_batches: list[int], batch_plan: GlobalBatchPlan, views: list[torch.Tensor],
                  bound: bool, backward: set[int], every_rank: dist.ProcessGroup | None, members: list[int]) -> None:
        """This stage's part of ``micro_batches`` through the replica's pipeline.

        In a recomputation the stages below every stage that still needs
        gradients run forward only, and nothing runs when every stage kept
        its reduced buckets. ``bound``: autograd sums into ``views`` itself.
        """
        layout = self.layout
        stage, stages = layout.stage(self.rank), layout.pipeline
        if not backward or not micro_batches:
            return
        if every_rank is None:
            raise RuntimeError("the group failed before this stage's pipeline ran")
        if stage in backward:
            ops = schedule_for(self.pipeline_schedule, stage, stages, len(micro_batches))
        else:
            # This stage and every stage before it kept their reduced buckets: only later stages need it.
            ops = forward_only(len(micro_batches))
            self.forward_only.append(step)
        links = StageLinks(layout.neighbour(members, self.rank, stage - 1) if stage > 0 else None,
                           layout.neighbour(members, self.rank, stage + 1) if stage < stages - 1 else None,
                           every_rank, send_gradients=stage - 1 in backward, waiting=self.waiting)

        def forward(position: int, received: torch.Tensor | None) -> torch.Tensor:
            j = micro_batches[position]
            self.current_micro_batch = (step, j)
            self.fault_point(self.rank, step, micro_batch=j)
            return self.stage_fn(self.model, self.batch(batch_plan.indices(step, j)), received)

        gradients = self.gradients
        run_pipeline(forward, ops, links, self.device,
                     on_backward=None if bound else lambda _: gradients.accumulate(views))
