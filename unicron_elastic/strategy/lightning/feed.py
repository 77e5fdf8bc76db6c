"""This rank's micro-batches through the user's ``DataLoader`` settings (workers, pinning, prefetching).

The engine asks for micro-batch ``j`` of step ``s`` by its sample indices
(:meth:`GlobalBatchPlan.indices`), in the order it computes them. Most of them
are foreseeable: this rank's share of each step, dealt round-robin over the
data-parallel members (:func:`~unicron_elastic.strategy.engine.microbatch.deal`). A
:class:`MicroBatchFeed` runs a ``torch.utils.data.DataLoader`` with the user's
``num_workers``, ``collate_fn``, ``pin_memory``, ``prefetch_factor``,
``persistent_workers``, ``worker_init_fn``, ``multiprocessing_context``,
``timeout`` and ``generator`` (``in_order`` forced on) over a batch sampler that yields exactly those
micro-batches, step after step, so the workers load the next ones while this
rank computes.

What cannot be foreseen is materialised on demand in this process, as before:
a dead rank's micro-batches moved to this one (scenario 1), a micro-batch asked
out of the expected order. When the members change, the first micro-batch of a
step that does not match the expected one restarts the sampler from there
under the new members (with ``persistent_workers`` the workers stay).

The batches are the same either way (``collate_fn`` over the same samples), so
the trajectory does not depend on ``num_workers``. A dataset whose
``__getitem__`` draws random numbers gets them from each worker's own seed, as
with any ``DataLoader``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import structlog
import torch
from torch.utils.data import DataLoader

from unicron_elastic.strategy.engine.microbatch import GlobalBatchPlan, deal

log = structlog.get_logger(__name__)

#: DataLoader settings taken over from the user's loader (``prefetch_factor`` only with workers).
_SETTINGS = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
             "generator", "persistent_workers", "pin_memory_device", "in_order")


class _Order:
    """The batch sampler: this rank's micro-batches from ``(step, first)`` on, dealt over fixed members.

    Every key it yields is appended to ``issued`` (the DataLoader returns the
    batches in this order: ``in_order``).
    """

    def __init__(self, batch_plan: GlobalBatchPlan, rank: int) -> None:
        self.batch_plan, self.rank = batch_plan, rank
        self.start: tuple[int, int, tuple[int, ...]] = (0, 0, (rank,))
        self.issued: deque[tuple[int, int]] = deque()

    def __iter__(self) -> Iterator[list[int]]:
        step, first, members = self.start
        begin = (step, first)
        self.issued.clear()
        mine = deal(self.batch_plan.num_micro_batches, list(members)).get(self.rank, [])
        if not mine:
            return
        while True:
            for j in mine:
                if (step, j) >= begin:
                    self.issued.append((step, j))
                    yield self.batch_plan.indices(step, j)
            step += 1


class MicroBatchFeed:
    """Materialises micro-batches, through DataLoader workers where the order is foreseeable.

    Args:
        loader: The user's train ``DataLoader`` (its dataset and settings are used).
        batch_plan: The global-batch plan.
        rank: This rank (launch rank).
        members: Returns the current data-parallel members.
    """

    def __init__(self, loader: DataLoader, batch_plan: GlobalBatchPlan, rank: int,
                 members: Callable[[], list[int]]) -> None:
        self.dataset = loader.dataset
        self.collate = loader.collate_fn
        self.rank = rank
        self._members = members
        self.num_workers = int(loader.num_workers)
        self._order = _Order(batch_plan, rank)
        self._loader: DataLoader | None = None
        self._iter: Iterator[Any] | None = None
        self.fed = 0  # micro-batches that came from the loader (its workers, when it has any)
        self.on_demand = 0  # micro-batches materialised here
        self.restarts = 0
        if self.num_workers > 0:
            settings = {name: getattr(loader, name) for name in _SETTINGS if hasattr(loader, name)}
            settings["prefetch_factor"] = loader.prefetch_factor
            settings["in_order"] = True  # batches come back in the sampler's order (the keys in ``issued``)
            if settings.get("generator") is None:  # each new iterator draws the workers' base seed from it:
                settings["generator"] = torch.Generator().manual_seed(batch_plan.seed)  # not from the global RNG
            self._loader = DataLoader(self.dataset, batch_sampler=self._order, **settings)

    def get(self, step: int, j: int, indices: list[int]) -> Any:
        """The batch of micro-batch ``j`` of ``step`` (sample ``indices``)."""
        if self._loader is not None:
            issued = self._order.issued
            members = tuple(self._members())
            expected = self._iter is not None and bool(issued) and issued[0] == (step, j)
            if self._starts_step(step, j, members) and not (expected and members == self._order.start[2]):
                self._restart(step, j, members)
            if self._iter is not None and issued and issued[0] == (step, j):
                issued.popleft()
                self.fed += 1
                return next(self._iter)
        self.on_demand += 1
        return self.collate([self.dataset[i] for i in indices])

    def _starts_step(self, step: int, j: int, members: tuple[int, ...]) -> bool:
        """Whether ``j`` is this rank's first micro-batch of ``step`` when dealt over ``members``."""
        mine = deal(self._order.batch_plan.num_micro_batches, list(members)).get(self.rank, [])
        return bool(mine) and mine[0] == j

    def _restart(self, step: int, j: int, members: tuple[int, ...]) -> None:
        """Restart the sampler at ``(step, j)`` dealt over ``members`` (workers kept if persistent)."""
        assert self._loader is not None
        self._order.start = (step, j, members)
        self._iter = iter(self._loader)  # persistent workers: reset; else the old iterator's workers stop with it
        self.restarts += 1
        log.debug("micro_batch_feed_restarted", step=step, micro_batch=j, members=list(self._order.start[2]))

    def close(self) -> None:
        """Stop the loader's workers; later micro-batches are materialised here."""
        iterator, self._iter, self._loader = self._iter, None, None
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


class StepPlaceholders:
    """What Lightning's training loop iterates: one placeholder per optimizer step of an epoch (the step's
    micro-batches come from :class:`MicroBatchFeed`)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(self.steps))
