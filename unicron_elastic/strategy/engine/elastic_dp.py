"""Data parallelism that survives the loss of ranks in the middle of a step (paper section 6).

:class:`ElasticDataParallel` runs one optimizer step as: compute this rank's
micro-batches (``deal``), accumulating gradients; all-reduce them bucket by
bucket (on copies: the local sums stay intact); divide by B; step. Gradients
are summed over micro-batches and divided by B, not by the DP size, so the
result does not depend on which rank computed which micro-batch.

When a peer dies (gloo raises on the broken connection):

* survivors destroy the broken group at once (closing its connections, so
  survivors blocked on *them* fail too), check in under a new *generation*
  with their step and the number of its buckets they completed, and follow
  that generation's membership record, written once by whichever survivor
  decides it first (:mod:`~unicron_elastic.strategy.engine.membership`): a rank is
  left out when it is known dead (its liveness key is gone), when it is
  behind (the last bucket completed on others, who already stepped), or, if
  alive but stuck, when it missed the check-in deadline - it then rejoins
  (:class:`Excluded`);
* a group is built only once every member of the record checked in (a
  member that will not come - dead, behind - makes the others regroup under
  the next generation instead of waiting for gloo's timeout);
* scenario 1 (before the all-reduce, or in its first bucket): every bucket is
  redone; the dead rank's micro-batches are dealt round-robin to survivors,
  who add their gradients to the sums they kept;
* scenario 2 (during a bucketed all-reduce): buckets every survivor completed
  keep their reduced values (they contain the dead rank's part); the dead
  rank's micro-batches are recomputed and only the unreduced buckets are
  reduced again.

Reconfiguration happens between steps: the group's primary (lowest member)
proposes each step's membership (following a ``member_schedule`` given by
hand, if any) and, when it changes, writes the next generation's record create-only
(a *resize* record; a failure's record written first wins); ranks that are no
longer members retire; new ranks (``joining=True``, e.g. a worker the agent
restarted) ask to join; without a member schedule the primary admits them at the next
step boundary, with one the member schedule alone decides.
They receive the state (by default model, optimizer, RNG; the Lightning
strategy sends its whole checkpoint dict) and the step by broadcast from the
primary, a healthy replica. When no replica is left, the lowest joiner resumes
from ``fallback()`` and hands that state to the others. The global batch stays
the same, so the parameter trajectory does not depend on the DP size.

Several ranks may die at once (a node), and a rank may die during the
recovery from another failure: the next collective fails and the survivors
regroup again under the next generation.

With tensor/pipeline parallelism (``model_parallel``, TP x PP = C > 1) each
rank runs the engine for its *shard*: the protocol runs in
replica space with one membership authority for every shard
(:mod:`~unicron_elastic.strategy.engine.replicas`), each shard's data-parallel group
reduces that shard's buckets as soon as its part of the step is computed
(with PP, when the stage's backward is done), and a last, small all-reduce
over the whole world *commits* the step and carries the next step's members:
no shard steps its optimizer before every shard reduced (a survivor may have
to recompute a lost replica's micro-batches through every stage). A rank
whose model collectives fail (a TP/PP peer of its replica is lost) checks in
broken; its replica is left out and rejoins with the state of the matching
shard of another replica. A failure after some stages reduced keeps those
stages' buckets (per shard) and recomputes only what the unreduced
stages need: stages below every unreduced stage run forward only.

With pipeline parallelism a weight tied across the first and the last stage
(megatron-core's shared word embedding) has its reduced gradient sums added
over both stages before the commit, and the commit also carries the primary
replica's squared gradient norm (:mod:`~unicron_elastic.strategy.engine.stage_sums`,
:attr:`StepReduction.grad_norm <unicron_elastic.strategy.engine.reduction.StepReduction.grad_norm>`).

With tensor parallelism the gradients megatron-core reduces over the tensor
group (sequence-parallel parameters, q/k layer norms) are reduced there too,
after the data-parallel reduce and before the commit
(:class:`~unicron_elastic.strategy.engine.stage_sums.ReplicaSums`).

With a loss scaler (``overflow``, see :mod:`~unicron_elastic.strategy.lightning.precision`)
the commit also carries each shard's verdict on its reduced gradients, so
every rank of every shard skips the same steps. Without one
(:attr:`ModelReductions.check_finite <unicron_elastic.strategy.engine.engine_options.ModelReductions>`)
each rank checks its own loss and gradient sums for NaN and Inf, the step's
last exchange counts the ranks that found one, and every rank raises
:class:`~unicron_elastic.api.NonFiniteError` before the optimizer step.

The step's totals (its loss sum, token or micro-batch count, the report's
sums: :mod:`~unicron_elastic.strategy.engine.step_totals`) ride after the
gradients in the sums; with per-token loss the gradients are divided by the
step's token count instead of B.

A stop that one rank is asked for (:meth:`ElasticDataParallel.request_stop`,
e.g. on SIGTERM) rides in the same slots as the members: the step's last
exchange (the commit with TP/PP, else the last gradient bucket; also the
members' agreement when one runs) sums it, so every member sees
:attr:`StepReduction.stop_agreed <unicron_elastic.strategy.engine.reduction.StepReduction.stop_agreed>` after the same step and no extra
collective runs per step. A rank that saw it sends it on; one that stops
records it (:meth:`~ElasticDataParallel.stopping`), so ranks that regroup
because that exchange failed on them learn it when their group forms.

With ``optimizer_instances`` the optimizer's state is sharded over the
members (:mod:`~unicron_elastic.strategy.engine.optimizer_shards`): the
optimizer steps this rank's share, and the protocol's ``Refresh`` reshards
(a lost rank's share from another instance) and gathers the updated
parameters before the next step computes, after every regroup and in
:meth:`ElasticDataParallel.finish`. With ``reduce_scatter`` (one instance)
the buckets are reduce-scattered: each member receives its share's reduced
sum, the float32 parameters are views of one flat buffer
(:class:`~unicron_elastic.strategy.engine.flat_group.ParamBuffer`) so that
the main parameters are the model's own, and the gather lands in them.

The sequencing is :class:`~unicron_elastic.strategy.engine.protocol.Protocol`'s, a
state machine that yields effects. This class composes the parts that
execute them, in :func:`~unicron_elastic.strategy.engine.effect_loop.run`:
the generation's groups (:class:`~unicron_elastic.strategy.engine.groups.GenerationGroups`),
every store effect (:class:`~unicron_elastic.strategy.engine.store_effects.EngineStore`),
the micro-batches (:class:`~unicron_elastic.strategy.engine.computation.Computation`),
the step's exchanges (:class:`~unicron_elastic.strategy.engine.reduction.StepReduction`)
and the state handed to joiners (:class:`~unicron_elastic.strategy.engine.joining.StateHandout`).
``tests/fake_dp.py`` drives the same loop and the same store effects with
fake collectives and a fake clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import structlog
import torch
import torch.distributed as dist

from unicron_elastic.api import ConfigError
from unicron_elastic.strategy.engine import effects as E
from unicron_elastic.strategy.engine.computation import Computation
from unicron_elastic.strategy.engine.effect_loop import Suspended, run
from unicron_elastic.strategy.engine.effects import Excluded, ReplicaBroken, Retired, StepReport
from unicron_elastic.strategy.engine.engine_options import EngineHooks, EngineOptions, ModelReductions
from unicron_elastic.strategy.engine.gradients import GradientBuffer
from unicron_elastic.strategy.engine.group_watch import GroupWatch
from unicron_elastic.strategy.engine.groups import GenerationGroups
from unicron_elastic.strategy.engine.joining import StateHandout
from unicron_elastic.strategy.engine.microbatch import GlobalBatchPlan
from unicron_elastic.strategy.engine.flat_group import ParamBuffer
from unicron_elastic.strategy.engine.optimizer_shards import OptimizerShards
from unicron_elastic.strategy.engine.param_gather import OverlappedGather
from unicron_elastic.strategy.engine.overlap import BucketLauncher
from unicron_elastic.strategy.engine.protocol import Protocol
from unicron_elastic.strategy.engine.reduction import StepReduction
from unicron_elastic.strategy.engine.replicas import ModelParallel, stages_to_backpropagate
from unicron_elastic.strategy.engine.shard_checkpoint import collect
from unicron_elastic.strategy.engine.stage_sums import ReplicaSums
from unicron_elastic.strategy.engine.store_effects import EngineStore
from unicron_elastic.strategy.engine.transport import GlooTransport, is_peer_failure

__all__ = ["ElasticDataParallel", "EngineHooks", "EngineOptions", "Excluded", "ReplicaBroken", "Retired", "StepReport"]

log = structlog.get_logger(__name__)


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


class ElasticDataParallel:
    """One data-parallel replica of a model, resilient to the loss of peers.

    With tensor/pipeline parallelism it is this rank's shard of one replica
    (``model_parallel``): ranks, members and schedules below are then counted
    in *replicas* where they name data-parallel members (``members``,
    ``member_schedule``, :attr:`members`, :meth:`waiting`), and in launch ranks
    otherwise (``rank``, ``world_size``, ``max_world``).

    Its parts (see docs/architecture.md, "How the engine fits together"):
    :attr:`protocol`, :attr:`groups`, :attr:`store_effects`, :attr:`computation`,
    :attr:`reduction` and :attr:`handout`.

    Args:
        model: The model (same initial parameters on every rank; with TP/PP,
            this rank's shard, the same on every replica). None: given later
            to :meth:`bind` (a joiner that must be admitted, and so have its
            world, before it can build a model from megatron-core's layers:
            :meth:`start_join`).
        optimizer: Its optimizer (None with ``model``).
        batch_plan: The global-batch plan (B micro-batches per step); None until
            :attr:`batch_plan` is set (the Lightning strategy sets it in ``setup``).
        batch: ``indices -> batch`` (materialises any micro-batch).
        loss_fn: ``(model, batch) -> loss`` (mean over the micro-batch); with
            ``pipeline > 1`` see ``stage_fn``.
        store: A store every rank reaches that outlives workers (the agent's).
        rank: This launch rank.
        world_size: Launch world size (ranks).
        members: Initial members (default all; replicas with TP/PP).
        joining: This rank is not a member yet: :meth:`join` waits to be added.
        member_schedule: ``step -> members`` from that step on, given by hand (the primary applies it).
        options: Buckets, timeouts, the gradient dtype, the most ranks, the
            model's layout, the transport (:class:`~unicron_elastic.strategy.engine.engine_options.EngineOptions`).
        hooks: What the engine calls back: fault injection, a pipeline stage's
            forward, the state a joiner gets, the group listener, the fallback state,
            pauses and waits for the hang detector, the loss scaler's verdict
            (:class:`~unicron_elastic.strategy.engine.engine_options.EngineHooks`).

    Raises:
        ValueError: ``max_world`` is smaller than ``world_size``.
        ConfigError: The world is not a multiple of TP x PP, or ``pipeline > 1`` without ``stage_fn``.
    """

    def __init__(self, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None,
                 batch_plan: GlobalBatchPlan | None, batch: Callable[[list[int]], Any],
                 loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None, store: dist.Store,
                 rank: int, world_size: int, *, members: list[int] | None = None, joining: bool = False,
                 member_schedule: dict[int, list[int]] | None = None, options: EngineOptions = EngineOptions(),
                 hooks: EngineHooks = EngineHooks()) -> None:
        self.layout = layout = options.model_parallel or ModelParallel()
        if options.max_world is not None and options.max_world < world_size:
            raise ValueError(f"max_world {options.max_world} is smaller than world_size {world_size}")
        if layout.pipeline > 1 and hooks.stage_fn is None:
            raise ConfigError("a pipeline-parallel model needs stage_fn (each stage's forward of one micro-batch)")
        self.rank, self.replica, self.shard = rank, layout.replica(rank), layout.shard(rank)
        self.model, self.optimizer, self._batch_plan = model, optimizer, batch_plan
        self.grad_dtype, self.bucket_numel, self.reduce_dtype = (options.grad_dtype, options.bucket_numel,
                                                                 options.reduce_dtype)
        self.overlap_grad_reduce = options.overlap_grad_reduce
        #: Starts buckets from backward (made by :meth:`bind`; None without ``overlap_grad_reduce``, or with PP > 1).
        self.launcher: BucketLauncher | None = None
        self.fault_point = hooks.fault_point or _nothing
        self.pause = hooks.pause or _nothing
        max_replicas = max((options.max_world or world_size) // layout.size, layout.replicas(world_size))
        self.protocol = self._protocol(members, member_schedule, options, world_size)
        self.store_effects = EngineStore(store, layout, rank, max_replicas)
        self.groups = GenerationGroups(store, layout, rank, options.transport or GlooTransport(), options.timeout,
                                       hooks.group_listener)
        #: Watches this rank's waits on its groups: reports them, and gives a group up once a member is gone.
        self.watch = GroupWatch(hooks.report_waiting or _nothing, self._gone, lambda reason: self.groups.interrupt(),
                                options.watch_times)
        self.computation = Computation(layout, rank, batch, loss_fn, hooks.stage_fn, self.fault_point,
                                       options.pipeline_schedule, self.watch.waiting, self.groups.transport.device)
        self.reduction = StepReduction(self.protocol, self.groups, self.store_effects, self.watch, max_replicas,
                                       hooks.overflow, scatters=options.reduce_scatter)
        self.reduction.point = lambda step, bucket: self.fault_point(self.rank, step, bucket=bucket)
        self.handout = StateHandout.of(self.protocol, self.groups, rank, hooks, lambda: (self.model, self.optimizer))
        #: This shard's gradient sums (made by :meth:`bind`).
        self.gradients: GradientBuffer | None = None
        #: With ``optimizer_instances``: the optimizer's shares this rank holds (a joiner holds none until admitted).
        self.optimizer_shards = None if options.optimizer_instances is None else OptimizerShards(
            options.optimizer_instances, self.groups.transport.device, self.watch.waiting,
            lambda kind: self.fault_point(self.rank, self.next_step - (kind == "gather"), at=kind),
            updated=lambda: setattr(self.protocol, "stale", True), holds=not joining, wait=self.groups.transport.wait)
        if options.overlap_param_gather:  # (with optimizer_instances: EngineOptions checks)
            self.optimizer_shards.overlapped = OverlappedGather(self.groups, self.watch.waiting, options.bucket_numel)
        self._joining: tuple[Any, Any] | None = None
        self._handlers = self._effect_handlers()
        if model is not None:
            self.bind(model, optimizer)
        if not joining:
            self._first_groups(model is not None)

    def _protocol(self, members: list[int] | None, member_schedule: dict[int, list[int]] | None,
                  options: EngineOptions, world_size: int) -> Protocol:
        """The protocol, in replica space; its buckets are counted when the model is bound (:meth:`bind`)."""
        initial = list(members if members is not None else range(self.layout.replicas(world_size)))
        batch_plan = self._batch_plan
        return Protocol(rank=self.replica, members=initial,
                        micro_batches=batch_plan.num_micro_batches if batch_plan is not None else 0, buckets=0,
                        member_schedule=member_schedule, checkin_timeout=options.checkin_timeout,
                        collective_timeout=options.timeout.total_seconds(), authority=self.shard == 0,
                        compute_needs_group=self.layout.size > 1, sharded=options.optimizer_instances is not None,
                        overlap_gather=options.overlap_param_gather, scatters=options.reduce_scatter)

    def _first_groups(self, tie: bool) -> None:
        """(A member from the start) build generation 0's groups and publish the members."""
        self.fault_point(self.rank, -1, at="before_first_group")
        try:
            self.groups.configure(self.generation, self.members)
        except BaseException:
            # The listener's world failed after the engine's groups formed: a gloo group left alive when the
            # interpreter shuts down can abort the process (see close()).
            self.close()
            raise
        self.store_effects.formed(self.generation, self.members, read_stop=False)
        if tie:
            self.reduction.tie()

    def bind(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             reductions: ModelReductions | None = None) -> None:
        """Give the engine its model and optimizer (when it was made without): its gradient buckets.

        Args:
            model: The model (this rank's shard).
            optimizer: Its optimizer.
            reductions: What the model asks of each step besides the data-parallel sum (default: nothing).

        Raises:
            ConfigError: The model has no parameter that requires a gradient, or holds a weight tied across
                pipeline stages that cannot be kept tied.
        """
        reductions = reductions or ModelReductions()
        # The flat sum in the reverse of the registration order (as torch's and megatron-core's DDP bucket):
        # backward computes the last layers' gradients first, and they fill bucket 0.
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad][::-1]
        extras = reductions.totals.size if reductions.totals is not None else 0
        self.gradients = GradientBuffer([p for _, p in named], self.grad_dtype, self.bucket_numel, extras=extras,
                                        main_grad=reductions.main_grad, half_main_grads=self.optimizer_shards is not None,
                                        wire_dtype=self.reduce_dtype)
        committed = self.reduction.committed
        sums = ReplicaSums(self.gradients.params, [name for name, _ in named], self.layout, self.rank,
                           reductions.tensor_reduced.reversed_in(len(named))) if committed else None
        self.reduction.bind(self.gradients, sums, reductions)
        if self.launcher is not None:
            self.launcher.remove()
        self.launcher = BucketLauncher(
            self.gradients, self.reduction.launchable, self.reduction.start,
            lambda step, bucket: self.fault_point(self.rank, step, at="backward") if bucket == 0 else None,
        ) if self.overlap_grad_reduce and self.layout.pipeline == 1 else None
        self.computation.bind(model, self.gradients, self.launcher)
        self.model, self.optimizer = model, optimizer
        if self.optimizer_shards is not None:
            if self.reduction.scatters:  # (float32 parameters: the main parameters are views of them)
                self.optimizer_shards.param_buffer = ParamBuffer.of(self.gradients.params)
            self.optimizer_shards.bind(optimizer, self.gradients.params, self.members, self.replica)
            if self.optimizer_shards.overlapped is not None:  # each module waits for its pieces; backward for all
                self.optimizer_shards.overlapped.bind(model)
                self.computation.settle = self.optimizer_shards.overlapped.finish
            self.handout.on_fresh = self.optimizer_shards.hold_fresh  # (a group restarting from step 0)
            if self.reduction.scatters:  # the shares load their reduced sums from the reduce buffer
                self.optimizer_shards.reduced_share = lambda g=self.gradients: (
                    None if g.reduced is None or g.scatter is None else (g.reduced_sum(), g.scatter))
            # A checkpoint's optimizer state: every share, on the rank of replica 0 (the one Lightning writes with).
            self.optimizer_shards.collector = lambda: collect(
                self.optimizer_shards, self.groups.shard, self.members.index(0) if 0 in self.members else 0)
        self.protocol.buckets = len(self.gradients.bounds) + committed
        if committed:
            self.store_effects.set_buckets(len(self.gradients.bounds))

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """The parameters whose gradients the engine sums, in the model's order (none before :meth:`bind`)."""
        return [] if self.gradients is None else self.gradients.params[::-1]

    @property
    def reductions(self) -> ModelReductions:
        """What the model asks of each step besides the data-parallel sum (given to :meth:`bind`)."""
        return self.reduction.reductions

    # -- the protocol's state ----------------------------------------------------------
    @property
    def members(self) -> list[int]:
        """The members of this rank's group (replicas with TP/PP)."""
        return self.protocol.members

    @property
    def generation(self) -> int:
        """The generation of this rank's group."""
        return self.protocol.generation

    @property
    def member_schedule(self) -> dict[int, list[int]]:
        """``step -> members`` from that step on, given by hand."""
        return self.protocol.member_schedule

    @property
    def next_step(self) -> int:
        """The step this replica's state is at (the next to run)."""
        return self.protocol.next_step

    @next_step.setter
    def next_step(self, step: int) -> None:
        self.protocol.next_step = step

    @property
    def batch_plan(self) -> GlobalBatchPlan:
        """The global-batch plan (B micro-batches per step)."""
        return self._batch_plan

    @batch_plan.setter
    def batch_plan(self, batch_plan: GlobalBatchPlan) -> None:
        self._batch_plan = batch_plan
        self.protocol.micro_batches = batch_plan.num_micro_batches

    @property
    def in_primary_replica(self) -> bool:
        """This rank is a shard of the group's primary replica (every such shard writes the snapshots and
        checkpoints of its part; only the first shard publishes the members)."""
        return self.reduction.in_primary_replica

    # -- the effects -------------------------------------------------------------------
    def _effect_handlers(self) -> dict[type, Callable[[Any], Any]]:
        """The handler of each effect: the store's, the step's exchanges', the state's, the groups' and the clock."""
        reduction, handout = self.reduction, self.handout
        return {
            **self.store_effects.handlers(),
            E.Compute: self._compute, E.Add: lambda e: e.total + e.extra, E.Reduce: reduction.reduce,
            E.AgreeMembers: reduction.agree, E.SetGradients: reduction.set_gradients,
            E.TransferState: handout.transfer, E.Fallback: handout.resume, E.Admitted: self._admitted,
            E.BuildGroup: self._build, E.Formed: self._formed, E.DropGroup: lambda e: self.groups.abort(),
            E.Point: self._point, E.Pause: lambda e: self.pause(e.paused, e.bound),
            E.Refresh: lambda e: self.optimizer_shards.refresh(  # (TP x PP > 1: the shards agree it completed)
                self.groups.shard, self.members, self.replica, self.generation,
                self.groups.every_rank if self.layout.size > 1 else None, overlap=e.overlap),
            E.Now: lambda e: time.monotonic(), E.Sleep: lambda e: time.sleep(e.seconds),
            # What the protocol decided, for observers (the in-process fake records them).
            E.Abandon: _nothing, E.Decided: _nothing, E.Followed: _nothing, E.Reassigned: _nothing,
        }

    def _build(self, effect: E.BuildGroup) -> bool:
        """Build the record's groups (and the listener's world); False, all aborted, when a member is gone meanwhile."""
        record = effect.record
        try:
            self.groups.configure(record.generation, list(record.members))
            return True
        except (RuntimeError, LookupError) as exc:
            log.warning("dp_group_build_failed", generation=record.generation, error=str(exc)[:200])
            self.groups.abort()
            return False

    def _formed(self, effect: E.Formed) -> None:
        read_stop = not self.reduction.stop_requested
        if self.store_effects.formed(effect.generation, list(effect.members), read_stop):
            # Members stopped after a step: this group's exchange says so too.
            self.reduction.stop_requested = True

    def _admitted(self, effect: E.Admitted) -> None:
        self.handout.admitted(effect)
        self.store_effects.admitted(effect)

    def _gone(self) -> str | None:
        """(The watch's thread) why this rank's group cannot complete: members gone; None while all are alive."""
        if not self.groups.held:
            return None
        return self.store_effects.gone(self.generation, list(self.members))

    def _point(self, effect: E.Point) -> None:
        # A bucket's fault point is passed right before it starts: from backward, when the reduction begins
        # (StepReduction.point), or here before the protocol waits for a bucket started by nothing else.
        if effect.kind == "bucket" and not self.reduction.started(effect.step, effect.index):
            self.fault_point(self.rank, effect.step, bucket=effect.index)

    def _compute(self, effect: E.Compute) -> torch.Tensor:
        """Compute this rank's micro-batches of a step.

        Raises:
            ReplicaBroken: A collective of the model failed (a peer of this
                replica was lost). It carries the message only: the failed
                call's frames, which hold the groups, are freed, so that
                dropping the groups closes their connections at once and
                peers blocked on this rank fail now, not at their timeout.
        """
        if not effect.redo:
            self.store_effects.prefetch_requests(effect.step, self.protocol.reads_requests)
        backward = set(range(self.layout.pipeline))
        if effect.redo and self.layout.pipeline > 1:
            backward = self._stages_to_backpropagate()
        try:
            return self.computation.run(effect.step, list(effect.micro_batches), effect.redo, self._batch_plan,
                                        backward, self.groups.every_rank, self.members)
        except RuntimeError as exc:
            if not (self.reduction.committed and is_peer_failure(exc)):
                raise
            message = f"rank {self.rank}: a collective of its model failed: {exc}"
        # Raised outside the handler, so that no __context__ keeps the frames.
        raise ReplicaBroken(message)

    def _stages_to_backpropagate(self) -> set[int]:
        """After a regroup: the stages whose backward is still needed (from the record's buckets kept per shard)."""
        record = self.store_effects.record
        if record is None or not record.kept:
            return set(range(self.layout.pipeline))
        return stages_to_backpropagate(self.layout, record.kept, self.store_effects.shard_buckets())

    # -- requests and the end ------------------------------------------------------------
    def request_stop(self) -> None:
        """Ask every member to stop after a step: the next exchange carries it (safe in a signal handler).

        Every member then sees ``reduction.stop_agreed`` after the same step
        (its last exchange: the commit with TP/PP, else the last gradient
        bucket); the caller stops there. Nothing is sent on its own.
        """
        self.reduction.stop_requested = True

    def stopping(self, step: int) -> None:
        """This rank stops after ``step`` (``reduction.stop_agreed``): recorded for ranks that regroup after failing it.

        When the step's last exchange completed on some ranks only, the others
        regroup without them; the record makes their new group's exchange
        carry the stop too (read when a group forms).
        """
        self.store_effects.record_stop(step)

    def finish(self) -> None:
        """Training is over: the parameters gathered (a sharded optimizer stepped them last); ranks still waiting
        in :meth:`join` give up waiting (any member says so).

        Raises:
            Excluded: (Sharded) a member was lost while the parameters were gathered and a record left this rank out.
        """
        self.refresh(last=True)
        if self.replica in self.members and self.groups.held:
            self.store_effects.record_finished(self.next_step)

    def refresh(self, last: bool = False, validation: bool = False, overlap: bool = False) -> None:
        """(A sharded optimizer) the parameters its last step updated, gathered into every model (between steps).

        The next :meth:`begin_step` does it otherwise (with ``overlap_param_gather`` it only starts the gather
        there, and the computation waits for it; here it is waited for, a gather in flight included, unless
        ``overlap``). Nothing happens without a sharded optimizer, or when nothing changed. When it fails the
        parameters stay stale until the next step's regroup; with ``last``
        (no next step: :meth:`finish`) the members regroup at once. With ``validation`` (every member calls
        it before validating between steps: :meth:`Protocol.before_validation`) the members check in a small
        collective that every one's parameters are gathered, and regroup together at once if not.

        Raises:
            Retired: (``last``, ``validation``) a member was lost meanwhile and a resize record leaves this
                rank out.
            Excluded: (``last``, ``validation``) a member was lost meanwhile and a record left this rank out.
        """
        step = self.next_step
        run(self.protocol.before_validation(step) if validation else
            self.protocol.refresh(step, last, settle=not overlap), self._handlers)

    def close(self) -> None:
        """Destroy this rank's groups; call before the process exits.

        A gloo group still alive when the interpreter shuts down can abort the
        process ("terminate called without an active exception": its threads
        are torn down while running), so a finished rank would exit with SIGABRT.
        """
        self.groups.abort()
        self.watch.close()
        self.store_effects.close()
        if self.launcher is not None:
            self.launcher.remove()

    # -- joining -------------------------------------------------------------------------
    def start_join(self, timeout: float = 120.0) -> bool:
        """Wait until the group admits this rank and its groups are built (the listener's too), without a model.

        The join stops once its group formed, before it says it is ready for
        the state (from a replica, or the fallback state when no replica is
        left): :meth:`bind` the model, then :meth:`finish_join`; the members
        wait for that (``ready_timeout``), a declared pause. A megatron-core model can only
        be built once its world exists: the Lightning strategy admits a joiner
        before Lightning calls ``configure_model()``.

        Returns:
            False if training finished first (nothing to join), else True.

        Raises:
            TimeoutError: Not admitted within ``timeout`` seconds.
        """
        if self.optimizer_shards is not None and self.optimizer_shards.groups:
            self.optimizer_shards.drop()  # a rank left out holds a stale share: it gets a new one when admitted
        effects = self.protocol.join(timeout)
        outcome = run(effects, self._handlers, until=(E.MarkReady,))
        suspended = isinstance(outcome, Suspended)
        self._joining = (effects, outcome.effect) if suspended else (None, outcome)
        return suspended or outcome is not None

    def finish_join(self) -> int | None:
        """Go on with the join :meth:`start_join` began, now that the model is bound.

        Returns:
            The step to continue from; None if training finished first.

        Raises:
            RuntimeError: No join was started, or no model is bound.
            TimeoutError: Not admitted within the join's timeout (after a failed admission).
        """
        if not self.params:
            raise RuntimeError("finish_join() before bind(): the join needs the model")
        if self._joining is None:
            raise RuntimeError("finish_join() without start_join()")
        (effects, pending), self._joining = self._joining, None
        return pending if effects is None else run(effects, self._handlers, pending=pending)

    def join(self, timeout: float = 120.0) -> int | None:
        """Wait until the group admits this rank, then load its state from a replica.

        With TP/PP, a replica is admitted once every rank of it waits; each
        rank receives the state of its shard from the same shard of a replica.
        When no replica is left (every member of the group that is still alive
        is itself waiting to join), the lowest waiting replica resumes from
        ``fallback()`` (in-memory snapshot, else persisted checkpoint), else
        from step 0 with its fresh state and a warning, and hands that state to
        the others. ``handout.state_source`` says which it was.

        Returns:
            The step to continue from; None if training finished first.

        Raises:
            TimeoutError: Not admitted within ``timeout`` seconds.
        """
        self.start_join(timeout)
        return self.finish_join()

    def state(self) -> dict[str, Any]:
        """This replica's state at the current step boundary (what a joiner receives: :meth:`StateHandout.state
        <unicron_elastic.strategy.engine.joining.StateHandout.state>`)."""
        return self.handout.state()

    def waiting(self) -> list[int]:
        """Members-to-be waiting in :meth:`join` to be admitted (replicas every rank of which waits, with TP/PP)."""
        return self.store_effects.membership.waiting()

    # -- one step ----------------------------------------------------------------------
    def begin_step(self, step: int) -> StepReport:
        """Agree on the members of ``step`` and compute this rank's micro-batches.

        Returns:
            The report, completed by :meth:`finish_gradients`.

        Raises:
            Retired: This rank leaves the group at ``step`` (the member schedule, or its
                leave request, which is then withdrawn).
            Excluded: This rank is alive but a record left it out (with TP/PP:
                its replica lost a rank, or the membership sync failed and the
                regroup left it out): it must :meth:`join`.
        """
        # A read begun with an earlier step is dropped: the membership sync reads afresh.
        self.store_effects.requests.prefetched = None
        self.reduction.begin()
        try:
            return run(self.protocol.begin_step(step), self._handlers)
        except Retired:
            self.store_effects.withdraw_leave_request()
            raise

    def finish_gradients(self) -> StepReport:
        """All-reduce the gradients of the step begun, surviving failures; set ``p.grad`` to sum / B.

        With ``reduce_scatter`` each rank receives its share of the sum only: no parameter gets a ``.grad``, the
        sharded optimizer loads the share (clip with ``reduction.clip_grad_norm_``).

        Raises:
            RuntimeError: No step was begun.
            Excluded: This rank is alive but a record left it out: it must :meth:`join`.
            NonFiniteError: A rank found a NaN or Inf in its loss or gradient sums of this step (no loss scaler);
                every member raises it, before any optimizer step.
        """
        report = run(self.protocol.finish_gradients(), self._handlers)
        if self.reduction.non_finite is not None:
            raise self.reduction.non_finite
        return report

    def train_step(self, step: int) -> StepReport:
        """Run optimizer step ``step`` over the whole global batch, whatever ranks die.

        Returns:
            What this rank did.

        Raises:
            Retired: The member schedule removed this rank from the group at ``step``.
            Excluded: This rank is alive but a record left it out: it must :meth:`join`.
        """
        self.begin_step(step)
        report = self.finish_gradients()
        self.fault_point(self.rank, step, at="before_optimizer_step")
        self.optimizer.step()
        self.next_step = step + 1
        self.fault_point(self.rank, step, at="after_optimizer_step")
        return report
