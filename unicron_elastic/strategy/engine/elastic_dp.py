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
:attr:`ElasticDataParallel.grad_norm`).

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
:attr:`~ElasticDataParallel.stop_agreed` after the same step and no extra
collective runs per step. A rank that saw it sends it on; one that stops
records it (:meth:`~ElasticDataParallel.stopping`), so ranks that regroup
because that exchange failed on them learn it when their group forms.

The sequencing is :class:`~unicron_elastic.strategy.engine.protocol.Protocol`'s, a
state machine that yields effects; this class is its real *transport*: it
executes them with gloo groups, the store and the clock (``tests/fake_dp.py``
is the in-process one the property tests use).
"""

from __future__ import annotations

import gc
import json
import math
import sys
import time
from collections.abc import Callable, Generator
from typing import Any

import structlog
import torch
import torch.distributed as dist

from unicron_elastic.api import ConfigError, NonFiniteError, StoreUnavailableError, renamed_keywords
from unicron_elastic.store.keys import MeetingKeys as K
from unicron_elastic.strategy.engine import effects as E
from unicron_elastic.strategy.engine.bootstrap import watch_members
from unicron_elastic.strategy.engine.effects import Excluded, ReplicaBroken, Retired, StepReport
from unicron_elastic.strategy.engine.engine_options import EngineHooks, EngineOptions, ModelReductions
from unicron_elastic.strategy.engine.exchange import Exchanged, ExchangeSlots
from unicron_elastic.strategy.engine.gradients import GradientBuffer
from unicron_elastic.strategy.engine.joining import PAUSED, JoiningPath
from unicron_elastic.strategy.engine.membership import MembershipError
from unicron_elastic.strategy.engine.microbatch import GlobalBatchPlan
from unicron_elastic.strategy.engine.pipeline import StageLinks, forward_only, run_pipeline, schedule_for
from unicron_elastic.strategy.engine.protocol import Protocol
from unicron_elastic.strategy.engine.replicas import ModelParallel, ReplicaMembership, live_replicas, stages_to_backpropagate
from unicron_elastic.strategy.engine.requests import RequestReader
from unicron_elastic.strategy.engine.stage_sums import ReplicaSums
from unicron_elastic.strategy.engine.step_totals import StepTotals
from unicron_elastic.strategy.engine.transport import GlooTransport, is_peer_failure
from unicron_elastic.strategy.engine.group_watch import GroupWatch

__all__ = ["ElasticDataParallel", "EngineHooks", "EngineOptions", "Excluded", "ReplicaBroken", "Retired", "StepReport"]

log = structlog.get_logger(__name__)



class ElasticDataParallel(JoiningPath):
    """One data-parallel replica of a model, resilient to the loss of peers (the protocol's real transport).

    With tensor/pipeline parallelism it is this rank's shard of one replica
    (``model_parallel``): ranks, members and schedules below are then counted
    in *replicas* where they name data-parallel members (``members``,
    ``member_schedule``, :attr:`members`, :meth:`waiting`), and in launch ranks
    otherwise (``rank``, ``world_size``, ``max_world``).

    Args:
        model: The model (same initial parameters on every rank; with TP/PP,
            this rank's shard, the same on every replica). None: given later
            to :meth:`bind` (a joiner that must be admitted, and so have its
            world, before it can build a model from megatron-core's layers:
            :meth:`start_join`).
        optimizer: Its optimizer (None with ``model``).
        batch_plan: The global-batch plan (B micro-batches per step); None until
            :attr:`batch_plan` is set (the Lightning strategy sets it in ``setup``).
            ``plan=`` is its deprecated name (until 0.3).
        batch: ``indices -> batch`` (materialises any micro-batch).
        loss_fn: ``(model, batch) -> loss`` (mean over the micro-batch); with
            ``pipeline > 1`` see ``stage_fn``.
        store: A store every rank reaches that outlives workers (the agent's).
        rank: This launch rank.
        world_size: Launch world size (ranks).
        members: Initial members (default all; replicas with TP/PP).
        joining: This rank is not a member yet: :meth:`join` waits to be added.
        member_schedule: ``step -> members`` from that step on, given by hand (the primary
            applies it). ``schedule=`` is its deprecated name (until 0.3).
        options: Buckets, timeouts, the gradient dtype, the most ranks, the
            model's layout, the transport (:class:`~unicron_elastic.strategy.engine.engine_options.EngineOptions`).
        hooks: What the engine calls back: fault injection, a pipeline stage's
            forward, the state a joiner gets, group changes, the fallback state,
            pauses and waits for the hang detector, the loss scaler's verdict
            (:class:`~unicron_elastic.strategy.engine.engine_options.EngineHooks`).

    Raises:
        ValueError: ``max_world`` is smaller than ``world_size``.
        ConfigError: The world is not a multiple of TP x PP, or ``pipeline > 1`` without ``stage_fn``.
    """

    @renamed_keywords(plan="batch_plan", schedule="member_schedule")  # deprecated alias, remove in 0.3
    def __init__(
        self,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        batch_plan: GlobalBatchPlan | None,
        batch: Callable[[list[int]], Any],
        loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None,
        store: dist.Store,
        rank: int,
        world_size: int,
        *,
        members: list[int] | None = None,
        joining: bool = False,
        member_schedule: dict[int, list[int]] | None = None,
        options: EngineOptions = EngineOptions(),
        hooks: EngineHooks = EngineHooks(),
    ) -> None:
        timeout, checkin_timeout, bucket_numel = options.timeout, options.checkin_timeout, options.bucket_numel
        max_world, stage_fn = options.max_world, hooks.stage_fn
        if max_world is not None and max_world < world_size:
            raise ValueError(f"max_world {max_world} is smaller than world_size {world_size}")
        self.layout = options.model_parallel or ModelParallel()
        if self.layout.pipeline > 1 and stage_fn is None:
            raise ConfigError("a pipeline-parallel model needs stage_fn (each stage's forward of one micro-batch)")
        replicas = self.layout.replicas(world_size)
        self.model, self.optimizer, self._batch_plan = model, optimizer, batch_plan
        self.batch, self.loss_fn, self.stage_fn, self.store = batch, loss_fn, stage_fn, store
        self.rank, self.timeout, self.checkin_timeout = rank, timeout, checkin_timeout
        self.replica, self.shard = self.layout.replica(rank), self.layout.shard(rank)
        self.pipeline_schedule = options.pipeline_schedule
        self.hook = hooks.hook or (lambda *a, **k: None)
        self.world_size = world_size
        self.max_world = max_world or world_size
        self.max_replicas = max(self.max_world // self.layout.size, replicas)
        self.get_state = hooks.get_state or self._default_state
        self.set_state = hooks.set_state or self._load_default_state
        self.on_group = hooks.on_group or (lambda members, generation: None)
        self.fallback = hooks.fallback or (lambda step=None: None)
        self.grad_dtype = options.grad_dtype
        self.pause = hooks.pause or (lambda paused, bound: None)
        self.on_drop = hooks.on_drop or (lambda: None)
        self.transport = options.transport or GlooTransport()
        #: Watches this rank's waits on its groups: reports them, and gives a group up once a member is gone.
        self.watch = GroupWatch(hooks.report_waiting or (lambda waiting: None), self._gone, self._interrupt,
                                options.watch_times)
        self.state_source: str | None = None  # where a joiner's state came from
        self.stop_requested = False  # this rank was asked to stop (request_stop): sent in every exchange from now on
        self.stop_agreed = False  # a member asked to stop, as an exchange of the members said
        self.overflow = hooks.overflow  # (loss scaling) whether this shard's reduced sum is not finite once unscaled
        self.overflow_agreed = False  # with TP/PP: a shard's sum was not finite, as the step's commit said
        self._resume_state: Any = None  # fallback state a joiner hands to the others (joining.STEP0: the fresh one)
        self._resume_applied = False
        self.bucket_numel = bucket_numel
        #: This shard's gradient sums (made by :meth:`bind`).
        self.gradients: GradientBuffer | None = None
        #: With TP x PP > 1: the tied weight's sum across stages and the replica's gradient norm (made by :meth:`bind`).
        self.sums: ReplicaSums | None = None
        #: Take the replica's gradient norm in each step's commit (:attr:`grad_norm`; TP x PP > 1).
        self.measure_norm = False
        self._squared_norm: float | None = None
        #: What the model asks of each step besides the data-parallel sum (given to :meth:`bind`).
        self.reductions = ModelReductions()
        self._extras: torch.Tensor | None = None  # the running computation's totals (its sum's extra elements)
        self._committed_totals: torch.Tensor | None = None  # with TP/PP: the step's totals, as the commit said
        #: The last step's totals over the whole global batch (None before, or without ``reductions.totals``).
        self.totals: StepTotals | None = None
        #: The error of the last step when a rank found a NaN or Inf in it (no loss scaler), else None.
        self.non_finite: NonFiniteError | None = None
        # with TP/PP a last, small all-reduce over every rank commits the step (and carries the next members)
        self.committed = self.layout.size > 1
        self.membership = ReplicaMembership(store, self.layout, rank, self.max_replicas)
        self.protocol = Protocol(self.replica, list(members if members is not None else range(replicas)),
                                 batch_plan.num_micro_batches if batch_plan is not None else 0,  # (set with it)
                                 0, member_schedule, checkin_timeout, timeout.total_seconds(),  # (buckets: bind)
                                 authority=self.shard == 0, compute_needs_group=self.committed)
        self.pg: dist.ProcessGroup | None = None  # this shard's data-parallel group
        self.world_pg: dist.ProcessGroup | None = None  # with TP/PP: every rank (commit, pipeline)
        self._incarnations: dict[int, str] = {}
        self._bootstrap_stores: list[dist.Store] = []  # where each generation's groups bootstrapped (one small each)
        #: The join/leave requests' counter (the publishing rank reads it off the step's critical path).
        self.requests = RequestReader(store, rank)
        #: The slots the step's last exchange carries (next members, overflow verdict, stop request).
        self.slots = ExchangeSlots(self.max_replicas)
        self._shard_buckets: list[int] | None = None  # buckets of every shard (read once, for recomputations)
        #: ``(step, j)``: the micro-batch whose forward runs now (``batch``, ``loss_fn`` and ``stage_fn`` may read it).
        self.current_micro_batch: tuple[int, int] | None = None
        self.forward_only: list[int] = []  # steps whose recomputation ran this stage forward only (PP, scenario 2)
        self._joining: Any = None  # start_join's outcome: (generator, effect) paused for the model, or the step
        self._handlers: dict[type, Callable[[Any], Any]] = self._effect_handlers()
        if model is not None:
            self.bind(model, optimizer)
        if not joining:
            self.hook(rank, -1, at="before_first_group")
            self._set_groups(self.generation, self.members)
            self._note_incarnations()
            if self._publishes():
                self._publish_members()
            if model is not None:
                self.tie()

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
        self.reductions = reductions = reductions or ModelReductions()
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        extras = reductions.totals.size if reductions.totals is not None else 0
        self.gradients = GradientBuffer([p for _, p in named], self.grad_dtype, self.bucket_numel, extras=extras,
                                        main_grad=reductions.main_grad)
        if self.committed:  # the tied weight's sum, the tensor-partial gradients' sums and the replica's norm
            self.sums = ReplicaSums(self.gradients.params, [name for name, _ in named], self.layout, self.rank,
                                    reductions.tensor_reduced)
        self.model, self.optimizer = model, optimizer
        self.protocol.buckets = len(self.bounds) + self.committed
        if self.committed:
            self.store.set(K.buckets(self.shard), str(len(self.bounds)))

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """The parameters whose gradients the engine sums (none before :meth:`bind`)."""
        return [] if self.gradients is None else self.gradients.params

    @property
    def bounds(self) -> list[tuple[int, int]]:
        """``(start, end)`` of each gradient bucket (none before :meth:`bind`)."""
        return [] if self.gradients is None else self.gradients.bounds

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
    def schedule(self) -> dict[int, list[int]]:  # deprecated alias, remove in 0.3
        """Deprecated: :attr:`member_schedule`."""
        return self.member_schedule

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
    def plan(self) -> GlobalBatchPlan:  # deprecated alias, remove in 0.3
        """Deprecated: :attr:`batch_plan`."""
        return self.batch_plan

    @plan.setter  # deprecated alias, remove in 0.3
    def plan(self, batch_plan: GlobalBatchPlan) -> None:  # deprecated alias, remove in 0.3
        self.batch_plan = batch_plan

    @property
    def in_primary_replica(self) -> bool:
        """This rank is a shard of the group's primary replica (every such shard writes the snapshots and
        checkpoints of its part; only the first shard publishes the members)."""
        return bool(self.members) and self.replica == self.members[0]

    @property
    def leader(self) -> bool:  # deprecated alias, remove in 0.3
        """Deprecated: :attr:`in_primary_replica`."""
        return self.in_primary_replica

    # -- running the protocol --------------------------------------------------------
    def _run(self, effects: Generator[Any, Any, Any], pending: Any = None,
             until: tuple[type, ...] = ()) -> Any:
        """Execute the effects ``effects`` yields until it returns; an effect's exception is thrown into it.

        Args:
            effects: The protocol's generator.
            pending: An effect it yielded already, to execute first (a paused run).
            until: Effect types to stop at before executing them: returns
                ``(PAUSED, effect)`` (resume with ``pending=effect``).
        """
        result: Any = None
        error: BaseException | None = None
        effect = pending
        while True:
            if effect is None:
                try:
                    effect = effects.send(result) if error is None else effects.throw(error)
                except StopIteration as stop:
                    return stop.value
            if isinstance(effect, until):
                return PAUSED, effect
            result, error = None, None
            try:
                result = self._handlers[type(effect)](effect)
            except Exception as exc:  # noqa: BLE001 - the protocol decides (a failed collective is a RuntimeError)
                error = exc
            effect = None

    def _effect_handlers(self) -> dict[type, Callable[[Any], Any]]:
        membership = self.membership
        return {
            E.Point: self._point, E.Compute: self._compute_effect, E.Add: lambda e: e.total + e.extra,
            E.Reduce: self._reduce, E.AgreeMembers: self._agree, E.Pause: lambda e: self.pause(e.paused, e.bound),
            E.DropGroup: lambda e: self._drop_group(),
            E.CheckInFor: lambda e: membership.check_in(e.generation, e.checkin),
            E.ReadRecord: lambda e: membership.read_record(e.generation),
            E.ReadCheckIns: lambda e: membership.checkins(e.generation, e.ranks, self._malformed),
            E.AnyCheckedIn: lambda e: membership.any_checked_in(e.generation, e.ranks),
            E.MarkReady: lambda e: membership.mark_ready(e.generation),
            E.ReadReady: lambda e: membership.ready(e.generation, e.ranks),
            E.ReadAlive: self._read_alive, E.Now: lambda e: time.monotonic(), E.Sleep: lambda e: time.sleep(e.seconds),
            E.WriteRecord: lambda e: membership.write_record(e.record), E.Abandon: lambda e: None,
            E.BuildGroup: self._build, E.Formed: self._formed, E.ReadRequests: self._requests,
            E.ReadWaiting: lambda e: self.waiting(),
            E.Announce: self._announce, E.TransferState: self._transfer, E.SetGradients: self._set_gradients,
            E.ReadMembers: self._read_members, E.RequestJoin: self._request_join,
            E.ReadFinished: lambda e: int(self.store.get(K.FINISHED)) if self.store.check([K.FINISHED]) else None,
            E.ReadLatest: lambda e: json.loads(self.store.get(K.LATEST)) if self.store.check([K.LATEST]) else None,
            E.Admitted: self._admitted, E.Fallback: self._fallback,
            E.FreeGeneration: lambda e: membership.free_generation(e.generation),
            E.Decided: lambda e: None, E.Followed: lambda e: None, E.Reassigned: lambda e: None,
        }

    @staticmethod
    def _malformed(generation: int, rank: int, exc: MembershipError) -> None:
        log.warning("dp_checkin_malformed", generation=generation, rank=rank, error=str(exc)[:200])

    # -- groups ----------------------------------------------------------------
    def _set_groups(self, generation: int, members: list[int]) -> None:
        """Build this generation's groups: the shard's data-parallel group and, with TP/PP, the world's.

        They bootstrap in a store that stops waiting for a member whose
        liveness key is gone (:func:`~unicron_elastic.strategy.engine.bootstrap.watch_members`).

        Raises:
            RuntimeError: A member is gone while they form (:class:`~unicron_elastic.strategy.engine.bootstrap.MemberGoneError`
                as soon as its liveness key is gone, else a gloo error or the timeout).
            LookupError: Its bootstrap keys are gone (a store outage).
        """
        layout = self.layout
        store = watch_members(self.store, layout.ranks_of(members))
        self._bootstrap_stores.append(store)  # (groups call the Python store: it must outlive them)
        if not self.committed:
            self.pg = self.transport.new_group(dist.PrefixStore(K.group(generation), store),
                                               members.index(self.replica), len(members), self.timeout)
            return
        shard = dist.PrefixStore(K.shard_group(generation, self.shard), store)
        self.pg = self.transport.new_group(shard, members.index(self.replica), len(members), self.timeout)
        world = dist.PrefixStore(K.commit_group(generation), store)
        self.world_pg = self.transport.new_group(world, layout.world_rank(members, self.rank),
                                                 len(members) * layout.size, self.timeout)

    def _publishes(self) -> bool:
        return self.in_primary_replica and self.shard == 0

    def _publish_members(self) -> None:
        self.store.set(K.MEMBERS, json.dumps({"generation": self.generation, "members": self.members}))

    def _build(self, effect: E.BuildGroup) -> bool:
        """Build the record's groups, then ``on_group``'s world; False (all dropped) when a member is gone meanwhile."""
        record = effect.record
        try:
            self._set_groups(record.generation, list(record.members))
            self.on_group(list(record.members), record.generation)  # (the world the model's collectives use)
            return True
        except (RuntimeError, LookupError) as exc:  # a member died while the group or the world formed
            log.warning("dp_group_build_failed", generation=record.generation, error=str(exc)[:200])
            if self.pg is not None or self.world_pg is not None:
                self.on_drop()
            self._release_groups()
            return False

    def _formed(self, effect: E.Formed) -> None:
        self._note_incarnations()
        if not self.stop_requested and self.store.check([K.STOP]):  # members stopped: this group's exchange says so
            self.stop_requested = True
        if self._publishes():
            self._publish_members()

    def _drop_group(self) -> None:
        """Destroy the broken groups now, closing their connections.

        Dropping them at once (:class:`~unicron_elastic.strategy.engine.transport.CollectiveTransport`)
        makes every survivor blocked on this rank see the failure within
        milliseconds instead of after a timeout.
        """
        if self.pg is None and self.world_pg is None:
            return
        self.on_drop()
        self._release_groups()

    def _release_groups(self) -> None:
        """Abort this rank's groups and release them (the last reference: gloo's destructor closes the sockets)."""
        held_elsewhere = False
        for name in ("pg", "world_pg"):
            pg = getattr(self, name)
            if pg is None:
                continue
            setattr(self, name, None)
            self.transport.abort(pg)
            held_elsewhere |= sys.getrefcount(pg) > 2  # this name and getrefcount's argument
            del pg
        if held_elsewhere:  # e.g. a frame kept by a traceback: a full collection (slow with big models) frees it
            gc.collect()

    def _read_alive(self, effect: E.ReadAlive) -> set[int] | None:
        alive = self._alive_among(list(effect.ranks), effect.trained)
        if alive is None or not effect.exclude_waiting:
            return alive
        return alive - set(self.membership.partly_waiting())  # a rank waiting to join will not check in as a member

    def _alive_among(self, replicas: list[int], trained: bool = True) -> set[int] | None:
        """Those of ``replicas`` whose every rank is alive (``trained``: in the incarnation this rank trained
        with); None when no one keeps liveness keys.

        The liveness value names the incarnation: a rank restarted since the
        group formed is a joiner, not the member that must check in. A joiner
        (``trained`` False) trains with nobody: the keys alone count.
        """
        if not self.membership.liveness_kept():
            return None
        ranks = self.layout.ranks_of(replicas)
        live = self.membership.incarnations(ranks)
        noted = self._incarnations if trained else {}
        alive = {r for r, seen in live.items() if noted.get(r, seen) == seen}
        return live_replicas(self.layout, alive, replicas)

    def _gone(self) -> str | None:
        """(The watch's thread) why this rank's group cannot complete: members gone; None while all are alive.

        A member is gone when its liveness key is (its agent restarted it
        after a hang, or its node's lease expired: a frozen node) or names
        another incarnation than the group was formed with.
        """
        members = list(self.members)
        alive = self._alive_among(members) if members and self.pg is not None else None
        missing = sorted(set(members) - alive) if alive is not None else []
        if not missing:
            return None
        return f"generation {self.generation}: member(s) {missing} gone (liveness key expired or replaced)"

    def _interrupt(self, reason: str) -> None:
        """(The watch's thread) make this rank's operations in flight on its groups fail now."""
        for pg in (self.pg, self.world_pg):
            if pg is not None:
                self.transport.interrupt(pg)

    def _note_incarnations(self) -> None:
        """Remember which incarnation of each member's ranks this group was formed with."""
        self._incarnations = self.membership.incarnations(self.layout.ranks_of(self.members))

    # -- membership ----------------------------------------------------------------
    def _requests(self, effect: E.ReadRequests) -> tuple[list[int], list[int]]:
        """Joiners and members asked to leave: one counter read when there are none.

        The primary reads this every step, for the next step's members; the
        read began when this step began computing (:meth:`_prefetch_requests`).
        With etcd unreachable (an outage) it gives up after
        :data:`~unicron_elastic.strategy.engine.requests.REQUESTS_PATIENCE_S` and
        reports none, so training goes on and the requests are seen at a later step. With TP/PP only the
        first shard of the primary replica reads them (its offer is the one the
        commit carries); the others report none.
        """
        if self.shard != 0 and effect.proposal:
            return [], []
        try:
            count = self.requests.count_for(effect.step, effect.proposal)
        except StoreUnavailableError as exc:
            log.warning("requests_unreadable", error=str(exc)[:200])
            return [], []
        if count <= 0:
            return [], []
        return self.waiting(), self.membership.leaving(effect.members)

    def _prefetch_requests(self, step: int) -> None:
        """The publishing rank begins reading the requests for ``step + 1``'s members now, in a thread.

        The primary's proposal rides in the last bucket, which every other rank
        waits in: a store round trip there (a millisecond or more on a busy
        host) would delay the whole group each step. What was asked before
        ``step`` began computing is seen, as when read at its end; a later
        request waits one step more. With a ``member_schedule`` the primary reads none.
        """
        if self.shard != 0 or not self.protocol.reads_requests:  # (the first shard reads for its replica)
            return
        self.requests.prefetch(step)

    def withdraw_leave_request(self) -> None:
        """Forget this rank's leave request (it retired); a failure is logged, not raised (its agent withdraws too)."""
        self.requests.withdraw_leave()

    def request_stop(self) -> None:
        """Ask every member to stop after a step: the next exchange carries it (safe in a signal handler).

        Every member then sees :attr:`stop_agreed` after the same step (its
        last exchange: the commit with TP/PP, else the last gradient bucket);
        the caller stops there. Nothing is sent on its own.
        """
        self.stop_requested = True

    def _encode(self, members: list[int] | tuple[int, ...] | None, dtype: torch.dtype,
                overflow: bool = False, non_finite: bool = False) -> torch.Tensor:
        """This rank's slots of an exchange (:class:`~unicron_elastic.strategy.engine.exchange.ExchangeSlots`)."""
        return self.slots.encode(members, dtype, overflow, self.stop_requested, non_finite)

    def _decode(self, slots: torch.Tensor, step: int | None = None) -> list[int]:
        """The members summed slots carry; notes a stop any rank asked for (:attr:`stop_agreed`, sent on from now)
        and, for a step's last exchange, whether a rank found a NaN or Inf in it."""
        said = self._exchanged(slots)
        if step is not None:
            self._note_non_finite(step, said)
        return said.members

    def _note_non_finite(self, step: int, said: Exchanged) -> None:
        """Remember the ranks that found a NaN or Inf in ``step`` (:meth:`finish_gradients` raises)."""
        self.non_finite = NonFiniteError(step, self._non_finite_ranks(step)) if said.non_finite else None

    def _exchanged(self, slots: torch.Tensor) -> Exchanged:
        """What summed slots say; a stop any rank asked for is noted (:attr:`stop_agreed`, sent on from now)."""
        said = self.slots.decode(slots)
        if said.stop:
            self.stop_agreed = self.stop_requested = True
        return said

    def stopping(self, step: int) -> None:
        """This rank stops after ``step`` (:attr:`stop_agreed`): recorded for ranks that regroup after failing it.

        When the step's last exchange completed on some ranks only, the others
        regroup without them; the record makes their new group's exchange
        carry the stop too (read when a group forms). A store error is
        logged, not raised: the stop goes on.
        """
        try:
            self.store.set(K.STOP, str(step))
        except Exception as exc:  # noqa: BLE001 - stopping must not turn into a crash
            log.warning("stop_not_recorded", step=step, error=str(exc)[:200])

    def _offer(self, offer: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """Only one rank's proposal may count: with TP/PP the first shard's of the primary replica."""
        return offer if self.shard == 0 else None

    def _agree(self, effect: E.AgreeMembers) -> list[int]:
        group = self.world_pg if self.committed else self.pg
        if group is None:
            raise RuntimeError("no group to agree on the members in")
        payload = self._encode(self._offer(effect.offer), torch.int64).to(self.transport.device)
        with self.watch.waiting("agree"):
            group.allreduce([payload]).wait()  # the primary's proposal + zeros from the others
        return self._decode(payload.cpu())

    def _announce(self, effect: E.Announce) -> None:
        """Tell the ranks waiting in :meth:`join` that a record admits them, a root sending the state from a source."""
        record = effect.record
        self.store.set(K.LATEST, json.dumps({"generation": record.generation, "members": list(record.members),
                                             "step": record.step, "root": effect.root, "source": effect.source}))

    def finish(self) -> None:
        """Training is over: ranks still waiting in :meth:`join` give up waiting (any member says so)."""
        if self.replica in self.members and self.pg is not None:
            self.store.set(K.FINISHED, str(self.next_step))

    def close(self) -> None:
        """Destroy this rank's groups; call before the process exits.

        A gloo group still alive when the interpreter shuts down can abort the
        process ("terminate called without an active exception": its threads
        are torn down while running), so a finished rank would exit with SIGABRT.
        """
        self._drop_group()
        self.watch.close()
        self.requests.close()

    # -- one step ----------------------------------------------------------------
    def _point(self, effect: E.Point) -> None:
        if effect.kind == "bucket":
            self.hook(self.rank, effect.step, bucket=effect.index)

    def _compute_effect(self, effect: E.Compute) -> torch.Tensor:
        """Compute this rank's micro-batches of a step.

        Raises:
            ReplicaBroken: A collective of the model failed (a peer of this
                replica was lost). It carries the message only: the failed
                call's frames, which hold the groups, are freed, so that
                dropping the groups closes their connections at once and
                peers blocked on this rank fail now, not at their timeout.
        """
        if not effect.redo:
            self._prefetch_requests(effect.step)
        try:
            return self._compute(effect.step, list(effect.micro_batches), effect.redo)
        except RuntimeError as exc:
            if not (self.committed and is_peer_failure(exc)):
                raise
            message = f"rank {self.rank}: a collective of its model failed: {exc}"
        raise ReplicaBroken(message)  # outside the handler: no __context__ keeps the frames

    def _compute(self, step: int, micro_batches: list[int], redo: bool = False) -> torch.Tensor:
        gradients = self.gradients
        assert gradients is not None  # (a model is bound before any step)
        total, views = gradients.zeros(reuse=not redo)
        bound = gradients.bind(views)  # (or .grad cleared)
        self._extras = gradients.extras_of(total) if gradients.extras else None
        try:
            if self.layout.pipeline > 1:
                self._pipeline(step, micro_batches, redo, views, bound)
            else:
                for j in micro_batches:
                    self.current_micro_batch = (step, j)
                    self.hook(self.rank, step, micro_batch=j)
                    self.loss_fn(self.model, self.batch(self._batch_plan.indices(step, j))).backward()
                    if not bound:
                        gradients.accumulate(views)
            if bound:
                gradients.accumulate(views)  # a .grad that is not its view (a hook set it to None) is added
        finally:
            gradients.release()
            self._extras = None
        return total

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

    def _pipeline(self, step: int, micro_batches: list[int], redo: bool, views: list[torch.Tensor],
                  bound: bool) -> None:
        """This stage's part of ``micro_batches`` through the replica's pipeline (our schedule over gloo p2p).

        In a recomputation after a failure (``redo``) the stages below every
        stage that still needs gradients run forward only, and nothing runs
        when every stage kept its reduced buckets. ``bound``: autograd sums
        into ``views`` itself (:meth:`GradientBuffer.bind
        <unicron_elastic.strategy.engine.gradients.GradientBuffer.bind>`).
        """
        layout = self.layout
        stage, stages = layout.stage(self.rank), layout.pipeline
        backward = set(range(stages)) if not redo else self._stages_to_backpropagate()
        if not backward or not micro_batches:
            return
        if self.world_pg is None:
            raise RuntimeError("the group failed before this stage's pipeline ran")
        if stage in backward:
            ops = schedule_for(self.pipeline_schedule, stage, stages, len(micro_batches))
        else:  # this stage and every stage before it kept their reduced buckets: only later stages need it
            ops = forward_only(len(micro_batches))
            self.forward_only.append(step)
        links = StageLinks(layout.neighbour(self.members, self.rank, stage - 1) if stage > 0 else None,
                           layout.neighbour(self.members, self.rank, stage + 1) if stage < stages - 1 else None,
                           self.world_pg, send_gradients=stage - 1 in backward, waiting=self.watch.waiting)

        def forward(position: int, received: torch.Tensor | None) -> torch.Tensor:
            j = micro_batches[position]
            self.current_micro_batch = (step, j)
            self.hook(self.rank, step, micro_batch=j)
            return self.stage_fn(self.model, self.batch(self._batch_plan.indices(step, j)), received)

        run_pipeline(forward, ops, links, self.transport.device,
                     on_backward=None if bound else lambda _: self.gradients.accumulate(views))

    def _stages_to_backpropagate(self) -> set[int]:
        """After a regroup: the stages whose backward is still needed (from the record's buckets kept per shard)."""
        record = self.membership.record
        if record is None or not record.kept:
            return set(range(self.layout.pipeline))
        if self._shard_buckets is None:
            self._shard_buckets = [int(self.store.get(K.buckets(c))) for c in range(self.layout.size)]
        return stages_to_backpropagate(self.layout, record.kept, self._shard_buckets)

    def _reduce(self, effect: E.Reduce) -> tuple[torch.Tensor, list[int] | None]:
        local = effect.local
        if self.committed and effect.bucket == len(self.bounds):  # the step's commit, over every rank
            return local.new_zeros(0), self._commit(effect)
        if self.pg is None:
            raise RuntimeError("the group failed before this reduction (membership sync)")
        start, end = self.bounds[effect.bucket]
        whole = self.gradients.reduce_buffer(local, self.slots.size)  # a copy: the local sum survives a failure
        buf = whole[start:] if effect.last else whole[start:end]  # the last bucket: the slots follow it
        buf[: end - start].copy_(local[start:end])
        if effect.last:  # the next step's members ride along (the primary's proposal, zeros elsewhere)
            slots = self._encode(effect.offer, local.dtype, non_finite=self._finds_non_finite(effect.step, local))
            buf[end - start :].copy_(slots)
        with self.watch.waiting("reduce"):
            self.pg.allreduce([buf]).wait()
        return buf[: end - start], self._decode(buf[end - start :], effect.step) if effect.last else None

    def _finds_non_finite(self, step: int, local: torch.Tensor) -> bool:
        """(No loss scaler) whether this rank's own sum (gradients and totals) holds a NaN or Inf; says so in the
        store for the error's message (a rare path: nothing is written otherwise).

        One sum over the local sum decides (a NaN or Inf anywhere makes it non-finite; on this CPU 0.3 ms for
        3 M float32 elements against 11 ms for an element-wise ``isfinite``); only a non-finite sum is checked
        element by element, so finite values whose sum overflows are not taken for a NaN.
        """
        if not self.reductions.check_finite or bool(torch.isfinite(local.sum())):
            return False
        if bool(torch.isfinite(local).all()):
            return False
        self.store.set(K.non_finite(step, self.rank), json.dumps({"step": step, "rank": self.rank}))
        return True

    def _non_finite_ranks(self, step: int) -> list[int]:
        """The member ranks that said they found a NaN or Inf in ``step`` (lowest first)."""
        return [r for r in self.layout.ranks_of(self.members) if self.store.check([K.non_finite(step, r)])]

    def _overflowed(self) -> bool:
        """(At the commit) whether this shard's reduced gradient sum is not finite once unscaled (loss scaling).

        The data-parallel members of a shard hold the same reduced bytes, so
        they agree by construction; the shards of a replica do not, hence the
        commit's slot: every rank then follows the sum of the verdicts.
        """
        reduced = self.gradients.reduced_sum()
        if self.overflow is None or reduced is None:
            return False
        return self.overflow(reduced, self._divisor())

    def _commit(self, effect: E.Reduce) -> list[int]:
        """The step's commit over every rank (TP x PP > 1), after the tied weight's gradients are summed.

        One all-reduce of float64 slots carries the next step's members, the
        shards' overflow and non-finite verdicts, a stop request, the primary
        replica's shards' squared gradient norms (when the norm is measured)
        and the step's totals (from the primary replica's last stage, tensor
        rank 0: the stage that computes the loss). Before it, the gradients
        partial on each tensor rank are reduced over the tensor group and the
        tied weight's over the first and the last stage.

        Returns:
            The members the commit carries.

        Raises:
            RuntimeError: The group failed (gloo's error), or was gone already.
        """
        if self.world_pg is None:
            raise RuntimeError("the group failed before the step's commit")
        reduced = self.gradients.reduced_sum()
        sums = self.sums
        if sums.tensor_reduced:
            sums.exchange_tensor(reduced, self.world_pg, self.layout.tensor_peers(self.members, self.rank),
                                 self.watch.waiting)
        if sums.tied is not None:
            sums.exchange(reduced, self.world_pg, self._peer(sums.tied.peer_stage), self.watch.waiting)
        squared = sums.squared_norm(reduced) if self.measure_norm and self.in_primary_replica else 0.0
        non_finite = self._finds_non_finite(effect.step, effect.local)
        slots = self._encode(self._offer(effect.offer), torch.float64, self._overflowed(), non_finite)
        payload = torch.cat([slots, torch.tensor([squared], dtype=torch.float64), self._totals_offered()])
        payload = payload.to(self.transport.device)
        with self.watch.waiting("commit"):
            self.world_pg.allreduce([payload]).wait()
        payload = payload.cpu()
        totals = self.gradients.extras
        said = self._exchanged(payload[: self.slots.size])
        self._note_non_finite(effect.step, said)
        self.overflow_agreed = said.overflow
        self._squared_norm = float(payload[self.slots.size]) if self.measure_norm else None
        self._committed_totals = payload[self.slots.size + 1 :] if totals else None
        return said.members

    def _totals_offered(self) -> torch.Tensor:
        """This rank's part of the commit's totals: the data-parallel sum of the loss-computing shard of the
        primary replica (last stage, tensor rank 0), zeros elsewhere (float64, on the CPU)."""
        extras = self.gradients.reduced_extras()
        if extras is None or not self.gradients.extras:
            return torch.zeros(0, dtype=torch.float64)
        computes_loss = self.layout.stage(self.rank) == self.layout.pipeline - 1 and \
            self.layout.tensor_rank(self.rank) == 0
        if not (computes_loss and self.in_primary_replica):
            return torch.zeros(extras.numel(), dtype=torch.float64)
        return extras.to(torch.float64).cpu()

    def _step_totals(self) -> StepTotals | None:
        """The step's totals over its global batch (the reduced extras; with TP/PP what the commit said)."""
        layout = self.reductions.totals
        if layout is None:
            return None
        values = self._committed_totals if self.committed else self.gradients.reduced_extras()
        return None if values is None else layout.decode(values)

    def _divisor(self) -> float:
        """What the reduced gradient sums are divided by: the step's token count with per-token loss (at least
        1: a step whose tokens are all masked has zero gradients), else B."""
        if self.reductions.per_token:
            totals = self.totals if self.totals is not None else self._step_totals()
            return max(totals.count, 1.0) if totals is not None else 1.0
        return self._batch_plan.num_micro_batches

    def _peer(self, stage: int) -> int:
        """The rank (in the world group) of this replica's ``stage`` with this rank's tensor rank."""
        return self.layout.neighbour(self.members, self.rank, stage)

    def tie(self) -> None:
        """Make the copies of a weight tied across stages equal: the first stage's values (start of training).

        A member calls it once its model is bound (a joiner receives tied
        copies with its state). Every rank of the first and the last stage
        takes part, tied weight or not, so a mismatch is refused on both ends.

        Raises:
            ConfigError: The first and the last stage do not hold matching copies.
            RuntimeError: The peer failed, or there is no group.
        """
        sums = self.sums
        if sums is None or sums.pipeline_end is None:
            return
        if self.world_pg is None:
            raise RuntimeError("no group to tie the pipeline stages' weights in")
        sums.tie(self.world_pg, self._peer(sums.pipeline_end), self.watch.waiting)

    @property
    def grad_norm(self) -> float | None:
        """The norm of the whole replica's gradients of the last step (reduced sum / B, each parameter once).

        Taken in the step's commit (TP x PP > 1) when :attr:`measure_norm` is
        set; None otherwise, and until a step committed.
        """
        if self._squared_norm is None:
            return None
        return math.sqrt(self._squared_norm) / self._divisor()

    def _set_gradients(self, effect: E.SetGradients) -> None:
        """``p.grad`` = the reduced sum / B (NaN where another shard overflowed: the scaler skips the step here too).

        With a weight tied across stages, its part of the sum is first the sum over both stages.
        """
        self.totals = self._step_totals()
        if self.sums is not None:
            self.sums.apply(self.gradients.reduced_sum())
        self.gradients.set_gradients(self._divisor(), self.committed and self.overflow_agreed)

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
        self.requests.prefetched = None  # (a read begun with an earlier step: the membership sync reads afresh)
        self._squared_norm = None
        self.totals, self._committed_totals, self.non_finite = None, None, None
        try:
            return self._run(self.protocol.begin_step(step))
        except Retired:
            self.withdraw_leave_request()
            raise

    def finish_gradients(self) -> StepReport:
        """All-reduce the gradients of the step begun, surviving failures; set ``p.grad`` to sum / B.

        Raises:
            RuntimeError: No step was begun.
            Excluded: This rank is alive but a record left it out: it must :meth:`join`.
            NonFiniteError: A rank found a NaN or Inf in its loss or gradient sums of this step (no loss scaler);
                every member raises it, before any optimizer step.
        """
        report = self._run(self.protocol.finish_gradients())
        if self.non_finite is not None:
            raise self.non_finite
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
        self.hook(self.rank, step, at="before_optimizer_step")
        self.optimizer.step()
        self.next_step = step + 1
        self.hook(self.rank, step, at="after_optimizer_step")
        return report
