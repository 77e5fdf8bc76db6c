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

Reconfiguration happens between steps: the group's leader (lowest member)
publishes each step's membership (``unicron-dp/step<s>/members``, following a
``schedule`` - the coordinator's plan); ranks that are no longer members retire;
new ranks (``joining=True``, e.g. a worker the agent restarted) ask to join;
without a schedule the leader admits them at the next step boundary, with one
the schedule alone decides. They receive
the model, optimizer, RNG and step by broadcast from the leader, a healthy
replica. The global batch stays the same, so the parameter trajectory does not
depend on the DP size.

Assumes a single failure at a time (a second check-in timeout falls back to
whoever checked in).
"""

from __future__ import annotations

import io
import json
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


class Retired(Exception):
    """This rank is no longer a member of the data-parallel group (scale-in)."""


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
        members: Initial members (default ``0..world_size-1``).
        joining: This rank is not a member yet: :meth:`join` waits to be added.
        schedule: ``step -> members`` from that step on (the leader applies it).
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
        members: list[int] | None = None,
        joining: bool = False,
        schedule: dict[int, list[int]] | None = None,
    ) -> None:
        self.model, self.optimizer, self.plan = model, optimizer, plan
        self.batch, self.loss_fn, self.store = batch, loss_fn, store
        self.rank, self.timeout, self.checkin_timeout = rank, timeout, checkin_timeout
        self.hook = hook or (lambda *a, **k: None)
        self.world_size = world_size
        self.members = list(members if members is not None else range(world_size))
        self.generation = 0
        self.schedule = dict(schedule or {})
        self.next_step = 0
        self.params = [p for p in model.parameters() if p.requires_grad]
        numel = sum(p.numel() for p in self.params)
        size = bucket_numel or numel
        self.bounds = [(start, min(start + size, numel)) for start in range(0, numel, size)]
        self.pg: dist.ProcessGroupGloo | None = None
        if not joining:
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

    # -- membership ----------------------------------------------------------------
    def _sync_membership(self, step: int) -> None:
        """Agree on this step's members; resize (and hand state to newcomers) if they changed.

        Raises:
            Retired: This rank is not a member from ``step`` on.
        """
        key = f"unicron-dp/step{step}/members"
        if self.rank == self.members[0]:
            wanted = list(self.schedule.get(step, self.members))
            # without a plan, a restarted rank waiting to come back is admitted now
            if not self.schedule and self.store.add("unicron-dp/join-requests", 0) > 0:
                wanted += [r for r in range(self.world_size)
                           if r not in wanted and self.store.check([f"unicron-dp/join/{r}"])]
            self.store.set(key, json.dumps(wanted))
        else:
            wanted = json.loads(self.store.get(key))
        if wanted == self.members:
            return
        self._resize(sorted(wanted), step)

    def _resize(self, members: list[int], step: int) -> None:
        leader = self.members[0]
        if self.rank == leader:
            self.store.set("unicron-dp/latest", json.dumps(
                {"generation": self.generation + 1, "members": members, "step": step, "leader": leader}))
        if self.rank not in members:
            log.info("dp_retired", step=step, members=members)
            raise Retired(f"rank {self.rank} leaves the data-parallel group at step {step}")
        self._enter(self.generation + 1, members, leader)
        log.info("dp_resized", step=step, members=members, generation=self.generation)

    def _enter(self, generation: int, members: list[int], leader: int) -> None:
        if self.pg is not None:
            try:
                self.pg.abort()
            except RuntimeError:
                pass
        self.generation, self.members = generation, members
        self.pg = self._group()
        self._broadcast_state(members.index(leader))

    def finish(self) -> None:
        """Training is over: ranks still waiting in :meth:`join` give up waiting."""
        if self.members and self.rank == self.members[0]:
            self.store.set("unicron-dp/finished", str(self.next_step))

    def join(self, timeout: float = 120.0) -> int | None:
        """Wait until the group admits this rank, then load its state from a replica.

        Returns:
            The step to continue from; None if training finished first.

        Raises:
            TimeoutError: Not admitted within ``timeout`` seconds.
        """
        self.store.set(f"unicron-dp/join/{self.rank}", "1")
        self.store.add("unicron-dp/join-requests", 1)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.store.check(["unicron-dp/finished"]):
                log.info("dp_join_too_late", finished_at=int(self.store.get("unicron-dp/finished")))
                return None
            if self.store.check(["unicron-dp/latest"]):
                latest = json.loads(self.store.get("unicron-dp/latest"))
                if self.rank in latest["members"] and latest["generation"] > self.generation:
                    self._enter(latest["generation"], latest["members"], latest["leader"])
                    self.store.delete_key(f"unicron-dp/join/{self.rank}")
                    self.store.add("unicron-dp/join-requests", -1)
                    log.info("dp_joined", step=self.next_step, members=self.members)
                    return self.next_step
            time.sleep(0.01)
        raise TimeoutError(f"rank {self.rank} was not admitted to the data-parallel group in {timeout}s")

    def _broadcast_state(self, root: int) -> None:
        """Parameters, optimizer state, RNG and step from the replica at ``root``."""
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        if self.members.index(self.rank) == root:
            buffer = io.BytesIO()
            torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                        "rng": torch.get_rng_state(), "step": self.next_step}, buffer)
            payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self.pg.broadcast([size], opts).wait()
        if self.members.index(self.rank) != root:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self.pg.broadcast([payload], opts).wait()
        if self.members.index(self.rank) != root:
            state = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=False)
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            torch.set_rng_state(state["rng"])
            self.next_step = int(state["step"])

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

        Raises:
            Retired: The plan removed this rank from the group at ``step``.
        """
        self._sync_membership(step)
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
                moved = redistribute(assignment, dead)
                extra = moved.get(self.rank, [])
                assignment = {r: assignment[r] + moved[r] for r in self.members}
                if extra:
                    local = local + self._compute(step, extra)
                    report.micro_batches += extra
        grad = torch.cat([t for t in reduced if t is not None]) / self.plan.num_micro_batches
        offset = 0
        for p in self.params:
            p.grad = grad[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        self.optimizer.step()
        self.next_step = step + 1
        return report
