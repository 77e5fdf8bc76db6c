"""``Trainer(strategy="unicron_megatron")``: Lightning training that survives the loss of ranks.

The strategy is a :class:`~lightning.pytorch.strategies.DDPStrategy` that does
not wrap the model in DDP: one optimizer step is driven by
:class:`~unicron_elastic.strategy.elastic_dp.ElasticDataParallel` (paper
section 6), with the LightningModule's ``training_step`` as the loss of one
micro-batch:

* the train dataloader's dataset and settings are kept; the loop iterates one
  item per optimizer step, and micro-batch ``j`` of step ``s`` holds the samples
  :class:`GlobalBatchPlan` names (any rank can compute any micro-batch, so work
  moves when a rank dies). This rank's own micro-batches are loaded ahead by a
  ``DataLoader`` with the user's ``num_workers``, ``pin_memory``,
  ``persistent_workers``, ``prefetch_factor``...; moved ones are materialised on
  demand (:mod:`~unicron_elastic.strategy.feed`);
* ``training_step`` (Lightning's closure) computes this rank's micro-batches;
  ``backward`` is the resilient bucketed all-reduce (scenario 1 and 2
  recovery happen there); Lightning then clips, calls its hooks and steps;
* after a failure or a reconfiguration the default process group and
  megatron-core's ``parallel_state`` are rebuilt for the new members, so
  Lightning's own collectives (checkpoint saving, ``self.log(sync_dist=True)``)
  keep working;
* a worker the agent restarted (``UNICRON_WORKER_RESTARTS`` > 0) joins at the
  next step boundary and receives the whole Lightning state (weights,
  optimizer, loop progress, callbacks, RNG) by broadcast from a replica; when
  no replica is left, from the in-memory snapshot, else the newest disk
  checkpoint. All three carry the state as raw tensor bytes plus JSON
  (:mod:`~unicron_elastic.strategy.safe_state`): loading never unpickles, so the
  state may hold only plain data (no enums or custom objects, e.g. in hparams).

Registering: ``import unicron_elastic.strategy`` registers ``unicron_megatron``
in Lightning's strategy registry; so does ``import unicron_elastic`` when
Lightning was imported before it (Lightning has no plugin discovery for
strategies).
"""

from __future__ import annotations

import os
import random
import time
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

from unicron_elastic.api import ConfigError
from unicron_elastic.faults import maybe_fail
from unicron_elastic.meeting import MEETING_ENV, connect_meeting_store
from unicron_elastic.strategy.elastic_dp import ElasticDataParallel, Retired, StepReport
from unicron_elastic.strategy.environment import UnicronEnvironment
from unicron_elastic.strategy.feed import MicroBatchFeed
from unicron_elastic.strategy.microbatch import GlobalBatchPlan
from unicron_elastic.strategy.parallel import build_world, check_sizes, destroy_world
from unicron_elastic.strategy.snapshots import DiskCheckpoints, MemorySnapshot, PeerServers
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


def _loss_of(output: Any) -> torch.Tensor:
    """The loss in what ``training_step`` returned.

    Raises:
        ConfigError: Neither a tensor nor a dict with ``"loss"``.
    """
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    raise ConfigError("training_step must return the loss (a tensor, or a dict with 'loss') under unicron_megatron")


