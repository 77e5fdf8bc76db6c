"""Replicas of a tensor x pipeline parallel model (strategy/engine/replicas.py): the layout, the pure decisions in
replica space, and :class:`ReplicaMembership` (the protocol's store side) over ``tests/fake_dp.py``'s store."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unicron_elastic.api import ConfigError
from unicron_elastic.store.keys import MeetingKeys as K
from unicron_elastic.strategy.engine.membership import (
    CheckIn,
    MembershipError,
    MembershipRecord,
    decide_record,
    resize_record,
)
from unicron_elastic.strategy.engine.replicas import (
    ModelParallel,
    ReplicaMembership,
    combine_checkins,
    kept_per_shard,
    live_replicas,
    stages_to_backpropagate,
    touched_replicas,
    waiting_replicas,
)

sys.path.insert(0, str(Path(__file__).parent))
from fake_dp import FakeStore  # noqa: E402

SOME = settings(max_examples=150, deadline=None, derandomize=True)
layouts = st.builds(ModelParallel, st.integers(1, 4), st.integers(1, 4))


# -- the layout ------------------------------------------------------------------------------------
@SOME
@given(layouts, st.integers(0, 200))
def test_a_launch_rank_round_trips_through_replica_shard_tensor_rank_and_stage(layout: ModelParallel,
                                                                                   rank: int) -> None:
    replica, shard = layout.replica(rank), layout.shard(rank)
    tensor_rank, stage = layout.tensor_rank(rank), layout.stage(rank)
    assert 0 <= shard < layout.size and 0 <= tensor_rank < layout.tensor and 0 <= stage < layout.pipeline
    assert layout.rank(replica, shard) == rank == replica * layout.size + stage * layout.tensor + tensor_rank
    assert shard == stage * layout.tensor + tensor_rank and layout.stage_of(shard) == stage
    assert rank in layout.ranks(replica) and layout.ranks(replica) == list(range(replica * layout.size,
                                                                                  (replica + 1) * layout.size))
    assert layout.label(rank) == f"tp{tensor_rank}-pp{stage}" == layout.labels()[shard]
    assert layout.replicas(layout.size * (replica + 1)) == replica + 1


def test_the_labels_name_every_shard_once() -> None:
    assert ModelParallel(2, 2).labels() == ["tp0-pp0", "tp1-pp0", "tp0-pp1", "tp1-pp1"]
    assert ModelParallel().labels() == ["tp0-pp0"] and ModelParallel().size == 1


@pytest.mark.parametrize(("tensor", "pipeline"), [(0, 1), (1, 0), (-1, 2), (True, 1), (1, 2.0), ("2", 1)])
def test_bad_sizes_are_config_errors(tensor: object, pipeline: object) -> None:
    with pytest.raises(ConfigError):
        ModelParallel(tensor, pipeline)  # type: ignore[arg-type]


@pytest.mark.parametrize("world", [0, -4, 3, 5])
def test_a_world_not_made_of_whole_replicas_is_a_config_error(world: int) -> None:
    with pytest.raises(ConfigError):
        ModelParallel(2, 2).replicas(world)


def _megatron_groups(tensor: int, pipeline: int, replicas: int) -> dict[str, list[list[int]]]:
    generator = pytest.importorskip("megatron.core.parallel_state").RankGenerator
    ranks = generator(tp=tensor, ep=1, dp=replicas, pp=pipeline, cp=1, order="tp-pp-dp")
    return {kind: ranks.get_ranks(kind) for kind in ("tp", "pp", "dp")}


@pytest.mark.parametrize(("tensor", "pipeline", "members"), [
    (1, 1, [0, 1, 2]), (2, 1, [0, 1]), (1, 2, [0, 1, 2]), (2, 2, [0, 1]), (2, 3, [0, 2, 3]), (4, 2, [1, 3]),
    (3, 2, [0]), (2, 2, [1, 4, 5, 7]),
])
def test_world_ranks_number_the_members_as_megatron_cores_tp_pp_dp_order(tensor: int, pipeline: int,
                                                                         members: list[int]) -> None:
    """tp groups: one replica's stage; pp groups: one replica's tensor rank across stages; dp: one shard."""
    layout = ModelParallel(tensor, pipeline)
    groups = _megatron_groups(tensor, pipeline, len(members))
    launch = [rank for replica in members for rank in layout.ranks(replica)]
    world = {rank: layout.world_rank(members, rank) for rank in launch}
    assert sorted(world.values()) == list(range(len(members) * layout.size))  # a renumbering, order kept
    assert [world[r] for r in launch] == sorted(world.values())

    def grouped(key) -> list[list[int]]:
        out: dict[object, list[int]] = {}
        for rank in launch:
            out.setdefault(key(rank), []).append(world[rank])
        return sorted(sorted(g) for g in out.values())

    assert grouped(lambda r: (layout.replica(r), layout.stage(r))) == sorted(groups["tp"])
    assert grouped(lambda r: (layout.replica(r), layout.tensor_rank(r))) == sorted(groups["pp"])
    assert grouped(layout.shard) == sorted(groups["dp"])
    for rank in launch:  # the pipeline neighbours of a rank are its pp group, in stage order
        [pp] = [g for g in groups["pp"] if world[rank] in g]
        assert [layout.neighbour(members, rank, stage) for stage in range(pipeline)] == pp
    with pytest.raises(ValueError):
        layout.world_rank(members, layout.rank(max(members) + 1, 0))


# -- combine_checkins, kept_per_shard ---------------------------------------------------------------
def test_combine_checkins_examples() -> None:
    layout = ModelParallel(2, 1)  # replica r: ranks 2r, 2r+1
    per_rank = {0: CheckIn(5, 2), 1: CheckIn(5, 1),  # replica 0: both in, one step
                2: CheckIn(5, 2),  # replica 1: rank 3 missing -> absent
                4: CheckIn(6, 0), 5: CheckIn(5, 3),  # replica 2: different steps -> broken at the lower one
                6: CheckIn(5, 1), 7: CheckIn(5, 1, broken=True)}  # replica 3: a broken rank -> broken
    assert combine_checkins(layout, per_rank, range(5), 0) == {
        0: CheckIn(5, 2), 2: CheckIn(5, 0, broken=True), 3: CheckIn(5, 1, broken=True)}
    assert combine_checkins(layout, per_rank, [0, 2, 3], 1) == {
        0: CheckIn(5, 1), 2: CheckIn(5, 3, broken=True), 3: CheckIn(5, 1, broken=True)}
    assert combine_checkins(layout, per_rank, [], 0) == {}


@st.composite
def checkins_of_replicas(draw: st.DrawFn) -> tuple[ModelParallel, dict[int, CheckIn], list[int]]:
    layout = draw(st.builds(ModelParallel, st.integers(1, 3), st.integers(1, 3)))
    replicas = sorted(draw(st.sets(st.integers(0, 5), min_size=1, max_size=4)))
    ranks = [rank for replica in replicas for rank in layout.ranks(replica)]
    per_rank = draw(st.dictionaries(st.sampled_from(ranks + [99]),
                                    st.builds(CheckIn, st.integers(3, 4), st.integers(0, 3),
                                              st.booleans() | st.just(False))))
    if draw(st.booleans()):  # often every rank of a replica checked in
        for replica in replicas[: draw(st.integers(0, len(replicas)))]:
            step = draw(st.integers(3, 4))
            per_rank.update({rank: CheckIn(step, draw(st.integers(0, 3))) for rank in layout.ranks(replica)})
    return layout, per_rank, replicas


@SOME
@given(checkins_of_replicas(), st.data())
def test_combine_checkins_a_replica_is_in_when_all_its_ranks_are_broken_when_one_is_or_steps_differ(
        drawn: tuple, data: st.DataObject) -> None:
    layout, per_rank, replicas = drawn
    shard = data.draw(st.integers(0, layout.size - 1))
    combined = combine_checkins(layout, per_rank, replicas, shard)
    assert set(combined) <= set(replicas)
    for replica in replicas:
        mine = [per_rank.get(rank) for rank in layout.ranks(replica)]
        if None in mine:
            assert replica not in combined
            continue
        got = combined[replica]
        assert got.step == min(c.step for c in mine)
        assert got.done == per_rank[layout.rank(replica, shard)].done  # the shard's own buckets
        assert got.broken == (len({c.step for c in mine}) > 1 or any(c.broken for c in mine))
    if layout.size == 1:  # plain data parallelism: the ranks' own check-ins
        assert combined == {r: c for r, c in per_rank.items() if r in replicas}


@SOME
@given(checkins_of_replicas())
def test_kept_per_shard_is_the_least_done_of_each_shards_members(drawn: tuple) -> None:
    layout, per_rank, replicas = drawn
    members = [r for r in replicas if all(rank in per_rank for rank in layout.ranks(r))]
    missing = [r for r in replicas if r not in members]
    if members:
        kept = kept_per_shard(layout, per_rank, members)
        assert kept == tuple(min(per_rank[layout.rank(m, c)].done for m in members) for c in range(layout.size))
        combined = [combine_checkins(layout, per_rank, members, c) for c in range(layout.size)]
        assert kept == tuple(min(view[m].done for m in members) for view in combined)  # each shard's min
    if missing:
        with pytest.raises(MembershipError):
            kept_per_shard(layout, per_rank, sorted(members + missing[:1]))


def test_kept_per_shard_examples() -> None:
    layout = ModelParallel(1, 2)
    per_rank = {0: CheckIn(3, 2), 1: CheckIn(3, 0), 4: CheckIn(3, 1), 5: CheckIn(3, 2)}
    assert kept_per_shard(layout, per_rank, [0, 2]) == (1, 0)
    with pytest.raises(MembershipError):
        kept_per_shard(layout, per_rank, [0, 1])


def test_live_waiting_and_touched_replicas() -> None:
    layout = ModelParallel(2, 1)
    assert live_replicas(layout, None, [0, 1]) is None
    assert live_replicas(layout, {0, 1, 2, 5}, [0, 1, 2]) == {0}
    assert live_replicas(layout, set(), [0, 1]) == set()
    assert waiting_replicas(layout, [2, 3, 4], range(3)) == [1]
    assert touched_replicas(layout, [3, 4], range(4)) == [1, 2]
    assert touched_replicas(layout, [], range(4)) == []
    plain = ModelParallel()
    assert live_replicas(plain, {0, 2}, [0, 1, 2]) == {0, 2} and waiting_replicas(plain, [1], range(3)) == [1]


# -- stages_to_backpropagate ------------------------------------------------------------------------
@SOME
@given(layouts, st.data())
def test_stages_to_backpropagate_are_those_from_the_lowest_unreduced_stage_on(layout: ModelParallel,
                                                                             data: st.DataObject) -> None:
    buckets = data.draw(st.lists(st.integers(1, 4), min_size=layout.size, max_size=layout.size))
    kept = [data.draw(st.integers(0, b)) for b in buckets]
    stages = stages_to_backpropagate(layout, kept, buckets)
    unreduced = {layout.stage_of(c) for c in range(layout.size) if kept[c] < buckets[c]}
    assert stages == ({s for s in range(layout.pipeline) if s >= min(unreduced)} if unreduced else set())
    assert (not stages) == all(k == b for k, b in zip(kept, buckets))
    assert unreduced <= stages  # every stage with gradients still to reduce runs backward
    # (and a stage runs backward only if a stage at or below it needs gradients: backward flows down)


def test_stages_to_backpropagate_examples() -> None:
    layout = ModelParallel(2, 3)  # shards 0,1: stage 0; 2,3: stage 1; 4,5: stage 2
    assert stages_to_backpropagate(layout, [2, 2, 2, 2, 2, 2], [2] * 6) == set()
    assert stages_to_backpropagate(layout, [2, 2, 2, 2, 2, 1], [2] * 6) == {2}
    assert stages_to_backpropagate(layout, [2, 2, 1, 2, 2, 2], [2] * 6) == {1, 2}
    assert stages_to_backpropagate(layout, [0, 2, 2, 2, 2, 2], [2] * 6) == {0, 1, 2}
    assert stages_to_backpropagate(ModelParallel(), [0], [3]) == {0}


# -- ReplicaMembership over the fake store ------------------------------------------------------------------
def _meetings(layout: ModelParallel, replicas: int) -> tuple[FakeStore, dict[int, ReplicaMembership]]:
    store = FakeStore()
    return store, {rank: ReplicaMembership(store, layout, rank, replicas) for rank in range(replicas * layout.size)}


@st.composite
def failures(draw: st.DrawFn) -> tuple:
    """Replicas that checked in for a generation (some ranks of some missing, broken, or a step behind)."""
    layout = draw(st.sampled_from([ModelParallel(2, 1), ModelParallel(1, 2), ModelParallel(2, 2),
                                   ModelParallel(3, 1), ModelParallel()]))
    replicas = draw(st.integers(1, 4))
    previous = sorted(draw(st.sets(st.integers(0, replicas - 1), min_size=1)))
    per_rank: dict[int, CheckIn] = {}
    for replica in previous:
        step = draw(st.integers(6, 7))
        for rank in layout.ranks(replica):
            if draw(st.integers(0, 5)) == 0:
                continue  # not checked in (dead, or late)
            broken = draw(st.integers(0, 6)) == 0
            own = step if draw(st.integers(0, 6)) else 6  # (a rank of the replica a step behind)
            per_rank[rank] = CheckIn(own, draw(st.integers(0, 3)), broken)
    return layout, replicas, previous, per_rank, draw(st.booleans())


@SOME
@given(failures())
def test_write_record_stores_the_buckets_kept_per_shard_and_each_shard_sees_its_own_decision(
        drawn: tuple) -> None:
    layout, replicas, previous, per_rank, passed = drawn
    store, meetings = _meetings(layout, replicas)
    generation = 3
    for rank, checkin in per_rank.items():
        meetings[rank].check_in(generation, checkin)
    decided = {}
    for rank in [layout.rank(r, c) for r in previous for c in range(layout.size)]:
        seen = meetings[rank].checkins(generation, previous)
        assert seen == combine_checkins(layout, per_rank, previous, layout.shard(rank))
        decided[rank] = decide_record(generation, previous, seen, None, passed)
    if all(record is None for record in decided.values()):
        assert meetings[0].read_record(generation) is None
        return
    # the members (and step, dead) are the same in every shard's view: only kept_buckets differs
    assert len({(r.members, r.dead, r.step) for r in decided.values() if r is not None}) == 1
    writers = [rank for rank, record in decided.items() if record is not None]
    first = writers[0]
    view = meetings[first].write_record(decided[first])
    assert view == decided[first] and not view.kept
    full = MembershipRecord.from_json(store.get(K.record(generation)))
    assert meetings[first].record == full
    if layout.size > 1 and full.members:
        assert full.kept == kept_per_shard(layout, per_rank, full.members)
        assert full.kept_buckets == min(full.kept)
    else:
        assert full == decided[first]
    for rank, record in decided.items():  # every shard's view of the stored record is what it decided
        if record is not None:
            assert meetings[rank].write_record(record) == record
        reread = meetings[rank].read_record(generation)
        assert reread == full.for_shard(layout.shard(rank))
        if record is not None:
            assert reread == record
    assert store.creates[K.record(generation)] == 1  # written once, by the first writer


def test_a_resize_record_stores_zeros_per_shard_and_its_view_is_the_proposal() -> None:
    layout = ModelParallel(2, 2)
    store, meetings = _meetings(layout, 3)
    proposed = resize_record(5, [0, 1], [0, 2], step=9)
    assert meetings[2].write_record(proposed) == proposed  # (nobody checked in for generation 5)
    full = MembershipRecord.from_json(store.get(K.record(5)))
    assert full.kept == (0, 0, 0, 0) and full.resize and full.members == (0, 2)
    for rank in range(12):
        assert meetings[rank].read_record(5) == proposed
    assert meetings[0].free_generation(4) == 4 and meetings[0].free_generation(5) == 6


def test_the_first_writer_wins_and_everyone_reads_its_record() -> None:
    layout = ModelParallel(1, 2)
    store, meetings = _meetings(layout, 2)
    for rank in range(4):
        meetings[rank].check_in(1, CheckIn(0, rank % 2))
    failure = MembershipRecord(1, (0, 1), 0, (), 0)
    resize = resize_record(1, [0, 1], [0], 0)
    assert meetings[1].write_record(failure) == MembershipRecord(1, (0, 1), 1, (), 0)  # shard 1 kept 1
    assert meetings[0].write_record(resize) == failure  # the second writer gets the first one's
    assert meetings[3].write_record(resize) == MembershipRecord(1, (0, 1), 1, (), 0)
    assert MembershipRecord.from_json(store.get(K.record(1))).kept == (0, 1)
    assert store.creates == {K.record(1): 1}


def test_a_dissolved_record_is_stored_as_decided() -> None:
    layout = ModelParallel(2, 1)
    store, meetings = _meetings(layout, 2)
    for rank in range(4):
        meetings[rank].check_in(2, CheckIn(4, 1, broken=rank == 1 or rank == 2))
    record = decide_record(2, [0, 1], meetings[0].checkins(2, [0, 1]), {0, 1}, False)
    assert record is not None and record.dissolved and record.dead == (0, 1)
    assert meetings[0].write_record(record) == record
    assert meetings[3].read_record(2) == record and not MembershipRecord.from_json(store.get(K.record(2))).kept


def test_write_record_from_check_ins_a_member_never_made_is_refused() -> None:
    layout = ModelParallel(2, 1)
    _, meetings = _meetings(layout, 2)
    meetings[0].check_in(1, CheckIn(0, 0))
    with pytest.raises(MembershipError):  # rank 1 of replica 0 never checked in: not decided from check-ins
        meetings[0].write_record(MembershipRecord(1, (0,), 0, (1,), 0))


def test_waiting_leaving_liveness_and_incarnations_in_replica_space() -> None:
    layout = ModelParallel(2, 1)
    store, meetings = _meetings(layout, 3)
    meeting = meetings[0]
    store.set(K.join(2), "1")
    assert meeting.waiting() == [] and meeting.waiting_ranks() == [2]  # replica 1 waits only when both do
    store.set(K.join(3), "1")
    store.set(K.join(4), "1")
    assert meeting.waiting() == [1] and meeting.waiting_ranks() == [2, 3, 4]
    store.set(K.leave(5), "1")
    assert meeting.leaving([0, 1, 2]) == [2] and meeting.leaving([0, 1]) == []
    assert not meeting.liveness_kept()
    store.set(K.LIVENESS, "1")
    for rank, value in [(0, "a"), (1, "b"), (3, "c")]:
        store.set(K.live(rank), value)
    assert meeting.liveness_kept() and meeting.incarnations(range(6)) == {0: "a", 1: "b", 3: "c"}
    assert {K.live(r) for r in range(6)} & set(store.data) == {K.live(0), K.live(1), K.live(3)}  # read, not created


def test_check_ins_of_every_rank_and_malformed_ones_are_reported() -> None:
    layout = ModelParallel(1, 2)
    store, meetings = _meetings(layout, 2)
    meetings[0].check_in(4, CheckIn(1, 0))
    meetings[1].check_in(4, CheckIn(1, 1))
    store.set(K.checkin(4, 2), "{not json")
    store.set(K.checkin(4, 3), CheckIn(1, 2).to_json())
    bad: list[tuple[int, int]] = []
    assert meetings[1].checkins(4, [0, 1], lambda g, r, exc: bad.append((g, r))) == {0: CheckIn(1, 1)}
    assert bad == [(4, 2)]
    assert meetings[0].rank_checkins(4, range(4)) == {0: CheckIn(1, 0), 1: CheckIn(1, 1), 3: CheckIn(1, 2)}


def test_one_rank_per_replica_is_the_plain_data_parallel_meeting() -> None:
    layout = ModelParallel()
    store, meetings = _meetings(layout, 3)
    for rank, (step, done) in zip(range(3), itertools.cycle([(2, 1), (2, 0)])):
        meetings[rank].check_in(7, CheckIn(step, done))
    record = decide_record(7, [0, 1, 2], meetings[1].checkins(7, [0, 1, 2]), None, False)
    assert meetings[1].write_record(record) == record == MembershipRecord.from_json(store.get(K.record(7)))
    assert not record.kept
