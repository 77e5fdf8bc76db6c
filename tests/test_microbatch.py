"""Deterministic global batches, dealing and redistribution (pure)."""

from __future__ import annotations

import pickle
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unicron_elastic.api import ConfigError
from unicron_elastic.strategy.engine.microbatch import GlobalBatchPlan, IndexPermutation, deal, redistribute


def test_every_sample_once_per_epoch_and_reproducible() -> None:
    plan = GlobalBatchPlan(dataset_size=100, global_batch=20, micro_batch=4, seed=3)
    seen = [i for s in range(plan.steps_per_epoch) for j in range(plan.num_micro_batches) for i in plan.indices(s, j)]
    assert sorted(seen) == list(range(100))
    assert plan.indices(2, 1) == GlobalBatchPlan(100, 20, 4, seed=3).indices(2, 1)
    assert plan.indices(5, 0) != plan.indices(0, 0)  # the next epoch is reshuffled


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 3000), st.integers(0, 2**63 - 1), st.integers(0, 1000))
def test_the_permutation_is_a_bijection_of_every_size(size: int, seed: int, epoch: int) -> None:
    order = IndexPermutation(size, (seed, epoch))
    assert sorted(order(np.arange(size)).tolist()) == list(range(size))


@settings(deadline=None)  # (up to 400 samples dealt per example: a loaded machine takes longer than 200 ms)
@given(st.integers(1, 40).flatmap(lambda b: st.tuples(st.just(b), st.integers(1, 8), st.integers(b, 400))),
       st.integers(0, 99), st.booleans())
def test_every_sample_once_per_epoch_for_any_sizes(sizes: tuple[int, int, int], seed: int, shuffle: bool) -> None:
    micro_batches, micro, extra = sizes
    plan = GlobalBatchPlan(micro_batches * micro + extra, micro_batches * micro, micro, seed, shuffle)
    for epoch in (0, 3):
        steps = range(epoch * plan.steps_per_epoch, (epoch + 1) * plan.steps_per_epoch)
        seen = [i for s in steps for j in range(plan.num_micro_batches) for i in plan.indices(s, j)]
        assert len(seen) == len(set(seen)) == plan.steps_per_epoch * plan.global_batch
        assert set(seen) <= set(range(plan.dataset_size))


def test_the_index_of_two_billion_samples_costs_under_a_megabyte() -> None:
    """Llama 3 8B's recipe: 1.95e9 samples. A permutation array would be 16 GB per rank and epoch."""
    plan = GlobalBatchPlan(2_000_000_000, 1024, 8, seed=7)
    tracemalloc.start()
    try:
        first = [plan.indices(step, j) for step in (0, 1_000_000, 3_000_000) for j in range(4)]
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, peak
    assert len(pickle.dumps(plan.order(2))) < 1_000  # what a rank keeps per epoch: the round keys
    assert all(0 <= i < 2_000_000_000 for batch in first for i in batch)
    assert len({i for batch in first[:4] for i in batch}) == 32  # one step's samples are distinct


def test_without_shuffling_the_dataset_keeps_its_order() -> None:
    plan = GlobalBatchPlan(dataset_size=10, global_batch=4, micro_batch=2, seed=3, shuffle=False)
    assert [plan.indices(s, j) for s in range(3) for j in range(2)] == [[0, 1], [2, 3], [4, 5], [6, 7],
                                                                      [0, 1], [2, 3]]


def test_permutations_differ_by_seed_and_epoch_and_bad_sizes_are_refused() -> None:
    orders = {tuple(IndexPermutation(1000, key)(np.arange(1000)).tolist()) for key in ((0, 0), (0, 1), (1, 0))}
    assert len(orders) == 3
    for size in (0, 2**62 + 1):
        with pytest.raises(ConfigError, match="cannot permute"):
            IndexPermutation(size, (0, 0))


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
