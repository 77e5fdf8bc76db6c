"""``Trainer(strategy="unicron_megatron")``: Lightning training that survives the loss of ranks.

The strategy is a :class:`~lightning.pytorch.strategies.DDPStrategy` that does
not wrap the model in DDP: one optimizer step is driven by
:class:`~unicron_elastic.strategy.engine.elastic_dp.ElasticDataParallel` (paper
section 6), with the LightningModule's ``training_step`` as the loss of one
micro-batch:

* the train dataloader's dataset and settings are kept; the loop iterates one
  item per optimizer step, and micro-batch ``j`` of step ``s`` holds the samples
  :class:`GlobalBatchPlan` names (any rank can compute any micro-batch, so work
  moves when a rank dies). This rank's own micro-batches are loaded ahead by a
  ``DataLoader`` with the user's ``num_workers``, ``pin_memory``,
  ``persistent_workers``, ``prefetch_factor``...; moved ones are materialised on
  demand (:mod:`~unicron_elastic.strategy.lightning.feed`);
* ``training_step`` (Lightning's closure) computes this rank's micro-batches;
  ``backward`` is the resilient bucketed all-reduce (scenario 1 and 2
  recovery happen there); Lightning then clips, calls its hooks and steps;
* after a failure or a reconfiguration the default process group and
  megatron-core's ``parallel_state`` are rebuilt for the new members, so
  Lightning's own collectives (checkpoint saving, ``self.log(sync_dist=True)``)
  keep working;
* SIGTERM stops every rank after the same step: the step's own last exchange
  carries it to every member (no barrier per step as Lightning's broadcast of
  a SIGTERM flag), and Lightning ends ``fit`` there (``SIGTERMException``);
* a worker the agent restarted (``UNICRON_WORKER_RESTARTS`` > 0) joins at the
  next step boundary and receives the whole Lightning state (weights,
  optimizer, loop progress, callbacks, RNG) by broadcast from a replica; when
  no replica is left, from the in-memory snapshot, else the newest disk
  checkpoint. All three carry the state as raw tensor bytes plus JSON
  (:mod:`~unicron_elastic.strategy.snapshots.safe_state`): loading never unpickles, so the
  state may hold only plain data (no enums or custom objects, e.g. in hparams).

Registering: ``import unicron_elastic.strategy`` registers ``unicron_megatron``
in Lightning's strategy registry; so does ``import unicron_elastic`` when
Lightning was imported first (Lightning has no plugin discovery for them).

The strategy is the Lightning adapter; its parts are collaborators in this
package: the rank's role (:mod:`.role`), the world rebuilt with each
generation (:mod:`.world`), the stores (:mod:`.stores`), one micro-batch's
computation (:mod:`.forward`), the state and its tiers (:mod:`.replica_state`),
the random streams (:mod:`.random_streams`), heartbeats (:mod:`.heartbeat`),
clipping by the replica's norm (:mod:`.clipping`) and what is refused
(:mod:`.fit_checks`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import structlog
import torch
import torch.distributed as dist
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from typing_extensions import override

from unicron_elastic.api import ConfigError
from unicron_elastic.strategy.engine.elastic_dp import ElasticDataParallel, Retired, StepReport
from unicron_elastic.strategy.engine.engine_options import EngineHooks, EngineOptions
from unicron_elastic.strategy.engine.groups import GenerationGroups
from unicron_elastic.strategy.engine.microbatch import GlobalBatchPlan
from unicron_elastic.strategy.engine.replicas import ModelParallel
from unicron_elastic.strategy.engine.transport import nccl_error_handling, transport_for
from unicron_elastic.strategy.lightning.clipping import install_clipping, replica_grad_norm
from unicron_elastic.strategy.lightning.environment import UnicronEnvironment
from unicron_elastic.strategy.lightning.feed import MicroBatchFeed, StepPlaceholders
from unicron_elastic.strategy.lightning.fit_checks import (check_arguments, check_distributed_optimizer, check_fit,
                                                           reductions_of)
from unicron_elastic.strategy.lightning.forward import MicroBatchForward
from unicron_elastic.strategy.lightning.heartbeat import Heartbeat
from unicron_elastic.strategy.lightning.parallel import build_world, check_sizes, destroy_world
from unicron_elastic.strategy.lightning.precision import check_precision, overflowed, start_scale
from unicron_elastic.strategy.lightning.progress import watch_progress
from unicron_elastic.strategy.lightning.random_streams import RandomStreams
from unicron_elastic.strategy.lightning.replica_state import ReplicaState
from unicron_elastic.strategy.lightning.role import RankRole, initial_members, launch_joins
from unicron_elastic.strategy.lightning.sigterm import SigtermTakeover
from unicron_elastic.strategy.lightning.stores import connect_store, snapshot_store
from unicron_elastic.strategy.lightning.world import StrategyWorld, build_world_alone, set_rank_zero
from unicron_elastic.strategy.snapshots.shard_checkpoints import load_shard, save_shard
from unicron_elastic.worker import get_worker

log = structlog.get_logger(__name__)

STRATEGY_NAME = "unicron_megatron"


def _refresh(strategy: UnicronMegatronStrategy, validation: bool = False, overlap: bool = False) -> None:
    """(Sharded) :meth:`ElasticDataParallel.refresh` (``overlap``: only started); a resize that leaves this rank out
    retires it."""
    try:
        strategy.engine.refresh(validation=validation, overlap=overlap)
    except Retired:
        strategy.retired_at, strategy.role = strategy.engine.next_step, RankRole.RETIRED
        strategy.lightning_module.trainer.should_stop = True


class UnicronMegatronStrategy(DDPStrategy):
    """Self-healing data parallelism over tensor x pipeline parallel megatron-core models, for Lightning.

    With ``tensor_model_parallel_size`` (TP) x ``pipeline_model_parallel_size``
    (PP) > 1 a data-parallel *replica* is TP x PP consecutive launch ranks
    (``rank = replica * TP * PP + stage * TP + tensor_rank``); ``members`` and
    ``member_schedule`` then name replicas, and the data-parallel size changes in
    whole replicas. The LightningModule builds its megatron-core layers in
    ``configure_model()`` (``parallel_state`` is initialized then) and, with
    PP > 1, only its stage's layers; it implements Megatron-LM's
    ``forward_step(data_iterator, model)`` or ``pipeline_forward(batch,
    input_tensor)`` (see docs/strategy.md). A weight tied across the first and
    the last stage is kept tied, and clipping by norm uses the whole replica's
    norm.

    Args:
        global_batch: Samples per optimizer step, constant across failures and
            reconfigurations (default: the dataloader's batch size x the
            launch data-parallel size).
        micro_batch: Samples per micro-batch (default: the dataloader's batch size).
        seed: Seed of the global-batch shuffle and of each micro-batch's RNG.
        shuffle: Shuffle the samples each epoch (False: the dataset's own order, for one shuffled already).
        bucket_numel: Gradient elements per all-reduce bucket (megatron-core's default; None: one per shard).
        tensor_model_parallel_size: megatron-core TP size.
        pipeline_model_parallel_size: megatron-core PP size.
        pipeline_schedule: ``"1f1b"`` (default) or ``"gpipe"`` (our schedule over
            point-to-point; both run the micro-batches in the same order).
        snapshot_every: Steps between in-memory snapshots (0: none).
        checkpoint_dir: Directory of asynchronous checkpoints in the safe state
            format (``step-<s>.state``; None: none).
        checkpoint_every: Steps between those saves.
        timeout: Collective timeout.
        checkin_timeout: After a failure, how long survivors wait for a rank that is alive but has
            not checked in (a stuck one: it is then left out and rejoins). Dead ranks are not waited for.
        join_timeout: How long a restarted rank waits to be admitted.
        members: The launch ranks (replicas with TP x PP > 1) that train from
            the start (default: all); the others wait to be added by ``member_schedule``.
        member_schedule: ``{step: members}``: the data-parallel members from that step
            on, given by hand (scale in or out with the same global batch). Ranks left
            out retire at that step (their ``fit`` ends); ranks added receive the state
            from a replica. The lowest member must stay in.
        grad_dtype: Dtype of gradient accumulation and all-reduce. float32
            (default): after a failure the sums are added in another order, so
            the parameters equal the failure-free ones to float32 rounding, which
            Adam-like optimizers can amplify. float64: equal to the last bit in
            practice, at twice the gradient memory and all-reduce volume.
        grad_reduce_in_bf16: All-reduce every gradient bucket but the last in bfloat16 (Megatron-LM's
            ``--grad-reduce-in-bf16``); the sums stay in ``grad_dtype`` (see docs/strategy.md, "Precision").
        report_keys: The keys of the ``report`` dict a Megatron-LM ``loss_func`` returns (``pretrain_gpt.py``:
            ``"lm loss"``); each is summed over the step's micro-batches and data-parallel ranks and logged as
            numerator / denominator, as Megatron-LM logs them.
        distributed_optimizer: Shard the optimizer's state over the data-parallel ranks (Megatron-LM's
            ``--use-distributed-optimizer``) around the element-wise torch optimizer ``configure_optimizers``
            returns; see docs/strategy.md, "The distributed optimizer".
        optimizer_instances: With it, the instances that each hold the whole state (Megatron-LM's
            ``--num-distributed-optimizer-instances``): a lost rank's share is taken from another instance;
            with 1 a lost rank costs a return to the newest snapshot or checkpoint.
        overlap_param_gather: With it, at TP = PP = 1 (Megatron-LM's ``--overlap-param-gather``): the updated
            parameters' gather starts after the optimizer step and each module's forward waits for its pieces;
            between steps the model holds the previous step's parameters until a checkpoint, a snapshot,
            validation or the next forward waits for the gather.
        **kwargs: Passed to :class:`~lightning.pytorch.strategies.DDPStrategy` (``cluster_environment``
            defaults to :class:`UnicronEnvironment`, ``process_group_backend`` to gloo).

    Attributes:
        role: This rank's role (:class:`~unicron_elastic.strategy.lightning.role.RankRole`), which each
            of Lightning's hooks asks.
        retired_at: The step the member schedule removed this rank at (None: not removed).
        joined_at: The step a joining rank joined at (None: it trained from the start, or never joined).
        engine: The elastic engine (None before ``setup_distributed``, and outside ``fit``).
        reports: The :class:`StepReport` of each step this rank trained.
        worker: This worker's end of the agent channel (:func:`~unicron_elastic.worker.get_worker`).

    Raises:
        ConfigError: Invalid sizes, intervals or pipeline schedule.
    """

    def __init__(
        self,
        global_batch: int | None = None, micro_batch: int | None = None, seed: int = 0, shuffle: bool = True,
        bucket_numel: int | None = 40_000_000,
        tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1, pipeline_schedule: str = "1f1b",
        snapshot_every: int = 50, checkpoint_dir: str | os.PathLike[str] | None = None, checkpoint_every: int = 100,
        timeout: timedelta = timedelta(seconds=60), checkin_timeout: float = 10.0, join_timeout: float = 300.0,
        members: list[int] | None = None, member_schedule: dict[int, list[int]] | None = None,
        grad_dtype: torch.dtype = torch.float32, grad_reduce_in_bf16: bool = False,
        report_keys: tuple[str, ...] = ("lm loss",),
        distributed_optimizer: bool = False, optimizer_instances: int = 1, overlap_param_gather: bool = False,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("cluster_environment", UnicronEnvironment())
        kwargs.setdefault("process_group_backend", "gloo")
        super().__init__(timeout=timeout, **kwargs)
        check_arguments({"global_batch": global_batch, "micro_batch": micro_batch, "bucket_numel": bucket_numel},
                        snapshot_every, checkpoint_every, pipeline_schedule)
        check_distributed_optimizer(distributed_optimizer, optimizer_instances, overlap_param_gather,
                                    tensor_model_parallel_size * pipeline_model_parallel_size)
        #: With ``distributed_optimizer``: the optimizer instances (None: every rank keeps the whole state).
        self.optimizer_instances = optimizer_instances if distributed_optimizer else None
        self.overlap_param_gather = overlap_param_gather
        self.layout = ModelParallel(tensor_model_parallel_size, pipeline_model_parallel_size)
        self.global_batch, self.micro_batch, self.seed, self.shuffle = global_batch, micro_batch, seed, shuffle
        self.bucket_numel, self.grad_dtype, self.grad_reduce_in_bf16 = bucket_numel, grad_dtype, grad_reduce_in_bf16
        self.tp, self.pp = tensor_model_parallel_size, pipeline_model_parallel_size
        self.pipeline_schedule, self.checkpoint_dir = pipeline_schedule, checkpoint_dir
        self.snapshot_every, self.checkpoint_every = snapshot_every, checkpoint_every
        self.checkin_timeout, self.join_timeout = checkin_timeout, join_timeout
        self.report_keys = tuple(report_keys)
        self.initial_members = sorted(members) if members is not None else None
        self.member_schedule = {int(step): sorted(ranks) for step, ranks in (member_schedule or {}).items()}
        self.role = RankRole.MEMBER
        #: ``fit`` ended normally (Lightning's ``on_train_end``), in any role.
        self._fit_ended = False
        self.retired_at: int | None = None
        self.joined_at: int | None = None
        self.engine: ElasticDataParallel | None = None
        self.reports: list[StepReport] = []
        self.worker = get_worker()
        self._store: dist.Store | None = None
        self._world_groups: GenerationGroups | None = None  # keeps the world's bootstrap store without an engine
        self._sigterm = SigtermTakeover(self)  # SIGTERM in the step's last exchange (fit)
        self._heartbeat = Heartbeat(self.worker)
        self._progress_hooks: list[Any] = []
        self._streams = RandomStreams(seed)
        self._forward: MicroBatchForward | None = None  # one micro-batch's computation (fit)
        self._state: ReplicaState | None = None  # the state a joiner receives, and its tiers (fit)

    @property
    def feed(self) -> MicroBatchFeed | None:
        """Where micro-batches come from (its ``fed``/``on_demand`` counters); None before the dataloader."""
        return self._forward.feed if self._forward is not None else None

    # -- environment ------------------------------------------------------------
    @property
    def env(self) -> UnicronEnvironment:
        """The cluster environment, whose rank and world size follow the world."""
        assert isinstance(self.cluster_environment, UnicronEnvironment)
        return self.cluster_environment

    @property
    @override
    def root_device(self) -> torch.device:
        """``cuda:LOCAL_RANK`` when Lightning's accelerator is CUDA, else the CPU.

        (Not Lightning's ``parallel_devices[local_rank]``: under ``unicron-run`` the
        launcher, not ``devices=``, decides how many ranks a node runs.) On CUDA the world and the engine's
        groups are NCCL's (:class:`~unicron_elastic.strategy.engine.transport.NcclTransport`; untested: no GPU).
        """
        if isinstance(self.accelerator, CUDAAccelerator):
            return torch.device("cuda", self.env.local_rank())
        return torch.device("cpu")

    @property
    @override
    def world_size(self) -> int:
        """The world's size; 1 while Lightning's collectives stay on this rank (``role.local``: a joiner before its
        first step, a retired rank, ...: it must not run a collective in a world whose members passed that point)."""
        return 1 if self.role.local else super().world_size

    @property
    def finished_before_join(self) -> bool:
        """Training finished while this rank waited to join: it trained nothing and writes no checkpoint."""
        return self.role is RankRole.FINISHED_BEFORE_JOIN

    @override
    def set_world_ranks(self) -> None:
        """Tell Lightning's ``rank_zero_only`` this rank's rank in the world (the environment holds the rest)."""
        set_rank_zero(self.global_rank)

    @override
    def setup_distributed(self) -> None:
        """Connect to the launcher's store, then build the elastic engine (``fit``) or the first world (no ``fit``).

        When fitting, the engine's constructor builds the first world (its
        group listener is :class:`~unicron_elastic.strategy.lightning.world.StrategyWorld`).
        A joiner has no world yet: it is admitted in :meth:`model_sharded_context`,
        right before Lightning calls ``configure_model()`` (megatron-core's
        parallel layers take their sizes from the world's tensor-parallel
        group), or in :meth:`setup` when the module has no ``configure_model``,
        and receives the state once its model exists.

        Raises:
            ConfigError: The world is not a multiple of TP x PP (or TP/PP > 1 without megatron-core), or the
                members name ranks outside it.
            RuntimeError: A member is gone while the first world forms.
        """
        check_sizes(self.env.launch_world_size, self.tp, self.pp)
        if self.root_device.type == "cuda":
            nccl_error_handling()  # before the first NCCL group: failures raise, they do not kill the worker
        self._store = connect_store(self.env)
        # The exception hook is installed already. With a member schedule, only the schedule changes the members.
        self.worker.hello(resumable=True, leavable=not self.member_schedule, growable=not self.member_schedule)
        members = initial_members(self.layout, self.env.launch_world_size, self.initial_members, self.member_schedule)
        joining = launch_joins(self.layout.replica(self.env.launch_rank), members)
        if joining:
            if not self.role.local:  # (a later run of the same Trainer keeps the local role a joiner reached in fit)
                self.role = RankRole.JOINER
            self.set_world_ranks()
        world = StrategyWorld(self.env, self.layout, self._timeout or timedelta(seconds=60), self.root_device,
                              lambda: self.lightning_module)
        module = self.lightning_module
        if module is None or module.trainer is None or module.trainer.state.fn != TrainerFn.FITTING:
            if not joining:  # validate/test/predict: no elastic engine
                self._world_groups = build_world_alone(self._store, world, self.root_device, members)
            return
        self._build_engine(joining, members, world)

    def _build_engine(self, joining: bool, members: list[int], world: StrategyWorld) -> None:
        """Build the elastic engine, without its model yet (bound in :meth:`setup`), and what it calls back.

        A member's engine builds the first world (generation 0) in its constructor.

        Args:
            joining: This rank joins a running group.
            members: The initial data-parallel members (replicas).
            world: The engine's group listener.

        Raises:
            RuntimeError: A member is gone while the first groups form.
        """
        rank = self.env.launch_rank
        self._state = ReplicaState.open(lambda: self.lightning_module, self._streams,
                                        snapshot_store(self._store, self.env), self.layout, rank,
                                        self.snapshot_every, self.checkpoint_dir, self.checkpoint_every)
        forward = self._forward = MicroBatchForward(self._streams, self.layout, rank, self.root_device,
                                                    lambda: self.precision_plugin, self.batch_to_device)
        options = EngineOptions(
            bucket_numel=self.bucket_numel, timeout=self._timeout or timedelta(seconds=60),
            checkin_timeout=self.checkin_timeout, grad_dtype=self.grad_dtype,
            max_world=self.env.max_world_size,  # nodes that grow the run join with ranks past WORLD_SIZE
            model_parallel=self.layout, pipeline_schedule=self.pipeline_schedule,
            transport=transport_for(self.root_device), optimizer_instances=self.optimizer_instances,
            overlap_param_gather=self.overlap_param_gather,
            reduce_dtype=torch.bfloat16 if self.grad_reduce_in_bf16 else None,
        )
        hooks = EngineHooks(
            fault_point=self._heartbeat.point, stage_fn=forward.stage_forward if self.pp > 1 else None,
            get_state=self._state.get, set_state=self._state.load, group_listener=world,
            fallback=self._state.fallback,
            pause=self.worker.set_paused,  # a regroup is a declared, bounded pause, not a hang
            report_waiting=self.worker.waiting,  # blocked on a peer: spared by the hang detector
            overflow=lambda total, micro_batches: overflowed(self.precision_plugin, total, micro_batches),
        )
        # The model comes in setup, the batch plan with the dataset (process_dataloader).
        self.engine = forward.engine = ElasticDataParallel(
            None, None, batch_plan=None, batch=forward.batch, loss_fn=forward.loss, store=self._store,
            rank=rank, world_size=self.env.launch_world_size, joining=joining, members=members,
            member_schedule=self.member_schedule, options=options, hooks=hooks,
        )
        self._state.attach(self.engine.optimizer_shards)

    def _admit(self) -> None:
        """(A joiner, once) wait until the group admits this rank and its world is built.

        Not in :meth:`setup_distributed`: Lightning's ``prepare_data`` comes
        after it and makes a group over the world (``_InfiniteBarrier``), which
        a joiner's world shares with members that are training.

        Raises:
            TimeoutError: Not admitted within ``join_timeout``.
        """
        if self.engine is None or self.role is not RankRole.JOINER:
            return
        if self.engine.start_join(self.join_timeout):
            self.role = RankRole.ADMITTED
            return
        self.role = RankRole.FINISHED_BEFORE_JOIN
        log.info("not_joining", reason="training finished before this rank was admitted, or its node leaves "
                 "the task (dp_join_skipped)")
        # Nothing left to train: a world of its own, so that the model can be built.
        build_world(dist.HashStore(), 0, 0, 1)

    @override
    @contextmanager
    def model_sharded_context(self) -> Iterator[None]:
        """Lightning's context of ``configure_model()``: a joiner is admitted first (its world must exist).

        Raises:
            ConfigError: On a CPU, megatron-core's constructor asked for CUDA to tie the embedding across
                stages (the message says how to build the model instead).
        """
        self._admit()
        rank = self.env.launch_rank
        # megatron-core initializes weights on a GPU from its tracker's streams.
        self._streams.seed_tracker(self.root_device, self.layout.stage(rank), self.layout.tensor_rank(rank))
        with super().model_sharded_context():
            try:
                yield
            except AssertionError as exc:
                if self.root_device.type != "cpu" or "CUDA" not in str(exc) or self.pp == 1:
                    raise
                raise ConfigError("configure_model: megatron-core's LanguageModule moves the tied word embedding to "
                                  "CUDA for its initial all-reduce over the embedding group; on a CPU build the model "
                                  "with pg_collection=ProcessGroupCollection.use_mpu_process_groups() whose embd is "
                                  "None (unicron_megatron makes the two copies equal itself; see "
                                  f"docs/strategy.md, 'Bringing a Megatron-LM model'): {exc}") from exc

    # -- precision ------------------------------------------------------------------
    @property
    @override
    def precision_plugin(self) -> Any:
        """Lightning's precision plugin (``Precision()`` until the Trainer attaches one)."""
        return DDPStrategy.precision_plugin.fget(self)

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Any) -> None:
        check_precision(plugin)
        DDPStrategy.precision_plugin.fset(self, plugin)

    # -- setup --------------------------------------------------------------------
    @override
    def configure_ddp(self) -> None:
        """No DDP wrapper: gradients are reduced by the elastic engine."""

    @override
    def setup(self, trainer: Any) -> None:
        """Lightning's set-up, then the elastic engine; a restarted rank joins and restores here.

        Raises:
            ConfigError: Manual optimization, several optimizers, gradient accumulation;
                with PP > 1 a module without ``forward_step`` or ``pipeline_forward``
                (or with both); a ``*-mixed`` precision on the CPU around
                megatron-core's layers; megatron-core's DDP wrapper or optimizers;
                a weight tied across stages that cannot be kept tied.
        """
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        module = self.lightning_module
        check_fit(trainer, module, self.optimizers, self.precision_plugin, self.root_device, (self.tp, self.pp),
                  trains=self.role is not RankRole.FINISHED_BEFORE_JOIN, sharded=self.optimizer_instances is not None)
        if self.engine is None:
            raise ConfigError("unicron_megatron: fit() reached setup without the engine setup_distributed builds")
        self._sigterm.take_over(trainer)
        self._admit()  # (a module without configure_model)
        if self.role is RankRole.FINISHED_BEFORE_JOIN:  # the others finished while this rank restarted
            log.info("rank_rejoined", step=None, state_from=None, finished_before_join=True)
            return
        self._bind_model(module)
        if self.role is not RankRole.ADMITTED:  # (a joiner's tied copies come with its state)
            self.engine.reduction.tie()
        if self.layout.stage(self.env.launch_rank) < self.pp - 1:
            # A stage that scales no loss starts the loss scale once, not per micro-batch.
            start_scale(self.precision_plugin, self.root_device)
        if self.engine.in_primary_replica:
            self._state.start()  # its writer process is ready before the first step (~1 s, once)
        if self.role is RankRole.ADMITTED:
            self.joined_at = self.engine.finish_join()
            self.role = RankRole.JOINED if self.joined_at is not None else RankRole.FINISHED_BEFORE_JOIN
            log.info("rank_rejoined", step=self.joined_at, state_from=self.engine.handout.state_source,
                     finished_before_join=self.finished_before_join)

    def _bind_model(self, module: Any) -> None:
        """Give the engine the model, then this stage's forward and, with TP x PP > 1, clipping by the replica's norm.

        Lightning's precision plugin clips with ``clip_grad_by_norm``; with
        TP x PP > 1 that would clip each shard by its own norm, so the plugin's
        is replaced by a :class:`~unicron_elastic.strategy.lightning.clipping.ReplicaNormClip` for this fit.

        Raises:
            ConfigError: See :func:`~unicron_elastic.strategy.lightning.fit_checks.reductions_of` and
                :meth:`~unicron_elastic.strategy.lightning.forward.MicroBatchForward.bind_stage`; a weight
                tied across stages that cannot be kept tied.
        """
        rank = self.env.launch_rank
        # A module without configure_model: megatron-core's tracker is seeded here.
        self._streams.seed_tracker(self.root_device, self.layout.stage(rank), self.layout.tensor_rank(rank))
        self.engine.bind(module, self.optimizers[0], reductions_of(module, self.precision_plugin, self.report_keys))
        if not self._progress_hooks:  # the forward and backward of its modules and layers: progress within a step
            self._progress_hooks = watch_progress(module, lambda: self.worker.progress(self.engine.next_step))
        self._forward.bind_stage(module)
        install_clipping(self.precision_plugin, self.engine, self.optimizer_instances is not None,
                         lambda: self.grad_norm, self.root_device)

    @property
    def grad_norm(self) -> float | None:
        """The norm of the whole replica's gradients as Lightning clips them in this step (TP x PP > 1).

        Every parameter counted once, as megatron-core counts it: a tied
        weight's copy on the last stage and the tensor-parallel ranks' copies of
        a replicated parameter (a layer norm) are not counted again. Taken from
        the reduced gradients in the step's commit, divided by the number of
        micro-batches and, with a loss scaler, by the scale being unscaled
        (read it up to the optimizer step). None with TP = PP = 1 (Lightning
        computes it) and before the step's gradients are reduced.
        """
        return replica_grad_norm(self.engine, self.precision_plugin)

    # -- data ----------------------------------------------------------------------
    @override
    def process_dataloader(self, dataloader: object) -> object:
        """The train dataloader becomes one item per step; its dataset feeds the micro-batches.

        Raises:
            ConfigError: The train dataloader is not a map-style ``DataLoader``.
        """
        trainer = self.lightning_module.trainer
        if trainer.state.stage != RunningStage.TRAINING or self.engine is None:
            return dataloader
        dataset = getattr(dataloader, "dataset", None)
        if dataset is None or not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise ConfigError("unicron_megatron needs a DataLoader over a map-style dataset (len and [])")
        micro = self.micro_batch or dataloader.batch_size or 1
        global_batch = self.global_batch or micro * self.layout.replicas(self.env.launch_world_size)
        batch_plan = GlobalBatchPlan(len(dataset), global_batch, micro, self.seed, self.shuffle)
        self.engine.batch_plan = batch_plan
        self._forward.use(dataloader, batch_plan, self.layout.replica(self.env.launch_rank))
        if self.role is RankRole.FINISHED_BEFORE_JOIN:  # the others finished while this rank restarted
            return StepPlaceholders(0)
        return StepPlaceholders(batch_plan.steps_per_epoch)

    # -- one step ------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        """This rank's micro-batches of the current step (Lightning's closure calls this)."""
        if self.role is RankRole.RETIRED:  # Lightning may run more batches before it honours should_stop
            return {"loss": torch.zeros(())}
        engine = self.engine
        step = self.lightning_module.trainer.global_step
        self._streams.restore()
        joined, engine.next_step = self.role is RankRole.JOINED, step
        if joined:  # a joiner's first step: Lightning's collectives span the world now
            self.role = RankRole.MEMBER
        self._heartbeat.start(engine.watch.waited)
        if not joined:  # (the members saved this step's state before admitting it)
            self._state.save_if_due(step, engine, self.worker)
        self._forward.begin_step()
        try:
            engine.begin_step(step)
        except Retired:
            # The member schedule dropped this rank: it stops quietly, the others go on.
            self.retired_at, self.role = step, RankRole.RETIRED
            self.lightning_module.trainer.should_stop = True
            return {"loss": torch.zeros(())}
        return {"loss": self._forward.step_loss()}

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The micro-batches' gradients were accumulated in ``training_step``: reduce them, resiliently."""
        if self.role is RankRole.RETIRED:
            return closure_loss  # no gradients: the optimizer skips parameters without one
        report = self.engine.finish_gradients()  # (raises NonFiniteError on every rank alike: no optimizer step)
        self._forward.log_totals(self.lightning_module)
        self._state.settle()  # a snapshot's copy from the GPU (beside the step's compute) ends before the step
        self.reports.append(report)
        self._sigterm.stop_if_agreed(report.step)
        self._heartbeat.point(self.env.launch_rank, report.step, at="before_optimizer_step")
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Lightning's optimizer step (a retired rank only runs the closure), then this step's heartbeat."""
        retired = self.role is RankRole.RETIRED  # no gradients to step with (nor to unscale: a scaler would refuse)
        output = closure() if retired else super().optimizer_step(optimizer, closure, model, **kwargs)
        step = self.engine.next_step
        self.engine.next_step = step + 1
        if not retired:
            _refresh(self, overlap=self.overlap_param_gather)
        self._heartbeat.beat(step, self.engine.watch.waited)  # iteration to iteration, callbacks included
        self._heartbeat.point(self.env.launch_rank, step, at="after_optimizer_step")
        return output

    @override
    def on_train_end(self) -> None:
        """No more iterations; a member's ``fit`` ended normally."""
        self.worker.set_paused(True)  # saving and teardown are not a hang
        # Ranks still waiting to join may stop waiting (teardown), whatever this rank's role: a joiner whose fit
        # ends before its first step (its state was at the last step already) says so too.
        self._fit_ended = True
        if self.role is RankRole.MEMBER:
            self.role = RankRole.TRAINED

    @override
    def on_validation_start(self) -> None:
        """A declared pause, not a hang; a sharded optimizer's stale parameters (a failed gather) gathered first."""
        trainer = self.lightning_module.trainer  # (the sanity check runs before any step: nothing is stale)
        if self.engine is not None and self.role in (RankRole.MEMBER, RankRole.JOINED) and not trainer.sanity_checking:
            _refresh(self, validation=True)
        self.worker.set_paused(True)

    @override
    def on_validation_end(self) -> None:
        """The pause of validation ends (unless the members agreed to stop); the next iteration is timed from now."""
        if not self._sigterm.stopping:  # (after the stop's step: the pause lasts until the process ends)
            self.worker.set_paused(False)
        self._heartbeat.restart(self.engine.watch.waited if self.engine is not None else None)

    # -- Lightning's collectives ---------------------------------------------------
    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not self.role.local:
            super().barrier(*args, **kwargs)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj if self.role.local else super().broadcast(obj, src)

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return tensor if self.role.local else super().reduce(tensor, group, reduce_op)

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return tensor.unsqueeze(0) if self.role.local else super().all_gather(tensor, group, sync_grads)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Data-parallel replicas (every tensor/pipeline rank of a replica sees the same samples)."""
        members = self.engine.members if self.engine is not None and self.engine.members else None
        replica = self.layout.replica(self.env.launch_rank)
        if members is None or replica not in members:
            return {"num_replicas": self.env.world_size() // self.layout.size,
                    "rank": self.env.global_rank() // self.layout.size}
        return {"num_replicas": len(members), "rank": members.index(replica)}

    # -- Lightning's checkpoints ------------------------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state (a checkpoint's, a snapshot's); with ``overlap_param_gather`` a gather in flight is
        waited for first (a failed one leaves the parameters stale: the optimizer's state then refuses)."""
        if self.engine is not None and self.engine.protocol.gathering:
            _refresh(self)
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's state; sharded, a checkpoint's gathers every share (:meth:`ReplicaState.optimizer_state
        <unicron_elastic.strategy.lightning.replica_state.ReplicaState.optimizer_state>`)."""
        unsharded = lambda: super(UnicronMegatronStrategy, self).optimizer_state(optimizer)  # noqa: E731
        return unsharded() if self._state is None else self._state.optimizer_state(self.engine, unsharded)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Lightning's checkpoint; with TP x PP > 1 a directory ``filepath`` of one file per shard.

        Each shard's file (``<filepath>/tp<t>-pp<p>.ckpt``) is written by that
        shard's rank of the first member replica (every replica holds the same).
        A rank that is no member writes nothing: one that found training over
        when it came back (a restarted rank, a frozen node resumed after the
        group moved on) holds no trained state, and its launch rank may be 0.
        """
        if self.role is RankRole.FINISHED_BEFORE_JOIN:
            log.info("checkpoint_not_written", reason="not a member: training finished before this rank joined")
            return
        if self.layout.size == 1:
            super().save_checkpoint(checkpoint, filepath, storage_options)
        elif not self.role.local and self.env.global_rank() < self.layout.size:
            shard = self.layout.label(self.env.launch_rank)
            save_shard(self.checkpoint_io, checkpoint, filepath, shard, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's resume (``ckpt_path``); with TP x PP > 1 this rank's shard of the directory.

        Raises:
            ConfigError: With TP x PP > 1, the path is not a directory of shards (or lacks this rank's).
        """
        if self.layout.size == 1:
            return super().load_checkpoint(checkpoint_path, weights_only)
        return load_shard(self.checkpoint_io, checkpoint_path, self.layout.label(self.env.launch_rank), weights_only)

    # -- the end -------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        """Tell joiners training is over (if it is), close the feed and the tiers, destroy the world and the engine."""
        self.worker.set_paused(True)  # no more iterations (also after an exception): the teardown is not a hang
        if self._forward is not None:
            self._forward.close()  # the DataLoader's worker processes
        # Training is over only when fit ended normally or on an agreed stop. After a crash the restarted
        # ranks must resume, not conclude that the others finished.
        ended = self._fit_ended or self._sigterm.stopping
        if ended and self.engine is not None and self.engine.groups.held and self.role is not RankRole.RETIRED:
            self.engine.finish()
            self._state.keep_for_checkpoints(self.engine)  # (a sharded optimizer's, for one written after fit)
        if self._state is not None:
            self._state.close()  # (the snapshot in flight is sent first)
        for handle in self._progress_hooks:
            handle.remove()
        self._progress_hooks = []
        super().teardown()
        destroy_world()
        if self.engine is not None:
            self.engine.close()  # a gloo group alive at interpreter shutdown can abort the process

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``unicron_megatron`` in Lightning's strategy registry (once)."""
        if STRATEGY_NAME not in strategy_registry:
            strategy_registry.register(STRATEGY_NAME, cls, description="Unicron self-healing data parallelism "
                                       "(partial-iteration resumption, replica state reload)")


UnicronMegatronStrategy.register_strategies(StrategyRegistry)
