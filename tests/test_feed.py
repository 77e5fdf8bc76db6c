"""The micro-batch feed: this rank's micro-batches through the user's DataLoader settings (issue 12, item 6)."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from unicron_elastic.strategy.lightning.feed import MicroBatchFeed
from unicron_elastic.strategy.engine.microbatch import GlobalBatchPlan, deal


class Recorded(Dataset):
    """Sample ``i`` is ``[i, pid, worker id]`` (worker id -1: loaded in the calling process)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        info = get_worker_info()
        return torch.tensor([i, os.getpid(), -1 if info is None else info.id])


PLAN = GlobalBatchPlan(64, 12, 2, seed=3)  # B = 6 micro-batches of 2 samples


def _run(feed: MicroBatchFeed, rank: int, members: list[int], steps: range) -> dict[tuple[int, int], torch.Tensor]:
    out = {}
    for step in steps:
        for j in deal(PLAN.num_micro_batches, members)[rank]:
            out[(step, j)] = feed.get(step, j, PLAN.indices(step, j))
    return out


@pytest.mark.parametrize("persistent", [False, True])
def test_workers_load_this_ranks_micro_batches_and_the_batches_equal_on_demand_ones(persistent: bool) -> None:
    members = [0, 1, 2]
    loader = DataLoader(Recorded(), batch_size=2, num_workers=2, persistent_workers=persistent, prefetch_factor=2)
    feed = MicroBatchFeed(loader, PLAN, rank=1, members=lambda: members)
    plain = MicroBatchFeed(DataLoader(Recorded(), batch_size=2), PLAN, rank=1, members=lambda: members)
    try:
        got = _run(feed, 1, members, range(4))
        want = _run(plain, 1, members, range(4))
    finally:
        feed.close()
    assert got.keys() == want.keys() and len(got) == 4 * 2
    for key, batch in got.items():
        assert torch.equal(batch[:, 0], want[key][:, 0])  # the same samples, in the same order
        assert set(batch[:, 2].tolist()) <= {0, 1} and os.getpid() not in batch[:, 1].tolist()  # from the workers
    assert {int(w) for b in got.values() for w in b[:, 2]} == {0, 1}  # both workers loaded
    assert (feed.fed, feed.on_demand, feed.restarts) == (8, 0, 1)
    assert plain.on_demand == 8 and plain.fed == 0


def test_moved_micro_batches_come_on_demand_and_a_new_membership_restarts_the_feed() -> None:
    members = [0, 1, 2]
    loader = DataLoader(Recorded(), batch_size=2, num_workers=2, persistent_workers=True)
    feed = MicroBatchFeed(loader, PLAN, rank=0, members=lambda: members)
    try:
        _run(feed, 0, members, range(2))
        # step 2: rank 2 dies after the deal; its micro-batches (2 and 5) move to rank 0 and 1
        for j in deal(6, [0, 1, 2])[0]:
            assert feed.get(2, j, PLAN.indices(2, j))[0, 2] >= 0
        moved = feed.get(2, 2, PLAN.indices(2, 2))
        assert moved[0, 2] == -1 and moved[0, 1] == os.getpid()  # materialised here, on demand
        assert torch.equal(moved[:, 0], torch.tensor(PLAN.indices(2, 2)))
        members = [0, 1]  # from step 3 on: the next deal
        got = _run(feed, 0, members, range(3, 5))
        assert all(b[0, 2] >= 0 for b in got.values())  # from the workers again, in the new order
        assert [k for k in got] == [(s, j) for s in (3, 4) for j in (0, 2, 4)]
        assert feed.restarts == 2 and feed.on_demand == 1
    finally:
        feed.close()
    assert feed.get(5, 0, PLAN.indices(5, 0))[0, 2] == -1  # closed: on demand


def test_without_workers_everything_is_on_demand() -> None:
    feed = MicroBatchFeed(DataLoader(Recorded(), batch_size=2), PLAN, rank=0, members=lambda: [0])
    batch = feed.get(0, 3, PLAN.indices(0, 3))
    assert batch[0, 2] == -1 and (feed.fed, feed.on_demand) == (0, 1)
