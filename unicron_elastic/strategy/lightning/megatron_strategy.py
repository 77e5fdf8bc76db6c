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
* SIGTERM (what ``unicron-run`` sends its workers when it stops) stops every
  rank after the same step: the signal only marks this rank, the step's own
  last exchange carries the mark to every member, and Lightning then ends
  each rank's ``fit`` at the end of that step (``SIGTERMException``). This
  replaces Lightning's broadcast of a SIGTERM flag before every batch (a
  barrier of every rank each step) and the one in its signal handler;
* a worker the agent restarted (``UNICRON_WORKER_RESTARTS`` > 0) joins at the
  next step boundary and receives the whole Lightning state (weights,
  optimizer, loop progress, callbacks, RNG) by broadcast from a replica; when
  no replica is left, from the in-memory snapshot, else the newest disk
  checkpoint. All three carry the state as raw tensor bytes plus JSON
  (:mod:`~unicron_elastic.strategy.snapshots.safe_state`): loading never unpickles, so the
  state may hold only plain data (no enums or custom objects, e.g. in hparams).

Registering: ``import unicron_elastic.strategy`` registers ``unicron_megatron``
in Lightning's strategy registry; so does ``import unicron_elastic`` when
Lightning was imported before it (Lightning has no plugin discovery for
strategies).
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from typing import Any

import numpy as np
import structlog
import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from unicron_elastic.api import ConfigError, renamed_keywords
from unicron_elastic.faults import maybe_fail
from unicron_elastic.env import meeting_text, round_, worker_restarts
from unicron_elastic.meeting import connect_meeting_store
from unicron_elastic.strategy.engine.bootstrap import watch_members
from unicron_elastic.strategy.engine.elastic_dp import ElasticDataParallel, Retired, StepReport
from unicron_elastic.strategy.engine.engine_options import EngineHooks, EngineOptions, ModelReductions
from unicron_elastic.strategy.lightning.environment import UnicronEnvironment
from unicron_elastic.strategy.lightning.feed import MicroBatchFeed
from unicron_elastic.strategy.lightning.megatron_checks import check_configs, check_wrappers
from unicron_elastic.strategy.engine.microbatch import GlobalBatchPlan
from unicron_elastic.strategy.lightning.model_groups import check_groups
from unicron_elastic.strategy.lightning.parallel import build_world, check_sizes, destroy_world, drop_world, rebuild_world
from unicron_elastic.strategy.engine.pipeline import SCHEDULES
from unicron_elastic.strategy.lightning.precision import (check_module, check_precision, loss_scaler, overflowed, scaled,
                                                start_scale)
from unicron_elastic.strategy.engine.replicas import ModelParallel
from unicron_elastic.strategy.lightning.megatron_reductions import model_reductions
from unicron_elastic.strategy.lightning.progress import watch_progress
from unicron_elastic.strategy.lightning.rng import megatron_tracker, micro_batch_rng, micro_batch_seed, seed_tracker
from unicron_elastic.strategy.snapshots.shard_checkpoints import load_shard, save_shard
from unicron_elastic.strategy.lightning.sigterm import SigtermTakeover
from unicron_elastic.strategy.snapshots.places import PeerServers
from unicron_elastic.strategy.snapshots.tiers import DiskCheckpoints, MemorySnapshot
from unicron_elastic.strategy.lightning.stages import MegatronStage, MicroBatchLoss, micro_batch_loss
from unicron_elastic.strategy.engine.transport import nccl_error_handling, transport_for
from unicron_elastic.worker import get_worker

log = structlog.get_logger(__name__)

STRATEGY_NAME = "unicron_megatron"