class UnicronMegatronStrategy(DDPStrategy):
    """Self-healing data parallelism (+ megatron-core TP/PP groups) for Lightning.

    Args:
        global_batch: Samples per optimizer step, constant across failures and
            reconfigurations (default: the dataloader's batch size x the
            launch world size).
        micro_batch: Samples per micro-batch (default: the dataloader's batch size).
        seed: Seed of the global-batch shuffle and of each micro-batch's RNG.
        bucket_numel: Gradient elements per all-reduce bucket (None: one bucket).
        tensor_model_parallel_size: megatron-core TP size.
        pipeline_model_parallel_size: megatron-core PP size.
        snapshot_every: Steps between in-memory snapshots (0: none).
        checkpoint_dir: Directory of asynchronous checkpoints in the safe state
            format (``step-<s>.state``; None: none).
        checkpoint_every: Steps between those saves.
        timeout: Collective timeout.
        checkin_timeout: After a failure, how long survivors wait for a rank that is alive but has
            not checked in (a stuck one: it is then left out and rejoins). Dead ranks are not waited for.
        join_timeout: How long a restarted rank waits to be admitted.
        members: The launch ranks that train from the start (default: all);
            the others wait to be added by ``schedule``.
        schedule: ``{step: members}``: the data-parallel members from that step
            on (the coordinator's plan: scale in or out with the same global
            batch). Ranks left out retire at that step (their ``fit`` ends);
            ranks added receive the state from a replica. The lowest member
            must stay in.
        grad_dtype: Dtype of gradient accumulation and all-reduce. float32
            (default): after a failure the sums are added in another order, so
            the parameters equal the failure-free ones to float32 rounding, which
            Adam-like optimizers can amplify. float64: equal to the last bit in
            practice, at twice the gradient memory and all-reduce volume.

    Raises:
        ConfigError: Invalid sizes or intervals.
    """

    def __init__(
        self,
        global_batch: int | None = None,
        micro_batch: int | None = None,
        seed: int = 0,
        bucket_numel: int | None = None,
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        snapshot_every: int = 50,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int = 100,
        timeout: timedelta = timedelta(seconds=60),
        checkin_timeout: float = 10.0,
        join_timeout: float = 300.0,
        members: list[int] | None = None,
        schedule: dict[int, list[int]] | None = None,
        grad_dtype: torch.dtype = torch.float32,
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
        if tensor_model_parallel_size * pipeline_model_parallel_size > 1:
            raise ConfigError("unicron_megatron trains with TP = PP = 1 for now; TP/PP > 1 groups are built by "
                              "unicron_elastic.strategy.parallel.build_world (see docs/strategy.md)")
        self.global_batch, self.micro_batch, self.seed = global_batch, micro_batch, seed
        self.bucket_numel = bucket_numel
        self.tp, self.pp = tensor_model_parallel_size, pipeline_model_parallel_size
        self.snapshot_every, self.checkpoint_every = snapshot_every, checkpoint_every
        self.checkpoint_dir = checkpoint_dir
        self.checkin_timeout, self.join_timeout = checkin_timeout, join_timeout
        self.grad_dtype = grad_dtype
        self.initial_members = sorted(members) if members is not None else None
        self.schedule = {int(step): sorted(ranks) for step, ranks in (schedule or {}).items()}
        self.finished_before_join = False
        self.retired_at: int | None = None  # the step the schedule removed this rank at
        self.engine: ElasticDataParallel | None = None
        self.reports: list[StepReport] = []
        self.joined_at: int | None = None  # the step a restarted rank joined at
        self._store: dist.Store | None = None
        self._local_only = False  # a joiner until its first step: Lightning's collectives stay local
        self._last_beat: float | None = None
        self._current = (0, 0)
        self._losses: list[torch.Tensor] = []
        self._feed: MicroBatchFeed | None = None
        self._rng: dict[str, Any] | None = None
        self._memory: MemorySnapshot | None = None
        self._disk: DiskCheckpoints | None = None
        self._worker = get_worker()

    @property
    def feed(self) -> MicroBatchFeed | None:
        """Where micro-batches come from (its ``fed``/``on_demand`` counters); None before the dataloader."""
        return self._feed

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
        the gradients still go through gloo (it reduces CUDA tensors); an NCCL
        transport is not built, and the CUDA path is untested here (no GPU).
        """
        if isinstance(self.accelerator, CUDAAccelerator):
            return torch.device("cuda", self.env.local_rank())
        return torch.device("cpu")

    @property
    def world_size(self) -> int:
        # A joiner catching up reports 1: Lightning's per-step collectives (e.g. the SIGTERM
        # broadcast before each batch) must not run in a world whose members passed that point.
        return 1 if self._local_only else super().world_size

    @property
    def joining(self) -> bool:
        """This process joins a running group: the agent restarted it, its node joined a running round
        (a returning node, or one that grew the run), or the schedule adds it later.

        After torch's restart-all (a rendezvous round after the run's first,
        ``$UNICRON_ROUND`` > 0: e.g. a run whose workers do not admit joiners
        past their world, grown by the coordinator's plan) every rank joins: with no replica left, the lowest
        one resumes from the in-memory snapshot or the disk checkpoint and the
        others take its state, instead of step 0.
        """
        restarted = int(os.environ.get("UNICRON_WORKER_RESTARTS", "0")) > 0
        restarted_all = int(os.environ.get("UNICRON_ROUND", "0") or 0) > 0
        return restarted or restarted_all or self.env.launch_rank not in self._members()

    def _members(self) -> list[int]:
        """The initial data-parallel members.

        Raises:
            ConfigError: Members or schedule name ranks outside the launch world.
        """
        world = self.env.launch_world_size
        members = self.initial_members if self.initial_members is not None else list(range(world))
        for ranks in [members, *self.schedule.values()]:
            if not ranks or not set(ranks) <= set(range(world)):
                raise ConfigError(f"members {ranks} must be a non-empty subset of ranks 0..{world - 1}")
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
        if os.environ.get(MEETING_ENV):
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
        if isinstance(self._store, dist.HashStore) or not os.environ.get(MEETING_ENV):
            return self._store
        return PeerServers(connect_meeting_store(timeout=timedelta(seconds=5)), self.env.node_rank())

    def setup_distributed(self) -> None:
        """Connect to the launcher's store and build the first world (a joiner waits until it is admitted).

        Raises:
            ConfigError: The world is not a multiple of TP x PP.
        """
        check_sizes(self.env.launch_world_size, self.tp, self.pp)
        self._store = self._connect_store()
        # (the exception hook is installed already); with a schedule, only the schedule changes the members
        self._worker.hello(resumable=True, leavable=not self.schedule, growable=not self.schedule)
        if self.joining:
            self._local_only = True
            self.set_world_ranks()
            return
        members = self._members()
        index = members.index(self.env.launch_rank)
        build_world(self._store, 0, index, len(members), self.tp, self.pp, self._timeout or timedelta(seconds=60))
        self.env.set_global_rank(index)
        self.env.set_world_size(len(members))
        self.set_world_ranks()

    def _on_group(self, members: list[int], generation: int) -> None:
        """The data-parallel members changed: rebuild the world Lightning and megatron-core use.

        Called inside the engine's regroup, which is a declared, bounded pause
        for the hang detector (the engine's ``pause``).
        """
        index = members.index(self.env.launch_rank)
        build_world(self._store, generation, index, len(members), self.tp, self.pp,
                    self._timeout or timedelta(seconds=60))
        self.env.set_global_rank(index)
        self.env.set_world_size(len(members))
        self.set_world_ranks()

    # -- setup --------------------------------------------------------------------
    def configure_ddp(self) -> None:
        """No DDP wrapper: gradients are reduced by the elastic engine."""

    def setup(self, trainer: Any) -> None:
        """Lightning's set-up, then the elastic engine; a restarted rank joins and restores here.

        Raises:
            ConfigError: Manual optimization, several optimizers or gradient accumulation.
        """
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        module = self.lightning_module
        if not module.automatic_optimization:
            raise ConfigError("unicron_megatron needs automatic optimization")
        if len(self.optimizers) != 1:
            raise ConfigError(f"unicron_megatron supports one optimizer (got {len(self.optimizers)})")
        if trainer.accumulate_grad_batches != 1:
            raise ConfigError("unicron_megatron accumulates micro-batches itself: use micro_batch/global_batch, "
                              "not accumulate_grad_batches")
        self._memory = MemorySnapshot(self._snapshot_store(), self.snapshot_every)
        if self.checkpoint_dir is not None:
            self._disk = DiskCheckpoints(self.checkpoint_dir, self.checkpoint_every)
        self.engine = ElasticDataParallel(
            module, self.optimizers[0], plan=None,  # the plan needs the dataset: set in process_dataloader
            batch=self._materialise, loss_fn=self._micro_batch_loss, store=self._store,
            rank=self.env.launch_rank, world_size=self.env.launch_world_size, bucket_numel=self.bucket_numel,
            timeout=self._timeout or timedelta(seconds=60), checkin_timeout=self.checkin_timeout,
            hook=self._hook, joining=self.joining, members=self._members(), schedule=self.schedule,
            get_state=self._state, set_state=self._load_state,
            on_group=self._on_group, fallback=self._fallback, grad_dtype=self.grad_dtype,
            pause=self._worker.set_paused,  # a regroup is a declared, bounded pause, not a hang
            on_drop=destroy_world,  # a survivor blocked in Lightning's per-step broadcast with this rank fails too
            max_world=self.env.max_world_size,  # nodes that grow the run join with ranks past WORLD_SIZE
        )
        if self.joining:
            self.joined_at = self.engine.join(self.join_timeout)
            self.finished_before_join = self.joined_at is None
            log.info("rank_rejoined", step=self.joined_at, state_from=self.engine.state_source,
                     finished_before_join=self.finished_before_join)

    # -- state ---------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        return {
            "lightning": self.lightning_module.trainer._checkpoint_connector.dump_checkpoint(),
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
        }

    def _load_state(self, state: dict[str, Any]) -> None:
        """Restore the whole Lightning state (Lightning's own resume path, fed from memory)."""
        connector = self.lightning_module.trainer._checkpoint_connector
        connector._loaded_checkpoint = state["lightning"]
        connector.restore_model()
        connector.restore_datamodule()
        connector.restore_callbacks()
        # Lightning's _run restores optimizers and loop progress right after setup()
        self._rng = state["rng"]

    def _fallback(self) -> dict[str, Any] | None:
        """No replica left: the newer of the in-memory snapshot and the newest disk checkpoint.

        The in-memory snapshot is the newest one of every agent's server this
        rank reaches (an unreachable one is skipped with a warning).
        """
        candidates = []
        memory = self._memory.load() if self._memory else None
        if memory is not None:
            candidates.append((memory["step"], 1, {**memory, "source": "memory"}))
        disk = self._disk.load() if self._disk else None
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
        plan = GlobalBatchPlan(len(dataset), self.global_batch or micro * self.env.launch_world_size, micro, self.seed)
        self.engine.plan = plan
        if self._feed is not None:
            self._feed.close()
        engine = self.engine
        self._feed = MicroBatchFeed(dataloader, plan, self.env.launch_rank, lambda: engine.members)
        if self.finished_before_join:  # the others finished while this rank restarted: nothing left to do
            return _Steps(0)
        return _Steps(plan.steps_per_epoch)

    def _materialise(self, indices: list[int]) -> Any:
        assert self._feed is not None, "no train dataloader was processed"
        step, j = self._current  # (set by the engine's hook just before it asks)
        # Lightning's transfer (the module's on_before/after_batch_transfer hooks), on every device alike
        return self.batch_to_device(self._feed.get(step, j, indices), self.root_device)

    # -- one step ------------------------------------------------------------------
    def _hook(self, rank: int, step: int, micro_batch: int | None = None, bucket: int | None = None,
              at: str | None = None) -> None:
        if micro_batch is not None:
            self._current = (step, micro_batch)  # the engine computes this micro-batch next
            self._worker.progress(step, micro_batch)
        maybe_fail(rank, step, micro_batch=micro_batch, bucket=bucket, at=at)

    def _micro_batch_loss(self, module: Any, batch: Any) -> torch.Tensor:
        step, j = self._current
        device = self.root_device
        cuda = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):  # dropout etc. do not depend on who computes micro-batch j
            seed = (self.seed * 1_000_003 + step) * 65_537 + j
            torch.default_generator.manual_seed(seed)
            if cuda:
                torch.cuda.default_generators[device.index].manual_seed(seed)  # this rank's GPU only
            loss = _loss_of(module.training_step(batch, j))
        self._losses.append(loss.detach())
        return loss

    def training_step(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        """This rank's micro-batches of the current step (Lightning's closure calls this)."""
        if self.retired_at is not None:  # Lightning may run more batches before it honours should_stop
            return {"loss": torch.zeros(())}
        engine = self.engine
        step = self.lightning_module.trainer.global_step
        if self._rng is not None:  # a joiner: continue the replica's random streams
            torch.set_rng_state(self._rng["torch"])
            np.random.set_state(self._rng["numpy"])
            random.setstate(self._rng["python"])
            self._rng = None
        self._local_only = False
        if self._last_beat is None:
            self._last_beat = time.monotonic()
        engine.next_step = step
        self._snapshot(step)
        self._losses = []
        try:
            engine.begin_step(step)
        except Retired:
            self.retired_at = step  # the plan dropped this rank: stop quietly, the others go on
            self._local_only = True
            self.lightning_module.trainer.should_stop = True
            return {"loss": torch.zeros(())}
        loss = torch.stack(self._losses).mean() if self._losses else torch.zeros(())
        return {"loss": loss}

    def _snapshot(self, step: int) -> None:
        engine = self.engine
        if self.env.launch_rank != engine.members[0]:
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
        report = self.engine.finish_gradients()
        self.reports.append(report)
        self._hook(self.env.launch_rank, report.step, at="before_optimizer_step")
        return closure_loss

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        step = self.engine.next_step
        self.engine.next_step = step + 1
        now = time.monotonic()
        self._worker.heartbeat(step, now - self._last_beat)  # iteration to iteration, callbacks included
        self._last_beat = now
        self._hook(self.env.launch_rank, step, at="after_optimizer_step")
        return output

    def on_train_end(self) -> None:
        self._worker.set_paused(True)  # no more iterations: saving and teardown are not a hang

    def on_validation_start(self) -> None:
        self._worker.set_paused(True)  # validation between steps is not a hang

    def on_validation_end(self) -> None:
        self._worker.set_paused(False)
        self._last_beat = time.monotonic()

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
        return {"num_replicas": self.env.world_size(), "rank": self.env.global_rank()}

    # -- the end -------------------------------------------------------------------
    def teardown(self) -> None:
        if self._feed is not None:
            self._feed.close()  # the DataLoader's worker processes
        if self.engine is not None and self.engine.pg is not None and self.retired_at is None:
            self.engine.finish()
        for saver in (self._memory, self._disk):
            if saver is not None:
                saver.wait()
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
