"""Deterministic global batches, dealing and redistribution (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from unicron_elastic.api import ConfigError
from unicron_elastic.strategy.engine.microbatch import GlobalBatchPlan, deal, redistribute


def test_every_sample_once_per_epoch_and_reproducible() -> None:
    plan = GlobalBatchPlan(dataset_size=100, global_batch=20, micro_batch=4, seed=3)
    seen = [i for s in range(plan.steps_per_epoch) for j in range(plan.num_micro_batches) for i in plan.indices(s, j)]
    assert sorted(seen) == list(range(100))
    assert plan.indices(2, 1) == GlobalBatchPlan(100, 20, 4, seed=3).indices(2, 1)
    assert plan.indices(5, 0) != plan.indices(0, 0)  # the next epoch is reshuffled


@given(st.integers(1, 64), st.lists(st.integers(0, 1000), min_size=1, max_size=9, unique=True))
def test_deal_gives_each_micro_batch_to_exactly_one_rank(b: int, members: list[int]) -> None:
    assignment = deal(b, members)
    assert sorted(j for js in assignment.values() for j in js) == list(range(b))
    sizes = [len(js) for js in assignment.values()]
    assert max(sizes) - min(sizes) <= 1


@given(st.integers(1, 64), st.integers(2, 8), st.data())
def test_redistribute_covers_the_dead_ranks_work_exactly_once(b: int, world: int, data) -> None:
    members = list(range(world))
    dead = data.draw(st.lists(st.sampled_from(members), min_size=1, max_size=world - 1, unique=True))
    assignment = deal(b, members)
    extra = redistribute(assignment, dead)
    survivors_work = [j for r in members if r not in dead for j in assignment[r] + extra[r]]
    assert sorted(survivors_work) == list(range(b))
    assert set(extra) == set(members) - set(dead)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dataset_size": 10, "global_batch": 6, "micro_batch": 4}, "multiple"),
        ({"dataset_size": 4, "global_batch": 8, "micro_batch": 4}, "exceeds"),
        ({"dataset_size": 10, "global_batch": 0, "micro_batch": 1}, ">= 1"),
    ],
)
def test_bad_plans_are_clear_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        GlobalBatchPlan(**kwargs)


def test_bad_micro_batch_and_empty_groups() -> None:
    with pytest.raises(ConfigError):
        GlobalBatchPlan(10, 4, 2).indices(0, 2)
    with pytest.raises(ConfigError):
        deal(4, [])
    with pytest.raises(ConfigError, match="every rank"):
        redistribute(deal(4, [0, 1]), [0, 1])