class _Steps:
    """What the training loop iterates: one placeholder per optimizer step of an epoch."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(self.steps))


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
        bucket_numel: Gradient elements per all-reduce bucket (None: one bucket per shard).
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
            from a replica. The lowest member must stay in. ``schedule=`` is its
            deprecated name (until 0.3).
        grad_dtype: Dtype of gradient accumulation and all-reduce. float32
            (default): after a failure the sums are added in another order, so
            the parameters equal the failure-free ones to float32 rounding, which
            Adam-like optimizers can amplify. float64: equal to the last bit in
            practice, at twice the gradient memory and all-reduce volume.
        report_keys: The keys of the ``report`` dict a Megatron-LM ``loss_func`` returns (``pretrain_gpt.py``:
            ``"lm loss"``); each is summed over the step's micro-batches and data-parallel ranks and logged as
            numerator / denominator, as Megatron-LM logs them.

    Raises:
        ConfigError: Invalid sizes, intervals or pipeline schedule.
    """

    @renamed_keywords(schedule="member_schedule")  # deprecated alias, remove in 0.3
    def __init__(
        self,
        global_batch: int | None = None,
        micro_batch: int | None = None,
        seed: int = 0,
        bucket_numel: int | None = None,
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        pipeline_schedule: str = "1f1b",
        snapshot_every: int = 50,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int = 100,
        timeout: timedelta = timedelta(seconds=60),
        checkin_timeout: float = 10.0,
        join_timeout: float = 300.0,
        members: list[int] | None = None,
        member_schedule: dict[int, list[int]] | None = None,
        grad_dtype: torch.dtype = torch.float32,
        report_keys: tuple[str, ...] = ("lm loss",),
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("cluster_environment", UnicronEnvironment())
        kwargs.setdefault("process_group_backend", "gloo")
        super().__init__(timeout=timeout, **kwargs)
        for name, value in (("global_batch", global_batch), ("micro_batch", micro_batch), ("bucket_numel", bucket_numel)):
            if value is not None and value < 1:
                raise ConfigError(f"{name}={value} must be >= 1")
        if snapshot_every < 0 or checkpoint_every < 0:
            raise ConfigError("snapshot_every and checkpoint_every must be >= 0")
        if pipeline_schedule not in SCHEDULES:
            raise ConfigError(f"unknown pipeline_schedule {pipeline_schedule!r}; choose one of {sorted(SCHEDULES)}")
        self.layout = ModelParallel(tensor_model_parallel_size, pipeline_model_parallel_size)
        self.global_batch, self.micro_batch, self.seed = global_batch, micro_batch, seed
        self.bucket_numel = bucket_numel
        self.tp, self.pp = tensor_model_parallel_size, pipeline_model_parallel_size
        self.pipeline_schedule = pipeline_schedule
        self.snapshot_every, self.checkpoint_every = snapshot_every, checkpoint_every
        self.checkpoint_dir = checkpoint_dir
        self.checkin_timeout, self.join_timeout = checkin_timeout, join_timeout
        self.grad_dtype = grad_dtype
        self.report_keys = tuple(report_keys)
        self._tracker: Any = None  # megatron-core's RNG tracker (None: none that can run here)
        self.initial_members = sorted(members) if members is not None else None
        self.member_schedule = {int(step): sorted(ranks) for step, ranks in (member_schedule or {}).items()}
        self.finished_before_join = False
        self._admission_started = False
        self.retired_at: int | None = None  # the step the member schedule removed this rank at
        self.engine: ElasticDataParallel | None = None
        self.reports: list[StepReport] = []
        self.joined_at: int | None = None  # the step a restarted rank joined at
        self._store: dist.Store | None = None
        self._world_stores: list[dist.Store] = []  # where each world bootstrapped (one small object each)
        self._local_only = False  # a joiner until its first step: Lightning's collectives stay local
        self._sigterm = SigtermTakeover(self)  # SIGTERM in the step's last exchange (fit)
        self._trained = False  # fit ended normally (on_train_end): ranks waiting to join may stop waiting
        self._last_beat: float | None = None
        self._progress_hooks: list[Any] = []
        self._waited_at_beat = 0.0  # the engine's waits (seconds) at the last heartbeat: busy = duration - waits
        self._losses: list[torch.Tensor] = []
        self._feed: MicroBatchFeed | None = None
        self._stage: Any = None  # this pipeline stage's forward of one micro-batch (set at fit)
        self._rng: dict[str, Any] | None = None
        self._memory: MemorySnapshot | None = None
        self._disk: DiskCheckpoints | None = None
        self._worker = get_worker()

    @property
    def feed(self) -> MicroBatchFeed | None:
        """Where micro-batches come from (its ``fed``/``on_demand`` counters); None before the dataloader."""
        return self._feed

    @property
    def schedule(self) -> dict[int, list[int]]:  # deprecated alias, remove in 0.3
        """Deprecated: :attr:`member_schedule`."""
        return self.member_schedule

    # -- environment ------------------------------------------------------------
    @property
    def env(self) -> UnicronEnvironment:
        assert isinstance(self.cluster_environment, UnicronEnvironment)
        return self.cluster_environment

    @property
    def root_device(self) -> torch.device:
        """``cuda:LOCAL_RANK`` when Lightning's accelerator is CUDA, else the CPU.

        (Not Lightning's ``parallel_devices[local_rank]``: under ``unicron-run`` the
        launcher, not ``devices=``, decides how many ranks a node runs.) On CUDA
        the world and the engine's groups are NCCL's
        (:class:`~unicron_elastic.strategy.engine.transport.NcclTransport`); that path
        is untested here (no GPU).
        """
        if isinstance(self.accelerator, CUDAAccelerator):
            return torch.device("cuda", self.env.local_rank())
        return torch.device("cpu")

    @property
    def world_size(self) -> int:
        # A joiner catching up reports 1: Lightning's collectives on the default group (e.g. a
        # sync_dist log) must not run in a world whose members passed that point.
        return 1 if self._local_only else super().world_size

    @property
    def local_only(self) -> bool:
        """Lightning's collectives stay on this rank (a joiner before its first step, a retired rank)."""
        return self._local_only

    @property
    def worker(self) -> Any:
        """This worker's end of the agent channel (:func:`~unicron_elastic.worker.get_worker`)."""
        return self._worker

    @property
    def joining(self) -> bool:
        """This process joins a running group: the agent restarted it, its node joined a running round
        (a returning node, or one that grew the run), or the member schedule adds it later.

        After torch's restart-all (a rendezvous round after the run's first,
        ``$UNICRON_ROUND`` > 0: e.g. a run whose workers do not admit joiners
        past their world, grown by the coordinator's plan) every rank joins: with no replica left, the lowest
        one resumes from the in-memory snapshot or the disk checkpoint and the
        others take its state, instead of step 0.
        """
        restarted = worker_restarts() > 0
        restarted_all = round_() > 0
        return restarted or restarted_all or self.replica not in self._members()

    @property
    def replica(self) -> int:
        """This rank's data-parallel replica (its launch rank when TP = PP = 1)."""
        return self.layout.replica(self.env.launch_rank)

    def _members(self) -> list[int]:
        """The initial data-parallel members (replicas).

        Raises:
            ConfigError: Members or the member schedule name replicas outside the launch world, or
                the world is not a multiple of TP x PP.
        """
        replicas = self.layout.replicas(self.env.launch_world_size)
        members = self.initial_members if self.initial_members is not None else list(range(replicas))
        unit = "ranks" if self.layout.size == 1 else "replicas"
        for ranks in [members, *self.member_schedule.values()]:
            if not ranks or not set(ranks) <= set(range(replicas)):
                raise ConfigError(f"members {ranks} must be a non-empty subset of {unit} 0..{replicas - 1}")
        return members

    def set_world_ranks(self) -> None:
        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank

    def _connect_store(self) -> dist.Store:
        """The workers' meeting store: etcd under ``unicron-run`` (survives any node), else the launcher's store.

        Raises:
            ConfigError: The launcher does not share its store with workers.
        """
        world = self.env.launch_world_size
        if world == 1 and "MASTER_PORT" not in os.environ:
            return dist.HashStore()
        if meeting_text():
            return connect_meeting_store()
        return self._agent_store()

    def _agent_store(self) -> dist.Store:
        """The launcher agent's TCPStore (on the rank-0 node): it outlives workers.

        Raises:
            ConfigError: The launcher does not share its store with workers.
        """
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "True") != "True":
            raise ConfigError("unicron_megatron needs the launcher's store (TORCHELASTIC_USE_AGENT_STORE=True, "
                              "unset TORCH_DISABLE_SHARE_RDZV_TCP_STORE): a store hosted by a worker dies with it")
        return dist.TCPStore(self.env.main_address, self.env.main_port, is_master=False,
                             timeout=timedelta(seconds=60))

    def _snapshot_store(self) -> dist.Store | PeerServers | None:
        """Where the in-memory snapshot lives (bulk bytes never go to etcd).

        Under ``unicron-run``: the agents' snapshot servers, the next live
        node's for writing (GEMINI's placement), every reachable one for
        reading. Under plain ``torchrun``: torch's agent TCPStore on the
        rank-0 node (the workers' store).
        """
        if isinstance(self._store, dist.HashStore) or not (meeting := meeting_text()):
            return self._store
        return PeerServers.from_meeting(meeting, self.env.node_rank())

    def setup_distributed(self) -> None:
        """Connect to the launcher's store, build the first world and the elastic engine.

        A joiner has no world yet: it is admitted in :meth:`model_sharded_context`,
        right before Lightning calls ``configure_model()`` (megatron-core's
        parallel layers take their sizes from the world's tensor-parallel
        group), or in :meth:`setup` when the module has no ``configure_model``,
        and receives the state once its model exists.

        Raises:
            ConfigError: The world is not a multiple of TP x PP (or TP/PP > 1 without megatron-core).
        """
        check_sizes(self.env.launch_world_size, self.tp, self.pp)
        if self.root_device.type == "cuda":
            nccl_error_handling()  # before the first NCCL group: failures raise, they do not kill the worker
        self._store = self._connect_store()
        # (the exception hook is installed already); with a member schedule, only it changes the members
        self._worker.hello(resumable=True, leavable=not self.member_schedule, growable=not self.member_schedule)
        joining = self.joining
        if joining:
            self._local_only = True
            self.set_world_ranks()
        else:
            self._on_group(self._members(), 0)
        module = self.lightning_module
        if module is None or module.trainer is None or module.trainer.state.fn != TrainerFn.FITTING:
            return  # validate/test/predict: no elastic engine
        shard = self.layout.label(self.env.launch_rank) if self.layout.size > 1 else None
        self._memory = MemorySnapshot(self._snapshot_store(), self.snapshot_every, shard, self.layout.labels(),
                                      out_of_process=True)
        if self.checkpoint_dir is not None:
            self._disk = DiskCheckpoints(self.checkpoint_dir, self.checkpoint_every, shard=shard,
                                         shards=self.layout.labels())
        self.engine = self._engine(joining)

    def _admit(self) -> None:
        """(A joiner, once) wait until the group admits this rank and its world is built.

        Not in :meth:`setup_distributed`: Lightning's ``prepare_data`` comes
        after it and makes a group over the world (``_InfiniteBarrier``), which
        a joiner's world shares with members that are training.

        Raises:
            TimeoutError: Not admitted within ``join_timeout``.
        """
        if self.engine is None or not self.joining or self._admission_started:
            return
        self._admission_started = True
        self.finished_before_join = not self.engine.start_join(self.join_timeout)
        if self.finished_before_join:  # nothing left to train: a world of its own, so the model can be built
            log.info("not_joining", reason="training finished before this rank was admitted, or its node leaves "
                     "the task (dp_join_skipped)")
            build_world(dist.HashStore(), 0, 0, 1)

    @contextmanager
    def model_sharded_context(self) -> Iterator[None]:
        """Lightning's context of ``configure_model()``: a joiner is admitted first (its world must exist).

        Raises:
            ConfigError: On a CPU, megatron-core's constructor asked for CUDA to tie the embedding across
                stages (the message says how to build the model instead).
        """
        self._admit()
        self._seed_tracker()  # (megatron-core initializes weights on a GPU from its tracker's streams)
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

    def _seed_tracker(self) -> None:
        """(Once, with megatron-core's layers) seed megatron-core's RNG tracker as Megatron-LM does.

        Megatron-LM's ``_set_random_seed``: the seed plus 100 x the pipeline
        stage, then ``model_parallel_cuda_manual_seed`` (:func:`~unicron_elastic.strategy.lightning.rng.seed_tracker`).
        Each micro-batch then reseeds it from its own seed
        (:meth:`_micro_batch_rng`); this seeding serves what runs outside
        micro-batches (weight initialisation on a GPU, validation).
        """
        if self._tracker is not None or "megatron.core" not in sys.modules:
            return
        tracker = megatron_tracker(self.root_device)
        if tracker is None:
            return
        seed = self.seed + 100 * self.layout.stage(self.env.launch_rank)
        if self.root_device.type == "cuda":
            torch.cuda.manual_seed(seed)
        seed_tracker(tracker, seed, self.layout.tensor_rank(self.env.launch_rank))
        self._tracker = tracker

    def _engine(self, joining: bool) -> ElasticDataParallel:
        """The elastic engine, without its model yet (bound in :meth:`setup`)."""
        options = EngineOptions(
            bucket_numel=self.bucket_numel, timeout=self._timeout or timedelta(seconds=60),
            checkin_timeout=self.checkin_timeout, grad_dtype=self.grad_dtype,
            max_world=self.env.max_world_size,  # nodes that grow the run join with ranks past WORLD_SIZE
            model_parallel=self.layout, pipeline_schedule=self.pipeline_schedule,
            transport=transport_for(self.root_device),
        )
        hooks = EngineHooks(
            hook=self._hook, stage_fn=self._stage_forward if self.pp > 1 else None,
            get_state=self._state, set_state=self._load_state, on_group=self._on_group, fallback=self._fallback,
            pause=self._worker.set_paused,  # a regroup is a declared, bounded pause, not a hang
            report_waiting=self._worker.waiting,  # blocked on a peer: spared by the hang detector
            on_drop=self._drop_world,  # a survivor blocked in a TP collective (or Lightning's) fails too
            overflow=lambda total, micro_batches: overflowed(self.precision_plugin, total, micro_batches),
        )
        return ElasticDataParallel(
            None, None, batch_plan=None,  # the model comes in setup, the batch plan with the dataset (process_dataloader)
            batch=self._materialise, loss_fn=self._micro_batch_loss, store=self._store,
            rank=self.env.launch_rank, world_size=self.env.launch_world_size,
            joining=joining, members=self._members(), member_schedule=self.member_schedule, options=options, hooks=hooks,
        )

    def _drop_world(self) -> None:
        """This rank drops its groups (a failure): destroy the world too, so peers blocked in it fail at once
        (with TP > 1 a collective of the model; a collective of Lightning's on the default group)."""
        drop_world(self.lightning_module)

    def _on_group(self, members: list[int], generation: int) -> None:
        """The data-parallel members (replicas) changed: rebuild the world Lightning and megatron-core use.

        megatron-core's layers of the model are pointed at the new world's
        tensor-parallel group. Called inside the engine's regroup, which is a
        declared, bounded pause for the hang detector (the engine's ``pause``),
        and once before the engine exists (the first world). The world
        bootstraps in a store that stops waiting for a member whose liveness
        key is gone (:func:`~unicron_elastic.strategy.engine.bootstrap.watch_members`).

        Raises:
            MemberGoneError: A member is gone while the world forms (a
                :class:`torch.distributed.DistNetworkError`; the engine regroups).
        """
        backend = "nccl" if self.root_device.type == "cuda" else "gloo"
        store = watch_members(self._store, self.layout.ranks_of(members))
        self._world_stores.append(store)  # (the world's groups call the Python store: it must outlive them)
        index, size = rebuild_world(store, generation, self.layout, members, self.env.launch_rank,
                                    self._timeout or timedelta(seconds=60), backend, self.lightning_module)
        self.env.set_global_rank(index)
        self.env.set_world_size(size)
        self.set_world_ranks()

    # -- precision ------------------------------------------------------------------
    @property
    def precision_plugin(self) -> Any:
        """Lightning's precision plugin (``Precision()`` until the Trainer attaches one)."""
        return DDPStrategy.precision_plugin.fget(self)

    @precision_plugin.setter
    def precision_plugin(self, plugin: Any) -> None:
        check_precision(plugin)
        DDPStrategy.precision_plugin.fset(self, plugin)

    # -- setup --------------------------------------------------------------------
    def configure_ddp(self) -> None:
        """No DDP wrapper: gradients are reduced by the elastic engine."""

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
        self._check_fit(trainer, module)
        if self.engine is None:
            raise ConfigError("unicron_megatron: fit() reached setup without the engine setup_distributed builds")
        self._sigterm.take_over(trainer)
        self._admit()  # (a module without configure_model)
        if self.finished_before_join:  # the others finished while this rank restarted: nothing left to do
            log.info("rank_rejoined", step=None, state_from=None, finished_before_join=True)
            return
        self._seed_tracker()  # (a module without configure_model)
        self.engine.bind(module, self.optimizers[0], self._reductions(module))
        if not self._progress_hooks:  # the forward and backward of its modules and layers: progress within a step
            self._progress_hooks = watch_progress(module, lambda: self._worker.progress(self.engine.next_step))
        self._bind_stages(module)
        if not self.joining:  # (a joiner's tied copies come with its state)
            self.engine.tie()
        if self.layout.stage(self.env.launch_rank) < self.pp - 1:  # (a stage that scales no loss: once, not per
            start_scale(self.precision_plugin, self.root_device)  # micro-batch)
        if self._memory is not None and self.engine.in_primary_replica:
            self._memory.start()  # its writer process is ready before the first step (~1 s, once)
        if self.joining:
            self.joined_at = self.engine.finish_join()
            self.finished_before_join = self.joined_at is None
            log.info("rank_rejoined", step=self.joined_at, state_from=self.engine.state_source,
                     finished_before_join=self.finished_before_join)

    def _reductions(self, module: Any) -> ModelReductions:
        """What the engine does for this model each step besides the data-parallel sum (its megatron-core config:
        :mod:`~unicron_elastic.strategy.lightning.megatron_reductions`); the NaN check where no loss scaler is.

        Raises:
            ConfigError: See :func:`~unicron_elastic.strategy.lightning.megatron_reductions.model_reductions`.
        """
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        scaler = loss_scaler(self.precision_plugin)
        return model_reductions(module, named, self._megatron_shape(module), self.report_keys,
                                check_finite=scaler is None or not scaler.is_enabled())

    @staticmethod
    def _megatron_shape(module: Any) -> bool:
        """The module gives its step in Megatron-LM's shape (``forward_step``): the strategy logs the step's loss."""
        return callable(getattr(module, "forward_step", None))

    def _bind_stages(self, module: Any) -> None:
        """This stage's forward and, with TP x PP > 1, clipping by the replica's gradient norm.

        Lightning's precision plugin clips with ``clip_grad_by_norm``; with
        TP x PP > 1 that would clip each shard by its own norm, so the plugin's
        is replaced by :meth:`_clip_by_global_norm` for this fit.
        """
        if self.pp > 1:
            last = self.layout.stage(self.env.launch_rank) == self.pp - 1
            self._stage = MegatronStage(module, last) if callable(getattr(module, "forward_step", None)) \
                else module.pipeline_forward
        if self.layout.size > 1:
            self.engine.measure_norm = True  # (one pass over this shard's reduced sums, on the primary replica)
            self.precision_plugin.clip_grad_by_norm = self._clip_by_global_norm

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
        norm = self.engine.grad_norm if self.engine is not None else None
        scaler = loss_scaler(self.precision_plugin)
        if norm is not None and scaler is not None and scaler.is_enabled():
            norm /= scaler.get_scale()
        return norm

    def _clip_by_global_norm(self, optimizer: Any, clip_val: float) -> None:
        """Lightning's clipping by norm with the whole replica's norm (:attr:`grad_norm`), on every shard alike.

        Raises:
            RuntimeError: No norm was taken in this step.
        """
        norm = self.grad_norm
        if norm is None:
            raise RuntimeError("unicron_megatron: clipping by norm, but this step's commit took no gradient norm")
        if norm + 1e-6 <= clip_val:  # (torch clamps the coefficient at 1: nothing to scale; older releases'
            return                    # docs do not say they clamp)
        params = [p for p in self.precision_plugin.main_params(optimizer) if p.grad is not None]
        device = params[0].grad.device if params else self.root_device
        torch.nn.utils.clip_grads_with_norm_(params, clip_val, torch.tensor(norm, dtype=torch.float32, device=device))

    def _check_fit(self, trainer: Any, module: Any) -> None:
        """What this strategy cannot train, as clear errors.

        Raises:
            ConfigError: See :meth:`setup`; and megatron-core's DDP wrappers or optimizers, configs the
                strategy would train wrongly, groups it cannot rebuild
                (:mod:`~unicron_elastic.strategy.lightning.megatron_checks`, :mod:`~unicron_elastic.strategy.lightning.model_groups`).
        """
        if not module.automatic_optimization:
            raise ConfigError("unicron_megatron needs automatic optimization")
        if len(self.optimizers) != 1:
            raise ConfigError(f"unicron_megatron supports one optimizer (got {len(self.optimizers)})")
        if trainer.accumulate_grad_batches != 1:
            raise ConfigError("unicron_megatron accumulates micro-batches itself: use micro_batch/global_batch, "
                              "not accumulate_grad_batches")
        stages = [name for name in ("forward_step", "pipeline_forward") if callable(getattr(module, name, None))]
        if self.pp > 1 and len(stages) != 1:
            raise ConfigError(f"pipeline_model_parallel_size={self.pp}: the LightningModule must implement one of "
                              "forward_step(data_iterator, model) -> (output_tensor, loss_func) (Megatron-LM's "
                              "shape) or pipeline_forward(batch, input_tensor) (see docs/strategy.md); "
                              f"it has {stages or 'neither'}")
        check_module(self.precision_plugin, module, self.root_device)
        check_wrappers(module, self.optimizers)
        if not self.finished_before_join:  # (else the model was built in a world of its own, and trains nothing)
            check_configs(module, self.tp, self.pp)
            check_groups(module)

    # -- state ---------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
        if self._tracker is not None:  # megatron-core's tracker's streams (this shard's tensor rank)
            rng["megatron"] = {name: state.clone() for name, state in self._tracker.get_states().items()}
        return {"lightning": self.lightning_module.trainer._checkpoint_connector.dump_checkpoint(), "rng": rng}

    def _load_state(self, state: dict[str, Any]) -> None:
        """Restore the whole Lightning state (Lightning's own resume path, fed from memory)."""
        connector = self.lightning_module.trainer._checkpoint_connector
        connector._loaded_checkpoint = state["lightning"]
        connector.restore_model()
        connector.restore_datamodule()
        connector.restore_callbacks()
        # Lightning's _run restores optimizers and loop progress right after setup()
        self._rng = state["rng"]

    def _restore_rng(self) -> None:
        """(A joiner, at its first step) continue the replica's random streams: torch's, numpy's, Python's and
        megatron-core's tracker's."""
        if self._rng is None:
            return
        torch.set_rng_state(self._rng["torch"])
        np.random.set_state(self._rng["numpy"])
        random.setstate(self._rng["python"])
        if self._tracker is not None and self._rng.get("megatron"):
            self._tracker.set_states(dict(self._rng["megatron"]))
        self._rng = None

    def _fallback(self, step: int | None = None) -> dict[str, Any] | None:
        """No replica left: the newer of the in-memory snapshot and the newest disk checkpoint.

        The in-memory snapshot is the newest one of every agent's server this
        rank reaches (an unreachable one is skipped with a warning). With
        TP x PP > 1, the newest step every shard has; given ``step`` (the
        resuming replica's first shard chose it), this shard's state of that step.
        """
        candidates = []
        memory = self._memory.load(step) if self._memory else None
        if memory is not None:
            candidates.append((memory["step"], 1, {**memory, "source": "memory"}))
        disk = self._disk.load(step) if self._disk else None
        if disk is not None:
            candidates.append((disk["step"], 0, {**disk, "source": "disk"}))
        return max(candidates, key=lambda c: c[:2])[2] if candidates else None

    # -- data ----------------------------------------------------------------------
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
        replicas = self.layout.replicas(self.env.launch_world_size)
        batch_plan = GlobalBatchPlan(len(dataset), self.global_batch or micro * replicas, micro, self.seed)
        self.engine.batch_plan = batch_plan
        if self._feed is not None:
            self._feed.close()
        engine = self.engine
        # every rank of a replica computes the replica's micro-batches (TP: the same inputs; PP: each stage's part)
        self._feed = MicroBatchFeed(dataloader, batch_plan, self.replica, lambda: engine.members)
        if self.finished_before_join:  # the others finished while this rank restarted: nothing left to do
            return _Steps(0)
        return _Steps(batch_plan.steps_per_epoch)

    def _materialise(self, indices: list[int]) -> Any:
        assert self._feed is not None, "no train dataloader was processed"
        step, j = self.engine.current_micro_batch
        # Lightning's transfer (the module's on_before/after_batch_transfer hooks), on every device alike,
        # then the precision's input conversion (as Lightning's loop does for each batch)
        batch = self.batch_to_device(self._feed.get(step, j, indices), self.root_device)
        return self.precision_plugin.convert_input(batch)

    # -- one step ------------------------------------------------------------------
    def _hook(self, rank: int, step: int, micro_batch: int | None = None, bucket: int | None = None,
              at: str | None = None) -> None:
        """The engine's points of a step (each micro-batch, each bucket, around the optimizer step): progress for
        the hang detector, then the fault planned there in ``$UNICRON_FAULTS``, if any."""
        self._worker.progress(step, micro_batch or 0)
        maybe_fail(rank, step, micro_batch=micro_batch, bucket=bucket, at=at, waiting=self._worker.waiting)

    def _micro_batch_rng(self, stage: int = 0) -> AbstractContextManager[None]:
        """The random streams of the micro-batch being computed (:mod:`~unicron_elastic.strategy.lightning.rng`)."""
        step, j = self.engine.current_micro_batch
        return micro_batch_rng(micro_batch_seed(self.seed, step, j, stage if self.pp > 1 else None), self.root_device,
                               self._tracker, self.layout.tensor_rank(self.env.launch_rank))

    def _micro_batch_loss(self, module: Any, batch: Any) -> torch.Tensor:
        with self._micro_batch_rng(), self.precision_plugin.train_step_context():  # autocast: the forward only
            loss = micro_batch_loss(module.training_step(batch, self.engine.current_micro_batch[1]))
        return self._backward_loss(loss)

    def _backward_loss(self, loss: MicroBatchLoss) -> torch.Tensor:
        """What one micro-batch's backward runs on; its totals go into the step's (:mod:`~unicron_elastic.strategy.engine.step_totals`).

        Raises:
            ConfigError: Per-token loss without a token count, or a report with other keys than ``report_keys``.
        """
        reductions = self.engine.reductions
        per_token = reductions.per_token
        backward = loss.to_backward(per_token)
        self._losses.append(loss.mean.detach())
        if reductions.totals is not None:
            self.engine.record(reductions.totals.encode(loss.count(per_token), backward, loss.report))
        return scaled(self.precision_plugin, backward)  # (16-mixed: the backward of the scaled loss)

    def _stage_forward(self, module: Any, batch: Any, input_tensor: torch.Tensor | None) -> torch.Tensor:
        """One micro-batch through this rank's pipeline stage; the loss on the last.

        The module's ``forward_step`` in Megatron-LM's shape (:class:`~unicron_elastic.strategy.lightning.stages.MegatronStage`),
        or its ``pipeline_forward(batch, input_tensor)``.

        Raises:
            ConfigError: The last stage's ``pipeline_forward`` returned no loss, or another stage no tensor.
        """
        stage = self.layout.stage(self.env.launch_rank)
        with self._micro_batch_rng(stage), self.precision_plugin.train_step_context():
            output = self._stage(batch, input_tensor)
        if stage == self.pp - 1:
            output = self._backward_loss(micro_batch_loss(output))
        elif not isinstance(output, torch.Tensor):
            raise ConfigError(f"pipeline_forward on stage {stage} must return the activations for the next stage "
                              f"(a tensor), got {type(output).__name__}")
        return output

    def training_step(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        """This rank's micro-batches of the current step (Lightning's closure calls this)."""
        if self.retired_at is not None:  # Lightning may run more batches before it honours should_stop
            return {"loss": torch.zeros(())}
        engine = self.engine
        step = self.lightning_module.trainer.global_step
        self._restore_rng()
        self._local_only = False
        if self._last_beat is None:
            self._last_beat, self._waited_at_beat = time.monotonic(), engine.watch.waited
        engine.next_step = step
        self._snapshot(step)
        self._losses = []
        try:
            engine.begin_step(step)
        except Retired:
            self.retired_at = step  # the member schedule dropped this rank: stop quietly, the others go on
            self._local_only = True
            self.lightning_module.trainer.should_stop = True
            return {"loss": torch.zeros(())}
        loss = torch.stack(self._losses).mean() if self._losses else torch.zeros(())
        return {"loss": loss}

    def _snapshot(self, step: int) -> None:
        engine = self.engine
        if not engine.in_primary_replica:  # every shard of the primary replica saves its own part
            return
        memory_due = self._memory is not None and self._memory.due(step)
        disk_due = self._disk is not None and self._disk.due(step) and step > 0
        if memory_due or disk_due:
            with self._worker.checkpointing():
                state = engine.state()
                if memory_due:
                    self._memory.save(state)
                if disk_due:
                    self._disk.save(step, state)

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The micro-batches' gradients were accumulated in ``training_step``: reduce them, resiliently."""
        if self.retired_at is not None:
            return closure_loss  # no gradients: the optimizer skips parameters without one
        report = self.engine.finish_gradients()  # (raises NonFiniteError on every rank alike: no optimizer step)
        self._log_totals()
        if self._memory is not None:
            self._memory.settle()  # a snapshot's copy from the GPU (beside the step's compute) ends before the step
        self.reports.append(report)
        self._sigterm.stop_if_agreed(report.step)
        self._hook(self.env.launch_rank, report.step, at="before_optimizer_step")
        return closure_loss

    def _log_totals(self) -> None:
        """(Megatron-LM's shape) log the step's loss and report over its whole global batch, as Megatron-LM logs
        ``lm loss``: ``train_loss`` (with per-token loss the token-weighted mean) and each report key. Every rank
        holds the same values (the step's reduce or commit summed them)."""
        totals = self.engine.totals
        module = self.lightning_module
        if totals is None or not self._megatron_shape(module):
            return
        for name, value in {"train_loss": totals.loss, **totals.reported()}.items():
            module.log(name, value, on_step=True, on_epoch=False, batch_size=1)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self.retired_at is not None:  # no gradients to step with (nor to unscale: a loss scaler would refuse)
            output = closure()
        else:
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        step = self.engine.next_step
        self.engine.next_step = step + 1
        now, waited = time.monotonic(), self.engine.watch.waited
        duration = now - self._last_beat  # iteration to iteration, callbacks included
        self._worker.heartbeat(step, duration, busy=duration - (waited - self._waited_at_beat))
        self._last_beat, self._waited_at_beat = now, waited
        self._hook(self.env.launch_rank, step, at="after_optimizer_step")
        return output

    def on_train_end(self) -> None:
        self._worker.set_paused(True)  # no more iterations: saving and teardown are not a hang
        self._trained = True  # (fit ended normally: ranks still waiting to join may stop waiting)

    def on_validation_start(self) -> None:
        self._worker.set_paused(True)  # validation between steps is not a hang

    def on_validation_end(self) -> None:
        if not self._sigterm.stopping:  # (after the stop's step: the pause lasts until the process ends)
            self._worker.set_paused(False)
        self._last_beat = time.monotonic()
        if self.engine is not None:
            self._waited_at_beat = self.engine.watch.waited

    # -- Lightning's collectives ---------------------------------------------------
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not self._local_only:
            super().barrier(*args, **kwargs)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj if self._local_only else super().broadcast(obj, src)

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return tensor if self._local_only else super().reduce(tensor, group, reduce_op)

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return tensor.unsqueeze(0) if self._local_only else super().all_gather(tensor, group, sync_grads)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Data-parallel replicas (every tensor/pipeline rank of a replica sees the same samples)."""
        members = self.engine.members if self.engine is not None and self.engine.members else None
        if members is None or self.replica not in members:
            return {"num_replicas": self.env.world_size() // self.layout.size,
                    "rank": self.env.global_rank() // self.layout.size}
        return {"num_replicas": len(members), "rank": members.index(self.replica)}

    # -- Lightning's checkpoints ------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Lightning's checkpoint; with TP x PP > 1 a directory ``filepath`` of one file per shard.

        Each shard's file (``<filepath>/tp<t>-pp<p>.ckpt``) is written by that
        shard's rank of the first member replica (every replica holds the same).
        A rank that is no member writes nothing: one that found training over
        when it came back (a restarted rank, a frozen node resumed after the
        group moved on) holds no trained state, and its launch rank may be 0.
        """
        if self.finished_before_join:
            log.info("checkpoint_not_written", reason="not a member: training finished before this rank joined")
            return
        if self.layout.size == 1:
            super().save_checkpoint(checkpoint, filepath, storage_options)
        elif not self._local_only and self.env.global_rank() < self.layout.size:
            save_shard(self.checkpoint_io, checkpoint, filepath, self.layout.label(self.env.launch_rank), storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's resume (``ckpt_path``); with TP x PP > 1 this rank's shard of the directory.

        Raises:
            ConfigError: With TP x PP > 1, the path is not a directory of shards (or lacks this rank's).
        """
        if self.layout.size == 1:
            return super().load_checkpoint(checkpoint_path, weights_only)
        return load_shard(self.checkpoint_io, checkpoint_path, self.layout.label(self.env.launch_rank), weights_only)

    # -- the end -------------------------------------------------------------------
    def teardown(self) -> None:
        self._worker.set_paused(True)  # no more iterations (also after an exception): the teardown is not a hang
        if self._feed is not None:
            self._feed.close()  # the DataLoader's worker processes
        # training is over only when fit ended normally or on an agreed stop: after a crash the restarted ranks
        # must resume, not conclude that the others finished
        ended = self._trained or self._sigterm.stopping
        if ended and self.engine is not None and self.engine.pg is not None and self.retired_at is None:
            self.engine.finish()
        if self._memory is not None:
            self._memory.close()  # (the snapshot in flight is sent first)
        if self._disk is not None:
            self._disk.wait()
        for handle in self._progress_hooks:
            handle.remove()
        self._progress_hooks = []
        super().teardown()
        destroy_world()
        if self.engine is not None:
            self.engine.close()  # a gloo group alive at interpreter shutdown can abort the process

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if STRATEGY_NAME not in strategy_registry:
            strategy_registry.register(STRATEGY_NAME, cls, description="Unicron self-healing data parallelism "
                                       "(partial-iteration resumption, replica state reload)")


UnicronMegatronStrategy.register_strategies(StrategyRegistry)
