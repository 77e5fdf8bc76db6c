"""The primary's read of the join/leave requests, in one process: begun with the step's computation.

The proposal for step s + 1 rides in step s's last bucket, which every other
rank waits in; the primary reads the request counter in a thread when step s
begins computing, so the bucket waits for no store round trip. What was asked
before step s began computing is seen in its proposal (a hold for joiners
relies on it); what is asked while it computes is seen a step later.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from unicron_elastic.api import StoreUnavailableError
from unicron_elastic.store.keys import MeetingKeys as K
from unicron_elastic.strategy.engine.elastic_dp import ElasticDataParallel, EngineOptions
from unicron_elastic.strategy.engine.microbatch import GlobalBatchPlan
from unicron_elastic.strategy.engine.effects import ReadRequests

DATA = torch.randn(8, 3, generator=torch.Generator().manual_seed(3))


def engine(loss_fn, member_schedule=None) -> tuple[ElasticDataParallel, list[int]]:
    """A one-rank engine (the primary) whose ``waiting()`` records the steps it was asked at: a request was seen."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    e = ElasticDataParallel(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            batch_plan=GlobalBatchPlan(len(DATA), 4, 2, seed=0), batch=lambda idx: DATA[idx],
                            loss_fn=loss_fn, store=dist.HashStore(), rank=0, world_size=1,
                            options=EngineOptions(timeout=timedelta(seconds=30)), member_schedule=member_schedule)
    seen: list[int] = []
    e.store_effects.membership.waiting = lambda: seen.append(current[0]) or []  # type: ignore[method-assign]
    return e, seen


current = [0]  # the step being trained (read by the recording ``waiting``)


def train(e: ElasticDataParallel, steps: range, before_step=None) -> None:
    for step in steps:
        current[0] = step
        if before_step is not None:
            before_step(step)
        e.train_step(step)


def test_a_request_made_before_a_step_computes_is_seen_in_its_proposal_one_made_during_it_a_step_later() -> None:
    asked_during = {}

    def loss(model, batch):
        if current[0] == 1 and not asked_during:  # while step 1 computes, once its read is done
            assert e.store_effects.requests.prefetched is not None and e.store_effects.requests.prefetched[1].result() == 0
            asked_during[1] = e.store_effects.store.add(K.JOIN_REQUESTS, 1)
        return model(batch).pow(2).mean()

    e, seen = engine(loss)
    try:
        train(e, range(4))
        assert asked_during == {1: 1}
        # step 1's proposal (for step 2) was read before the request: it is seen at step 2's end, and at
        # every later one (nobody answers it here)
        assert seen == [2, 3]
    finally:
        e.close()


def test_a_request_raised_before_the_step_began_is_seen_at_once() -> None:
    e, seen = engine(lambda model, batch: model(batch).pow(2).mean())
    try:
        train(e, range(3), before_step=lambda s: s == 1 and e.store_effects.store.add(K.JOIN_REQUESTS, 1))
        assert seen == [1, 2]
    finally:
        e.close()


def test_the_read_is_used_once_and_only_for_the_next_steps_proposal() -> None:
    e, _ = engine(lambda model, batch: model(batch).pow(2).mean())
    reads = []
    counts = iter([5, 0, 0])
    e.store_effects.requests.count = lambda: reads.append(1) or next(counts)  # type: ignore[method-assign]
    try:
        e.store_effects.prefetch_requests(4, True)
        assert e.store_effects.requests.prefetched is not None and e.store_effects.requests.prefetched[1].result() == 5
        assert e.store_effects.read_requests(ReadRequests((0,), step=4)) == ([], [])  # not step 5's: read afresh (0)
        assert e.store_effects.requests.prefetched is None and len(reads) == 2
        e.store_effects.prefetch_requests(4, True)
        assert e.store_effects.read_requests(ReadRequests((0,), step=5)) == ([], [])  # the prefetched 0, no third read
        assert len(reads) == 3 and e.store_effects.requests.prefetched is None
    finally:
        e.close()


def test_an_unreachable_store_during_the_read_reports_no_requests_and_training_goes_on() -> None:
    e, seen = engine(lambda model, batch: model(batch).pow(2).mean())

    def unreachable() -> int:
        raise StoreUnavailableError("etcd down (test)")

    e.store_effects.requests.count = unreachable  # type: ignore[method-assign]
    try:
        train(e, range(3))
        assert seen == [] and e.next_step == 3
    finally:
        e.close()


def test_with_a_member_schedule_the_primary_reads_no_requests() -> None:
    e, seen = engine(lambda model, batch: model(batch).pow(2).mean(), member_schedule={0: [0]})
    e.store_effects.requests.count = lambda: pytest.fail("a schedule decides the members: no read")  # type: ignore[method-assign]
    try:
        e.store_effects.store.add(K.JOIN_REQUESTS, 1)
        train(e, range(2))
        assert seen == [] and e.store_effects.requests.reader is None
    finally:
        e.close()


def test_a_read_still_pending_at_the_steps_end_is_not_waited_for_and_the_next_read_follows_it() -> None:
    """etcd failing over (the member in use lost): the read may take up to a leader election. The step's end
    waits at most STEP_END_WAIT_S, reports no request, and the requests are seen at a later step: a leader
    stalled past --hang-min-silence (0.5 s) at every step's end would be taken for a hung rank."""
    import threading
    import time

    from unicron_elastic.strategy.engine.requests import STEP_END_WAIT_S

    e, seen = engine(lambda model, batch: model(batch).pow(2).mean())
    etcd_back = threading.Event()
    counts = iter([3, 3])

    def failing_over() -> int:
        etcd_back.wait(30)
        return next(counts)

    try:
        train(e, range(1))
        e.store_effects.requests.count = failing_over  # type: ignore[method-assign]
        started = time.monotonic()
        train(e, range(1, 3))  # each step's end finds its read pending: waited for briefly, no request
        assert time.monotonic() - started < 10 * STEP_END_WAIT_S and seen == [] and e.next_step == 3
        etcd_back.set()
        e.store_effects.requests.count = lambda: 3  # type: ignore[method-assign]
        train(e, range(3, 5))
        assert seen == [3, 4]  # seen once the store answers again
    finally:
        etcd_back.set()
        e.close()
