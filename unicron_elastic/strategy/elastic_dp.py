"""Data parallelism that survives the loss of ranks in the middle of a step (paper section 6).

:class:`ElasticDataParallel` runs one optimizer step as: compute this rank's
micro-batches (``deal``), accumulating gradients; all-reduce them bucket by
bucket (on copies: the local sums stay intact); divide by B; step. Gradients
are summed over micro-batches and divided by B, not by the DP size, so the
result does not depend on which rank computed which micro-batch.

When a peer dies (gloo raises on the broken connection):

* survivors abort the broken group so nobody waits for its timeout, check in
  under a new *generation* in the store (``unicron-dp/gen<N>/``) with the number
  of buckets they completed, and build a new gloo group of the survivors;
* scenario 1 (before the all-reduce, or in its first bucket): every bucket is
  redone; the dead rank's micro-batches are dealt round-robin to survivors,
  who add their gradients to the sums they kept;
* scenario 2 (during a bucketed all-reduce): buckets every survivor completed
  keep their reduced values (they contain the dead rank's part); the dead
  rank's micro-batches are recomputed and only the unreduced buckets are
  reduced again.

Assumes a single failure at a time (a second check-in timeout falls back to
whoever checked in). The restarted rank's way back (state from a replica)
belongs to the strategy; here the group simply continues smaller.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import structlog
import torch
import torch.distributed as dist

from unicron_elastic.strategy.microbatch import GlobalBatchPlan, deal, redistribute

log = structlog.get_logger(__name__)

Hook = Callable[..., None]


@dataclass
class StepReport:
    """What one step did on this rank.

    Attributes:
        step: The step.
        micro_batches: Micro-batch indices whose gradients this rank contributed
            to the buckets that were (re)reduced last.
        recoveries: Failures survived during the step.
        dead: Ranks lost during the step.
        kept_buckets: Buckets kept from before the last failure (scenario 2).
    """

    step: int
    micro_batches: list[int] = field(default_factory=list)
    recoveries: int = 0
    dead: list[int] = field(default_factory=list)
    kept_buckets: int = 0


class ElasticDataParallel:
    """One data-parallel replica of a model, resilient to the loss of peers.

    Args:
        model: The model (same initial parameters on every rank).
        optimizer: Its optimizer.
        plan: The global-batch plan (B micro-batches per step).
        batch: ``indices -> batch`` (materialises any micro-batch).
        loss_fn: ``(model, batch) -> loss`` (mean over the micro-batch).
        store: A store every rank reaches that outlives workers (the agent's).
        rank: This rank in the initial group.
        world_size: Initial data-parallel size.
        bucket_numel: Elements per gradient bucket (None: one bucket).
        timeout: Timeout of collectives.
        checkin_timeout: How long survivors wait for each other after a failure.
        hook: Called as ``hook(rank, step, micro_batch=j)`` before each
            micro-batch and ``hook(rank, step, bucket=k)`` before each bucket's
            reduction (fault injection: ``unicron_elastic.testing.maybe_fail``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        plan: GlobalBatchPlan,
        batch: Callable[[list[int]], Any],
        loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
        store: dist.Store,
        rank: int,
        world_size: int,
        bucket_numel: int | None = None,
        timeout: timedelta = timedelta(seconds=30),
        checkin_timeout: float = 10.0,
        hook: Hook | None = None,
    ) -> None:
        self.model, self.optimizer, self.plan = model, optimizer, plan
        self.batch, self.loss_fn, self.store = batch, loss_fn, store
        self.rank, self.timeout, self.checkin_timeout = rank, timeout, checkin_timeout
        self.hook = hook or (lambda *a, **k: None)
        self.members = list(range(world_size))
        self.generation = 0
        self.params = [p for p in model.parameters() if p.requires_grad]
        numel = sum(p.numel() for p in self.params)
        size = bucket_numel or numel
        self.bounds = [(start, min(start + size, numel)) for start in range(0, numel, size)]
        self.pg = self._group()

    # -- groups ----------------------------------------------------------------
    def _group(self) -> dist.ProcessGroupGloo:
        store = dist.PrefixStore(f"unicron-dp/gen{self.generation}/pg", self.store)
        return dist.ProcessGroupGloo(store, self.members.index(self.rank), len(self.members), self.timeout)

    def _reform(self, done: int) -> tuple[list[int], int]:
        """After a failure: new generation, survivors check in, new group.

        Returns:
            The dead ranks and the number of buckets every survivor completed.
        """
        try:
            self.pg.abort()  # peers blocked on us in the broken ring fail fast
        except RuntimeError:
            pass
        self.generation += 1
        base = f"unicron-dp/gen{self.generation}/alive/"
        self.store.set(f"{base}{self.rank}", str(done))
        deadline = time.monotonic() + self.checkin_timeout
        while True:
            alive = [r for r in self.members if self.store.check([f"{base}{r}"])]
            if len(alive) >= len(self.members) - 1 or time.monotonic() > deadline:
                break
            time.sleep(0.002)
        dead = [r for r in self.members if r not in alive]
        agreed = min(int(self.store.get(f"{base}{r}")) for r in alive)
        self.members = alive
        self.pg = self._group()
        log.warning("dp_group_reformed", generation=self.generation, dead=dead, survivors=alive, kept_buckets=agreed)
        return dead, agreed

    # -- one step ----------------------------------------------------------------
    def _compute(self, step: int, micro_batches: list[int]) -> torch.Tensor:
        total = torch.zeros(sum(p.numel() for p in self.params))
        for j in micro_batches:
            self.hook(self.rank, step, micro_batch=j)
            for p in self.params:
                p.grad = None
            self.loss_fn(self.model, self.batch(self.plan.indices(step, j))).backward()
            total += torch.cat([p.grad.reshape(-1) for p in self.params])
        return total

    def train_step(self, step: int) -> StepReport:
        """Run optimizer step ``step`` over the whole global batch, whatever ranks die.

        Returns:
            What this rank did.
        """
        report = StepReport(step)
        assignment = deal(self.plan.num_micro_batches, self.members)
        report.micro_batches = list(assignment[self.rank])
        local = self._compute(step, report.micro_batches)
        reduced: list[torch.Tensor | None] = [None] * len(self.bounds)
        done = 0
        while True:
            try:
                for k in range(done, len(self.bounds)):
                    self.hook(self.rank, step, bucket=k)
                    start, end = self.bounds[k]
                    buf = local[start:end].clone()  # reduce a copy: the local sum survives a failure
                    self.pg.allreduce([buf]).wait()
                    reduced[k] = buf
                    done = k + 1
                break
            except RuntimeError as exc:
                log.warning("dp_collective_failed", step=step, bucket=done, error=str(exc)[:200])
                dead, done = self._reform(done)
                report.recoveries += 1
                report.dead += dead
                report.kept_buckets = done
                extra = redistribute(assignment, dead).get(self.rank, [])
                assignment = {r: assignment[r] + redistribute(assignment, dead)[r] for r in self.members}
                if extra:
                    local = local + self._compute(step, extra)
                    report.micro_batches += extra
        grad = torch.cat([t for t in reduced if t is not None]) / self.plan.num_micro_batches
        offset = 0
        for p in self.params:
            p.grad = grad[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        self.optimizer.step()
        return report
