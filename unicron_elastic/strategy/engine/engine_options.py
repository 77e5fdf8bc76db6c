"""The elastic engine's settings and the callbacks it calls: what :class:`ElasticDataParallel` is built with.

A leaf module of frozen dataclasses, so callers (the Lightning strategy, the
examples, tests) state a setting by name without importing the engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from unicron_elastic.api import ConfigError

if TYPE_CHECKING:
    import torch.distributed as dist

    from unicron_elastic.strategy.engine.replicas import ModelParallel
    from unicron_elastic.strategy.engine.step_totals import TotalsLayout
    from unicron_elastic.strategy.engine.transport import CollectiveTransport
    from unicron_elastic.strategy.engine.group_watch import WatchTimes

#: ``fault_point(rank, step, micro_batch=j | bucket=k | at=...)``: a fault-injection point.
FaultPoint = Callable[..., None]
#: ``stage_fn(model, batch, input)``: a pipeline stage's output for one micro-batch (the loss on the last stage).
StageFn = Callable[[torch.nn.Module, Any, "torch.Tensor | None"], torch.Tensor]


class GroupListener(ABC):
    """What is built over the same members as the engine's groups, each generation (the Lightning strategy's world).

    :class:`~unicron_elastic.strategy.engine.groups.GenerationGroups` calls it
    after it built the engine's groups of a generation, and before it aborts them.
    """

    @abstractmethod
    def on_configure(self, store: dist.Store, generation: int, members: list[int]) -> None:
        """Build what uses the members ``members`` (replicas with TP/PP) of ``generation``.

        Args:
            store: The generation's bootstrap store (it stops waiting for a member whose liveness key is gone).
            generation: The generation of the groups just built.
            members: The data-parallel members (replicas with TP/PP).

        Raises:
            RuntimeError: A member is gone while it forms (the engine gives this generation up and regroups).
        """

    @abstractmethod
    def on_abort(self) -> None:
        """The engine's groups are being aborted (a failure, or ``close()``): abort what uses the same members.

        A rank blocked in one of them with this rank then fails at once (a tensor-parallel collective would
        otherwise keep a survivor waiting until its timeout).
        """


@dataclass(frozen=True)
class EngineOptions:
    """How the engine reduces, waits and lays out the model.

    Attributes:
        bucket_numel: Elements per gradient bucket (None: one bucket).
        timeout: Timeout of collectives.
        checkin_timeout: After a failure, how long survivors wait for a rank that is alive but has
            not checked in (a stuck one: it is then left out and rejoins). Dead ranks are not waited for.
        grad_dtype: Dtype of the gradient sums and their all-reduce. float64
            makes the result independent of who computed which micro-batch
            (float32 sums depend on the order: after a failure the last bits
            differ, and Adam-like optimizers amplify that).
        max_world: Ranks ``0..max_world-1`` may ask to join (default
            ``world_size``; more when nodes may grow the run: ``$UNICRON_MAX_WORLD``).
        model_parallel: Tensor x pipeline parallel layout (default: none, TP = PP = 1).
        pipeline_schedule: ``"1f1b"`` (default) or ``"gpipe"``.
        transport: Makes and aborts the engine's groups (default: gloo).
        watch_times: When a wait is reported and the members' liveness checked.
        optimizer_instances: Shard the optimizer's state over the data-parallel members, in this many
            instances that each hold all of it (Megatron-LM's distributed optimizer with
            ``num_distributed_optimizer_instances``; :mod:`~unicron_elastic.strategy.engine.optimizer_shards`).
            None: every member keeps the whole state.
        overlap_grad_reduce: Start each bucket's all-reduce from backward as soon as its gradients are summed
            (Megatron-LM's ``--overlap-grad-reduce``; :mod:`~unicron_elastic.strategy.engine.overlap`).
            False: the buckets start when the reduction begins (still without waiting for each other).
        reduce_dtype: The dtype of the gradient buckets on the wire (None: ``grad_dtype``). ``torch.bfloat16``
            is Megatron-LM's ``--grad-reduce-in-bf16``: every bucket but the last (which holds the step's totals
            and the exchange's slots) is all-reduced in bfloat16 and widened back; the local sums stay in
            ``grad_dtype``.
        overlap_param_gather: (With ``optimizer_instances``, TP = PP = 1) start the gather of the updated
            parameters after each optimizer step and wait for each piece before the first module that uses it
            computes, in the next step's forward (Megatron-LM's ``--overlap-param-gather``;
            :mod:`~unicron_elastic.strategy.engine.param_gather`). Between steps the model then holds the
            previous step's parameters, until :meth:`ElasticDataParallel.refresh` or the next step's forward.
        reduce_scatter: (With ``optimizer_instances=1``, TP = PP = 1) reduce-scatter the gradient buckets, as
            megatron-core's distributed optimizer does: each member receives only its share's reduced sum (the
            local sums stay whole), the model's parameters get no ``.grad`` (the shares load the reduced share;
            clip with :meth:`~unicron_elastic.strategy.engine.reduction.StepReduction.clip_grad_norm_`, with
            ``measure_norm`` set), and the
            reduce buffer is a share (1/DP) of the flat sum. False: every member receives the whole reduced sum.
    """

    bucket_numel: int | None = None
    timeout: timedelta = timedelta(seconds=30)
    checkin_timeout: float = 10.0
    grad_dtype: torch.dtype = torch.float32
    max_world: int | None = None
    model_parallel: ModelParallel | None = None
    pipeline_schedule: str = "1f1b"
    transport: CollectiveTransport | None = None
    watch_times: WatchTimes | None = None
    optimizer_instances: int | None = None
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = False
    reduce_dtype: torch.dtype | None = None
    reduce_scatter: bool = False

    def __post_init__(self) -> None:
        """Refuse settings that cannot work together.

        Raises:
            ConfigError: ``overlap_param_gather`` without ``optimizer_instances``, or with TP x PP > 1;
                ``reduce_scatter`` without ``optimizer_instances=1``, or with TP x PP > 1; a ``reduce_dtype``
                other than None and ``torch.bfloat16``.
        """
        if self.reduce_dtype not in (None, torch.bfloat16):
            raise ConfigError(f"reduce_dtype={self.reduce_dtype}: None (grad_dtype) or torch.bfloat16 "
                              "(Megatron-LM's --grad-reduce-in-bf16)")
        size = self.model_parallel.size if self.model_parallel is not None else 1
        if self.overlap_param_gather and (self.optimizer_instances is None or size > 1):
            raise ConfigError(f"overlap_param_gather needs optimizer_instances and TP x PP = 1 (got {size}): with "
                              "TP x PP > 1 the shards agree that every gather completed before computing")
        if self.reduce_scatter and (self.optimizer_instances != 1 or size > 1):
            raise ConfigError(f"reduce_scatter needs optimizer_instances=1 and TP x PP = 1 (got "
                              f"{self.optimizer_instances} and {size}): with copies of the shares every copy's "
                              "holder needs the share's sum, and TP x PP > 1 reduces the whole sum over the "
                              "tensor group and the tied weights' stages")


@dataclass(frozen=True)
class EngineHooks:
    """What the engine calls back (each optional).

    Attributes:
        fault_point: Called as ``fault_point(rank, step, micro_batch=j)`` before each
            micro-batch (its forward, with PP), ``fault_point(rank, step, bucket=k)``
            right before bucket k's all-reduce starts (from backward, when the reduction begins, or before
            the reduction waits for it), ``fault_point(rank, -1, at="before_first_group")``
            before the first group is built, ``at="backward"`` right after bucket 0's all-reduce started
            from the last micro-batch's backward, and ``at="before_optimizer_step"`` / ``"after_optimizer_step"``
            around :meth:`train_step`'s optimizer step (fault injection: ``unicron_elastic.faults.maybe_fail``).
        stage_fn: With ``pipeline > 1``: ``stage_fn(model, batch, input)``, this
            stage's output for one micro-batch (``input`` is None on the first
            stage, the previous stage's output otherwise); the loss on the last stage.
        get_state: The state a replica hands to a joiner (default: model,
            optimizer, RNG); the step is added.
        set_state: Loads what ``get_state`` returned (default: the inverse).
        group_listener: Built and aborted with the engine's groups of each generation
            (:class:`GroupListener`: the Lightning strategy's world and megatron-core's groups).
        fallback: Called by a joiner when no replica is left (every member is
            waiting to join): returns the state to resume from (in-memory
            snapshot, then persisted checkpoint) or None. With TP/PP the
            other shards of the resuming replica call it as ``fallback(step)``:
            their shard's state of that step.
        pause: Called as ``pause(True, bound_s)`` when a regroup begins and
            ``pause(False, None)`` when it ends (e.g. ``Worker.set_paused``:
            a regroup is a declared pause for the hang detector, bounded so a
            rank stuck in it is still found).
        report_waiting: Called as ``report_waiting(True)`` (repeated) while this
            rank waits on its group for a peer, ``report_waiting(False)`` when
            the wait ends (e.g. ``Worker.waiting``: the hang detector spares
            it and blames the peer that went silent); see :mod:`~unicron_elastic.strategy.engine.group_watch`.
        overflow: With a loss scaler: ``overflow(reduced_sum, B)``, whether this shard's
            reduced sum is not finite once unscaled (see :mod:`~unicron_elastic.strategy.lightning.precision`).
    """

    fault_point: FaultPoint | None = None
    stage_fn: StageFn | None = None
    get_state: Callable[[], dict[str, Any]] | None = None
    set_state: Callable[[dict[str, Any]], None] | None = None
    group_listener: GroupListener | None = None
    fallback: Callable[..., dict[str, Any] | None] | None = None
    pause: Callable[[bool, float | None], None] | None = None
    report_waiting: Callable[[bool], None] | None = None
    overflow: Callable[[torch.Tensor, int], bool] | None = None


@dataclass(frozen=True)
class TensorReduced:
    """The parameters (positions among those the engine sums) whose gradients are reduced over the tensor group.

    megatron-core's ``finalize_model_grads`` (``_allreduce_non_tensor_model_parallel_grads``) does it for
    parameters every tensor rank holds whole but computes only part of the gradient of.

    Attributes:
        summed: Summed (``sequence_parallel`` parameters with sequence parallelism, q/k layer-norm weights).
        averaged: Averaged (``average_gradients_across_tp_domain``).
    """

    summed: tuple[int, ...] = ()
    averaged: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.summed or self.averaged)

    def reversed_in(self, count: int) -> TensorReduced:
        """The same parameters as positions among ``count`` taken in the reverse order."""
        return TensorReduced(tuple(count - 1 - i for i in self.summed), tuple(count - 1 - i for i in self.averaged))


@dataclass(frozen=True)
class ModelReductions:
    """What a model asks of each step besides the data-parallel sum (given with the model, to ``bind``).

    Attributes:
        tensor_reduced: Gradients reduced over the tensor group (TP > 1).
        totals: Carry the step's totals (count, loss sum, report sums) in the gradient sums
            (:mod:`~unicron_elastic.strategy.engine.step_totals`); None: none.
        per_token: Divide the gradients by the step's token count (the totals' count), not by B.
        main_grad: Give every parameter a ``main_grad`` backed by the gradient sum (gradient-accumulation fusion).
        check_finite: Stop with :class:`~unicron_elastic.api.NonFiniteError` when a rank's loss or gradient sums
            are not finite (no loss scaler to skip the step).
    """

    tensor_reduced: TensorReduced = TensorReduced()
    totals: TotalsLayout | None = None
    per_token: bool = False
    main_grad: bool = False
    check_finite: bool = False
