"""The step's exchanges: the gradient buckets' all-reduce, the commit over every rank, the members' agreement.

:class:`StepReduction` executes the protocol's ``Reduce``, ``AgreeMembers``
and ``SetGradients`` effects over the groups of the generation held
(:class:`~unicron_elastic.strategy.engine.groups.GenerationGroups`):

* each bucket is all-reduced on a copy, so the local sum survives a failure;
  the last bucket carries the slots (next members, stop request, NaN verdict:
  :class:`~unicron_elastic.strategy.engine.exchange.ExchangeSlots`);
* the buckets before it are started without waiting (:meth:`StepReduction.start`):
  from backward as their gradients are summed
  (:class:`~unicron_elastic.strategy.engine.overlap.BucketLauncher`), else all
  at once when the reduction begins; each ``Reduce`` waits for its bucket, so a
  failure is decided where it was before, bucket by bucket;
* with TP x PP > 1 a last, small all-reduce over every rank *commits* the
  step: it carries the slots, the shards' overflow verdicts, the primary
  replica's squared gradient norm and the step's totals; before it, the
  gradients partial on each tensor rank are reduced over the tensor group and
  the tied weight's over the first and the last stage
  (:class:`~unicron_elastic.strategy.engine.stage_sums.ReplicaSums`);
* ``p.grad`` is then the reduced sum divided by B (or by the step's token
  count with per-token loss).

A sharded optimizer or sequence parallelism plugs in here: another reduction
of the reduced sums before the commit, on the same groups.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from unicron_elastic.api import NonFiniteError
from unicron_elastic.strategy.engine import effects as E
from unicron_elastic.strategy.engine.engine_options import ModelReductions
from unicron_elastic.strategy.engine.exchange import Exchanged, ExchangeSlots
from unicron_elastic.strategy.engine.gradients import GradientBuffer, scale_to_norm
from unicron_elastic.strategy.engine.group_watch import GroupWatch
from unicron_elastic.strategy.engine.groups import GenerationGroups
from unicron_elastic.strategy.engine.protocol import Protocol
from unicron_elastic.strategy.engine.shard_layout import ShardLayout
from unicron_elastic.strategy.engine.stage_sums import ReplicaSums
from unicron_elastic.strategy.engine.step_totals import StepTotals
from unicron_elastic.strategy.engine.store_effects import EngineStore

__all__ = ["StepReduction"]


class StepReduction:
    """One rank's part of each step's exchanges, and what they said.

    Args:
        protocol: The protocol (its members and B, its micro-batches per step).
        groups: The groups of the generation held.
        store: The engine's store effects (the ranks that found a NaN or Inf).
        watch: Reports this rank's waits on its groups.
        max_replicas: Replicas the slots can name.
        overflow: With a loss scaler: whether this shard's reduced sum is not finite once unscaled.
        scatters: Reduce-scatter the buckets (:attr:`scatters`).
    """

    def __init__(self, protocol: Protocol, groups: GenerationGroups, store: EngineStore, watch: GroupWatch,
                 max_replicas: int, overflow: Callable[[torch.Tensor, int], bool] | None,
                 scatters: bool = False) -> None:
        self.protocol, self.groups, self.store, self.watch = protocol, groups, store, watch
        self.layout, self.rank = groups.layout, groups.rank
        self.replica, self.shard = self.layout.replica(self.rank), self.layout.shard(self.rank)
        self.overflow = overflow
        #: With TP x PP > 1 a last, small all-reduce over every rank commits the step (and carries the next members).
        self.committed = self.layout.size > 1
        #: The slots the step's last exchange carries (next members, overflow verdict, stop request).
        self.slots = ExchangeSlots(max_replicas)
        self.gradients: GradientBuffer | None = None
        #: With TP x PP > 1: the tied weight's sum across stages and the replica's gradient norm.
        self.sums: ReplicaSums | None = None
        #: What the model asks of each step besides the data-parallel sum.
        self.reductions = ModelReductions()
        #: Take the replica's gradient norm in each step's commit (:attr:`grad_norm`; TP x PP > 1), or in the last
        #: exchange of a reduce-scattered step (every share's).
        self.measure_norm = False
        #: Reduce-scatter the buckets (the distributed optimizer with one instance, TP = PP = 1): each member
        #: receives its share of the flat sum (:meth:`shares`); the last exchange carries the totals, the slots and
        #: the squared norm of every share.
        self.scatters = scatters
        #: This rank was asked to stop: sent in every exchange from now on.
        self.stop_requested = False
        #: A member asked to stop, as an exchange of the members said.
        self.stop_agreed = False
        #: With TP/PP: a shard's sum was not finite, as the step's commit said.
        self.overflow_agreed = False
        #: The last step's totals over the whole global batch (None before, or without ``reductions.totals``).
        self.totals: StepTotals | None = None
        #: The error of the last step when a rank found a NaN or Inf in it (no loss scaler), else None.
        self.non_finite: NonFiniteError | None = None
        self._squared_norm: float | None = None
        self._committed_totals: torch.Tensor | None = None
        #: Buckets started and not waited for: ``bucket -> (groups built, step, local sum's address, work, buffer,
        #: its wire buffer or None)``.
        self._in_flight: dict[int, tuple[int, int, int, dist.Work, torch.Tensor, torch.Tensor | None]] = {}
        #: ``point(step, bucket)``, right before a bucket starts (fault injection: ``fault_point(bucket=k)``).
        self.point: Callable[[int, int], None] = lambda step, bucket: None
        self._started: set[tuple[int, int, int]] = set()  # (groups built, step, bucket) started
        self._shares: tuple[tuple[int, ...], list[tuple[int, int]]] = ((), [])  # (members, their shares)

    def bind(self, gradients: GradientBuffer, sums: ReplicaSums | None, reductions: ModelReductions) -> None:
        """The gradient sums to reduce, the replica's sums (TP x PP > 1) and what the model asks of each step."""
        self.gradients, self.sums, self.reductions = gradients, sums, reductions

    def begin(self) -> None:
        """A step begins: forget what the last one's exchanges said."""
        self._started.clear()
        self._squared_norm = None
        self.totals, self._committed_totals, self.non_finite = None, None, None

    @property
    def in_primary_replica(self) -> bool:
        """This rank is a shard of the group's primary replica."""
        members = self.protocol.members
        return bool(members) and self.replica == members[0]

    # -- the slots -----------------------------------------------------------------------------------------
    def _offer(self, offer: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """Only one rank's proposal may count: with TP/PP the first shard's of the primary replica."""
        return offer if self.shard == 0 else None

    def _encode(self, members: tuple[int, ...] | None, dtype: torch.dtype, overflow: bool = False,
                non_finite: bool = False) -> torch.Tensor:
        return self.slots.encode(members, dtype, overflow, self.stop_requested, non_finite)

    def _exchanged(self, slots: torch.Tensor, step: int | None = None) -> Exchanged:
        """What summed slots say; notes a stop any rank asked for (sent on from now) and, for a step's last
        exchange, the ranks that found a NaN or Inf in it (:meth:`finish` raises)."""
        said = self.slots.decode(slots)
        if said.stop:
            self.stop_agreed = self.stop_requested = True
        if step is not None:
            ranks = self.store.non_finite_ranks(step, self.protocol.members) if said.non_finite else []
            self.non_finite = NonFiniteError(step, ranks) if said.non_finite else None
        return said

    # -- the effects ---------------------------------------------------------------------------------------
    def agree(self, effect: E.AgreeMembers) -> list[int]:
        """The members' agreement on the next members (a membership sync)."""
        group = self.groups.every_rank if self.committed else self.groups.shard
        if group is None:
            raise RuntimeError("no group to agree on the members in")
        payload = self._encode(self._offer(effect.offer), torch.int64).to(self.groups.transport.device)
        with self.watch.waiting("agree"):
            self.groups.transport.wait(group, group.allreduce([payload]))  # The primary's offer, zeros elsewhere.
        return self._exchanged(payload.cpu()).members

    @property
    def launchable(self) -> int:
        """How many buckets, from bucket 0, start without waiting: all but the one carrying the slots (TP x PP
        > 1: all, the commit carries them; reduce-scattered: all, the step's last exchange carries them)."""
        buckets = len(self.gradients.bounds) if self.gradients is not None else 0
        return buckets if self.committed or self.scatters else max(buckets - 1, 0)

    def start(self, step: int, bucket: int, local: torch.Tensor) -> None:
        """Copy ``bucket`` out of the local sum and start its all-reduce, without waiting (its ``Reduce`` waits).

        Buckets start in their order on every member (the caller's duty). Nothing starts without a group: the
        ``Reduce`` then fails as it would have.
        """
        self._forget_stale(step, local)
        if self.groups.shard is None or bucket in self._in_flight or bucket >= self.launchable:
            return
        self._started.add((self.groups.built, step, bucket))
        self.point(step, bucket)
        try:  # (no local name holds the group: see _commit)
            work, buf, wire = self._scatter(bucket, local) if self.scatters else self._all_reduce(bucket, local)
        except RuntimeError:  # the group failed already: the bucket's Reduce starts it again, and fails there
            return
        self._in_flight[bucket] = (self.groups.built, step, local.data_ptr(), work, buf, wire)

    def _all_reduce(self, bucket: int, local: torch.Tensor) -> tuple[dist.Work, torch.Tensor, torch.Tensor | None]:
        """Start ``bucket``'s all-reduce into its slice of the reduce buffer (through its wire buffer, if any)."""
        start, end = self.gradients.bounds[bucket]
        buf = self.gradients.reduce_buffer(local, self.slots.size)[start:end]
        wire = self.gradients.wire(bucket, local)
        sent = buf if wire is None else wire
        sent.copy_(local[start:end])  # a copy: the local sum survives a failure
        return self.groups.started(self.groups.shard.allreduce([sent])), buf, wire

    def shares(self) -> list[tuple[int, int]]:
        """(Reduce-scattered) per member of this step's members, in order, the ``(start, end)`` of the flat
        sum's gradients it receives: its share (the sharded optimizer's, one instance). Kept per members."""
        members = tuple(self.protocol.members)
        if self._shares[0] != members:
            layout = ShardLayout(members, 1)
            self._shares = (members, [layout.range_of(m, self.gradients.numel) for m in members])
        return self._shares[1]

    def _scatter(self, bucket: int, local: torch.Tensor) -> tuple[dist.Work, torch.Tensor, torch.Tensor | None]:
        """Start ``bucket``'s reduce-scatter (its gradients; the last bucket's extras travel in the last exchange):
        each member's part of it lands in its share's buffer. The local sum is read, not written."""
        gradients = self.gradients
        index, shares = self.protocol.members.index(self.replica), self.shares()
        gradients.scatter = shares[index]
        start, end = gradients.bounds[bucket][0], min(gradients.bounds[bucket][1], gradients.numel)
        parts = [(min(max(lo, start), end), min(max(hi, start), end)) for lo, hi in shares]
        wire = gradients.wire(bucket, local)
        source = local[start:end]
        if wire is not None:
            wire.copy_(source)
            source = wire
        mine = parts[index]
        first = gradients.scatter[0]
        buf = gradients.reduce_buffer(local, self.slots.size)[mine[0] - first:mine[1] - first]
        out = buf if wire is None else torch.empty_like(buf, dtype=wire.dtype)
        chunks = [source[lo - start:hi - start] for lo, hi in parts]
        return self.groups.started(self.groups.shard.reduce_scatter([out], [chunks])), buf, \
            None if wire is None else out

    def started(self, step: int, bucket: int) -> bool:
        """Whether ``bucket`` of ``step`` started in the groups held (its :attr:`point` was passed)."""
        return (self.groups.built, step, bucket) in self._started

    def reduce(self, effect: E.Reduce) -> tuple[torch.Tensor, list[int] | None]:
        """Wait for one bucket's all-reduce, started before or now (the last carries the slots), or the commit
        (TP x PP > 1). The buckets after it that start without waiting are started first, in their order.

        Raises:
            RuntimeError: The group failed (gloo's error), or was gone already.
        """
        local, gradients = effect.local, self.gradients
        if self.committed and effect.bucket == len(gradients.bounds):
            return local.new_zeros(0), self._commit(effect)
        if self.groups.shard is None:
            raise RuntimeError("the group failed before this reduction (membership sync)")
        for k in range(effect.bucket, self.launchable):
            self.start(effect.step, k, local)
        self._forget_stale(effect.step, local)
        if self.scatters:
            return self._reduce_scattered(effect)
        if effect.bucket in self._in_flight:
            *_, work, buf, wire = self._in_flight.pop(effect.bucket)
            with self.watch.waiting("reduce"):
                self.groups.transport.wait(self.groups.shard, work)
            self.groups.waited(work)
            if wire is not None:
                buf.copy_(wire)  # (widened back: the sums' dtype from here on)
            return buf, None
        start, end = gradients.bounds[effect.bucket]
        whole = gradients.reduce_buffer(local, self.slots.size)
        buf = whole[start:] if effect.last else whole[start:end]
        wire = gradients.wire(effect.bucket, local)  # (None for the last bucket)
        (buf[: end - start] if wire is None else wire).copy_(local[start:end])  # a copy: the local sum survives
        if effect.last:  # the slots follow it
            slots = self._encode(effect.offer, local.dtype, non_finite=self._finds_non_finite(effect.step, local))
            buf[end - start :].copy_(slots)
        sent = buf if wire is None else wire
        with self.watch.waiting("reduce"):
            self.groups.transport.wait(self.groups.shard, self.groups.shard.allreduce([sent]))
        if wire is not None:
            buf.copy_(wire)
        members = self._exchanged(buf[end - start :], effect.step).members if effect.last else None
        return buf[: end - start], members

    def _reduce_scattered(self, effect: E.Reduce) -> tuple[torch.Tensor, list[int] | None]:
        """Wait for a bucket's reduce-scatter (started before, or now); after the last bucket the step's last
        exchange: its totals (the local extras), the slots (with the overflow verdict of every share) and the
        squared norm of every share, summed over the members.

        Raises:
            RuntimeError: The group failed (gloo's error), or was gone already.
        """
        local, gradients = effect.local, self.gradients
        if effect.bucket in self._in_flight:
            *_, work, buf, wire = self._in_flight.pop(effect.bucket)
        else:  # (its start found the group failed: starting it again fails here)
            work, buf, wire = self._scatter(effect.bucket, local)
        with self.watch.waiting("reduce"):
            self.groups.transport.wait(self.groups.shard, work)
        self.groups.waited(work)
        if wire is not None:
            buf.copy_(wire)
        if not effect.last:
            return buf, None
        share = gradients.reduced_sum()
        gradients.reduced_extras().zero_()  # (the totals are not summed yet: the verdict divides by 1, as a commit)
        slots = self._encode(effect.offer, local.dtype, self._overflowed(),
                             self._finds_non_finite(effect.step, local))
        # (only when measured: a pass over the share, in the wait after backward)
        squared = torch.linalg.vector_norm(share).square().reshape(1).to(local.dtype) if self.measure_norm else \
            local.new_zeros(1)
        payload = torch.cat([gradients.extras_of(local), slots, squared])
        with self.watch.waiting("reduce"):
            self.groups.transport.wait(self.groups.shard, self.groups.shard.allreduce([payload]))
        extras = gradients.extras
        gradients.reduced_extras().copy_(payload[:extras])
        said = self._exchanged(payload[extras:extras + self.slots.size], effect.step)
        self.overflow_agreed = said.overflow
        self._squared_norm = float(payload[-1]) if self.measure_norm else None
        return buf, said.members

    def clip_grad_norm_(self, max_norm: float) -> float:
        """(Reduce-scattered) scale this rank's share of the reduced gradients so that the norm of all of them
        is at most ``max_norm`` (torch's ``clip_grad_norm_`` arithmetic); returns the norm before clipping.

        The model's parameters have no gradient to clip (the shares load from the reduce buffer): clip here,
        after :meth:`~unicron_elastic.strategy.engine.elastic_dp.ElasticDataParallel.finish_gradients` and
        before the optimizer's step, with :attr:`measure_norm` set before the step (the step's last exchange
        then sums the shares' squared norms).

        Raises:
            RuntimeError: The gradients are not reduce-scattered, :attr:`measure_norm` is not set, or no step's
                gradients were reduced yet.
        """
        norm, share = self.grad_norm, self.gradients.reduced_sum() if self.gradients is not None else None
        if not self.scatters or not self.measure_norm or norm is None or share is None:
            raise RuntimeError("clip_grad_norm_ needs this step's reduce-scattered gradients and their norm "
                               "(set engine.reduction.measure_norm = True before the step)")
        scale_to_norm([share], max_norm, torch.tensor(norm, dtype=torch.float32, device=share.device))
        return norm

    def _forget_stale(self, step: int, local: torch.Tensor) -> None:
        """Forget buckets started on groups gone since, for another step or from another local sum (the groups'
        abort settled their work)."""
        now = (self.groups.built, step, local.data_ptr())
        self._in_flight = {k: v for k, v in self._in_flight.items() if v[:3] == now}

    def _finds_non_finite(self, step: int, local: torch.Tensor) -> bool:
        """(No loss scaler) whether this rank's own sum (gradients and totals) holds a NaN or Inf.

        One sum over the local sum decides (a NaN or Inf anywhere makes it
        non-finite; on this CPU 0.3 ms for 3 M float32 elements against 11 ms
        for an element-wise ``isfinite``). Only a non-finite sum is checked
        element by element, so finite values whose sum overflows are not
        taken for a NaN. A rank that finds one says so in the store, for the
        error's message (a rare path: nothing is written otherwise).
        """
        if not self.reductions.check_finite or bool(torch.isfinite(local.sum())):
            return False
        if bool(torch.isfinite(local).all()):
            return False
        self.store.record_non_finite(step)
        return True

    def _overflowed(self) -> bool:
        """(At the commit) whether this shard's reduced gradient sum is not finite once unscaled (loss scaling).

        The data-parallel members of a shard hold the same reduced bytes, so
        they agree by construction; the shards of a replica do not, hence the
        commit's slot: every rank then follows the sum of the verdicts.
        """
        reduced = self.gradients.reduced_sum()
        if self.overflow is None or reduced is None:
            return False
        return self.overflow(reduced, self.divisor())

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
        # No local name holds the group: a failure's traceback keeps this frame, and the group must go with
        # the last reference GenerationGroups.abort drops (gloo's destructor closes its sockets).
        if self.groups.every_rank is None:
            raise RuntimeError("the group failed before the step's commit")
        reduced, sums, members = self.gradients.reduced_sum(), self.sums, self.protocol.members
        if sums.tensor_reduced:
            sums.exchange_tensor(reduced, self.groups.every_rank, self.layout.tensor_peers(members, self.rank),
                                 self.watch.waiting)
        if sums.tied is not None:
            sums.exchange(reduced, self.groups.every_rank, self._peer(sums.tied.peer_stage), self.watch.waiting)
        squared = sums.squared_norm(reduced) if self.measure_norm and self.in_primary_replica else 0.0
        non_finite = self._finds_non_finite(effect.step, effect.local)
        slots = self._encode(self._offer(effect.offer), torch.float64, self._overflowed(), non_finite)
        payload = torch.cat([slots, torch.tensor([squared], dtype=torch.float64), self._totals_offered()])
        payload = payload.to(self.groups.transport.device)
        with self.watch.waiting("commit"):
            self.groups.transport.wait(self.groups.every_rank, self.groups.every_rank.allreduce([payload]))
        payload = payload.cpu()
        said = self._exchanged(payload[: self.slots.size], effect.step)
        self.overflow_agreed = said.overflow
        self._squared_norm = float(payload[self.slots.size]) if self.measure_norm else None
        self._committed_totals = payload[self.slots.size + 1 :] if self.gradients.extras else None
        return said.members

    def _totals_offered(self) -> torch.Tensor:
        """This rank's part of the commit's totals: the data-parallel sum of the loss-computing shard of the
        primary replica (last stage, tensor rank 0), zeros elsewhere (float64, on the CPU)."""
        extras = self.gradients.reduced_extras()
        if extras is None or not self.gradients.extras:
            return torch.zeros(0, dtype=torch.float64)
        layout = self.layout
        computes_loss = layout.stage(self.rank) == layout.pipeline - 1 and layout.tensor_rank(self.rank) == 0
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

    def divisor(self) -> float:
        """What the reduced gradient sums are divided by: the step's token count with per-token loss (at least
        1: a step whose tokens are all masked has zero gradients), else B."""
        if self.reductions.per_token:
            totals = self.totals if self.totals is not None else self._step_totals()
            return max(totals.count, 1.0) if totals is not None else 1.0
        return self.protocol.micro_batches

    def _peer(self, stage: int) -> int:
        """The rank (in the every-rank group) of this replica's ``stage`` with this rank's tensor rank."""
        return self.layout.neighbour(self.protocol.members, self.rank, stage)

    def set_gradients(self, effect: E.SetGradients) -> None:
        """``p.grad`` = the reduced sum / B (NaN where another shard overflowed: the scaler skips the step here too).

        With a weight tied across stages, its part of the sum is first the sum over both stages.
        """
        self.totals = self._step_totals()
        if self.sums is not None:
            self.sums.apply(self.gradients.reduced_sum())
        self.gradients.set_gradients(self.divisor(), (self.committed or self.scatters) and self.overflow_agreed)

    def tie(self) -> None:
        """Make the copies of a weight tied across stages equal: the first stage's values (start of training).

        Every rank of the first and the last stage takes part, tied weight or
        not, so a mismatch is refused on both ends.

        Raises:
            ConfigError: The first and the last stage do not hold matching copies.
            RuntimeError: The peer failed, or there is no group.
        """
        sums = self.sums
        if sums is None or sums.pipeline_end is None:
            return
        if self.groups.every_rank is None:
            raise RuntimeError("no group to tie the pipeline stages' weights in")
        sums.tie(self.groups.every_rank, self._peer(sums.pipeline_end), self.watch.waiting)

    @property
    def grad_norm(self) -> float | None:
        """The norm of the whole replica's gradients of the last step (reduced sum / B, each parameter once).

        Taken in the step's commit (TP x PP > 1) when :attr:`measure_norm` is
        set; None otherwise, and until a step committed.
        """
        if self._squared_norm is None:
            return None
        return math.sqrt(self._squared_norm) / self.divisor()
