"""Membership and recovery (issue 10): the engine's own protocol, run in-process over fakes.

:class:`~unicron_elastic.strategy.protocol.Protocol` - the state machine that
:class:`~unicron_elastic.strategy.elastic_dp.ElasticDataParallel` runs over gloo
and the c10d store - runs here over ``tests/fake_dp.py``'s in-process groups and
store, built on the pure decisions (:func:`decide_record`, :func:`role`,
:func:`proposal`, :func:`deal`, :func:`redistribute`): ranks die anywhere
(several at once, a node, the leader, during the recovery from another death),
survivors are slow or late, liveness keys vanish after a delay or are not kept
at all, a rank asks to join in the middle. The properties below hold for every run.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from unicron_elastic.strategy.membership import (
    CheckIn,
    MembershipError,
    MembershipRecord,
    decide_record,
    formation,
    proposal,
    resize_record,
    role,
)
from unicron_elastic.strategy.microbatch import deal, redistribute

sys.path.insert(0, str(Path(__file__).parent))
from fake_dp import ProtocolViolation, Scenario, Sim, counts, expected  # noqa: E402

FAST = settings(max_examples=300, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# -- scenarios -----------------------------------------------------------------------------
def build_scenario(pick: Callable[[int, int], int], keep_one: bool = True) -> Scenario:
    """A random scenario from ``pick(lo, hi)`` (hypothesis draws, or a seeded Random).

    With ``keep_one``, one rank (``steady``) never dies and is never slow or
    late, so a replica always remains; every other rank may die, be slow or be
    late. Without, every rank may die (a run may lose every replica).
    """
    world, buckets, micro_batches, steps = pick(2, 8), pick(1, 4), pick(1, 12), pick(1, 3)
    steady = pick(0, world - 1)
    others = [r for r in range(world) if r != steady]
    candidates = others if keep_one else list(range(world))
    victims: list[int] = []
    for _ in range(pick(0, len(candidates))):
        left = [r for r in candidates if r not in victims]
        victims.append(left[pick(0, len(left) - 1)])
    horizon = steps * (micro_batches // world + 2 * buckets + 2) + 6
    kinds = ["step", "micro", "bucket", "sent", "checkin", "poll", "decided", "form", "redo"]
    deaths: dict[int, int | tuple] = {}
    for v in victims:
        if pick(0, 2):  # the n-th point it passes
            deaths[v] = pick(0, horizon)
        else:  # a named point: e.g. ("poll", 0) = its first poll in step 0 (a death during recovery)
            kind, step = kinds[pick(0, len(kinds) - 1)], pick(0, steps - 1)
            if kind in ("bucket", "sent"):
                deaths[v] = (kind, step, pick(0, buckets - 1))
            elif kind == "micro":
                deaths[v] = (kind, step, pick(0, micro_batches - 1))
            else:
                deaths[v] = (kind, step)
    together = frozenset(victims[: pick(0, len(victims))]) if len(victims) > 1 and pick(0, 1) else frozenset()
    slow = frozenset(r for r in others if pick(0, 3) == 0)
    late = {r: pick(1, 30) for r in others if pick(0, 4) == 0}
    liveness = pick(0, 3) > 0
    finite = not liveness or pick(0, 1) == 1
    deadline = pick(1, 3 * (micro_batches + buckets + world) + 10) if finite else None
    return Scenario(
        world=world, buckets=buckets, micro_batches=micro_batches, steps=steps, deaths=deaths, together=together,
        slow=slow, late=late, liveness=liveness, liveness_delay=pick(0, 8), deadline=deadline,
        joiner_at=pick(1, 60) if pick(0, 2) == 0 else None, partial=pick(0, 2) / 2, seed=pick(0, 2**16))


@st.composite
def scenarios(draw: st.DrawFn, keep_one: bool = True) -> Scenario:
    return build_scenario(lambda lo, hi: draw(st.integers(lo, hi)), keep_one)


def run(scenario: Scenario) -> Sim:
    note(repr(scenario))
    sim = Sim(scenario).run()
    note(f"outcome={sim.outcome} records={sim.records()} deaths={sim.deaths} excluded={sim.excluded} "
         f"admitted={sim.admitted}")
    return sim


# -- the properties, checked on one run ---------------------------------------------------
def check_one_record_per_generation(sim: Sim) -> None:
    """1. One record per generation, written once; everyone who followed one followed the stored one."""
    records = sim.records()
    assert all(n == 1 for n in sim.store.creates.values()), sim.store.creates
    for generation, followers in sim.adopted.items():
        for rank, record in followers.items():
            assert record == records[generation], (generation, rank, record, records[generation])
    for poll in sim.polls:
        # (a decider may die before writing; then a survivor writes it - unless none is left)
        if poll.result is not None and sim.outcome == "finished" and not set(poll.previous) <= sim.dead:
            assert poll.generation in records


def check_no_live_rank_excluded_early(sim: Sim) -> None:
    """2. A live previous member is left out only after the deadline or when it is behind; the rest are members."""
    sc = sim.scenario
    for poll in sim.polls:
        record = poll.result
        if record is None:
            continue
        for rank in poll.previous:
            live = poll.alive is None or rank in poll.alive
            if rank in poll.checked_in and live:
                behind = poll.checked_in[rank].step < record.step
                assert (rank in record.members) != behind, poll  # the members are the newest step's
            elif rank not in record.members and live:
                assert poll.deadline_passed, poll  # alive (as far as anyone knows) and not checked in yet
        if sc.deadline is None:  # with the deadline never passing, a rank that lives is left out only when behind
            for rank in poll.really_alive - set(record.members):
                behind = rank in poll.checked_in and poll.checked_in[rank].step < record.step
                assert behind or (poll.alive is not None and rank not in poll.alive), poll  # or waiting to join
    if sc.deadline is None:
        assert all(reason == "behind" for _, _, reason in sim.excluded), sim.excluded


def check_exact_gradients(sim: Sim) -> None:
    """3. Every completed step reduced to the failure-free sum exactly (no micro-batch lost or counted twice)."""
    sc = sim.scenario
    for step, by_rank in sim.reduced.items():
        want = expected(step, sc.micro_batches, sc.buckets)
        for rank, got in by_rank.items():
            assert got == want, (step, rank, [v if v is None else counts(v, step, k, sc.buckets, sc.micro_batches)
                                              for k, v in enumerate(got)])
    if sim.outcome == "finished":
        assert sorted(sim.reduced) == list(range(sc.steps))


def check_decided_without_waiting(sim: Sim) -> None:
    """4. Once nobody live is missing (dead ranks' keys gone), the very next poll decides: no wait for the deadline."""
    for poll in sim.polls:
        if poll.alive is None:
            continue
        missing = [r for r in poll.previous if r not in poll.checked_in and r in poll.alive]
        live_in = [r for r in poll.checked_in if r in poll.alive and r in poll.previous]
        if not missing and live_in:
            assert poll.result is not None, poll


def check_assignments(sim: Sim) -> None:
    """3. After each recovery every member holds the same assignment, each micro-batch exactly once."""
    for (step, generation), views in sim.assignments.items():
        first = next(iter(views.values()))
        assert all(view == first for view in views.values()), (step, generation, views)
        assert sorted(j for js in first.values() for j in js) == list(range(sim.scenario.micro_batches))
        assert sorted(first) == list(sim.records()[generation].members)


def check_all(sim: Sim) -> None:
    check_one_record_per_generation(sim)
    check_assignments(sim)
    check_no_live_rank_excluded_early(sim)
    check_exact_gradients(sim)
    check_decided_without_waiting(sim)
    if sim.fallbacks:  # no replica was left: the lowest joiner resumed (the fake: from step 0), once per loss
        assert all(reason for _, _, reason in sim.excluded) and sim.admitted
    # only a deadline or being behind leaves live ranks out; without that, the steady rank always finishes. Ranks
    # behind (or left out) rejoin; if every rank that held the newest step's state then dies, no replica is left
    # (the engine then resumes from the snapshot/checkpoint: the multi-process tests cover that)
    assert sim.outcome == "finished" or sim.excluded or sim.outcome == "all_dead" or \
        (sim.outcome == "no_replica" and not sim.scenario.liveness), sim.describe()
    if sim.outcome == "all_dead":
        gone = sim.scenario.deaths.keys() | {rank for _, rank in sim.retired}  # (a rank let go is not a replica)
        assert gone >= set(range(sim.scenario.world)) or sim.scenario.together


@FAST
@given(scenarios())
def test_recovery_protocol_properties(scenario: Scenario) -> None:
    check_all(run(scenario))


@FAST
@given(scenarios(keep_one=False))
def test_recovery_protocol_properties_when_every_rank_may_die(scenario: Scenario) -> None:
    check_all(run(scenario))


# -- the scenarios named in the issue ------------------------------------------------------
def test_4_ranks_one_killed_a_survivor_blocked_on_another_survivor_checks_in_late_still_a_member() -> None:
    # ring 0-1-2-3: rank 3's neighbours (0, 2) see its death; rank 1 is blocked on them, two survivors,
    # fails only once they drop the group, and checks in late: the others wait for it (it is alive)
    sim = Sim(Scenario(world=4, buckets=2, micro_batches=8, steps=2, deaths={3: ("bucket", 0, 0)},
                       late={1: 40}, liveness=True, liveness_delay=0, deadline=None)).run()
    check_all(sim)
    assert sim.records()[1] == MembershipRecord(1, (0, 1, 2), 0, (3,))
    assert any(p.result is None and 1 not in p.checked_in for p in sim.polls)  # they did wait for rank 1
    assert set(sim.adopted[1]) == {0, 1, 2} and not sim.excluded


def test_a_survivor_late_past_the_deadline_is_left_out_and_rejoins_at_the_next_step() -> None:
    sim = Sim(Scenario(world=4, buckets=2, micro_batches=8, steps=4, deaths={3: ("bucket", 0, 0)},
                       late={1: 12}, liveness=True, deadline=5)).run()
    check_all(sim)
    assert sim.records()[1] == MembershipRecord(1, (0, 2), 0, (1, 3))
    assert sim.excluded == [(1, 1, "left out")]
    assert [rank for _, rank in sim.admitted] == [1]  # no schedule: the leader admits it between steps
    assert 1 in sim.reduced[3]  # and it took part in a later step, with exact gradients


def test_node_of_2_ranks_lost_liveness_keys_vanish_after_the_ttl_record_without_them() -> None:
    ttl = 12
    sim = Sim(Scenario(world=4, buckets=3, micro_batches=8, steps=2, deaths={2: ("bucket", 0, 1)},
                       together=frozenset({2, 3}), liveness=True, liveness_delay=ttl, deadline=None)).run()
    check_all(sim)
    assert sim.records()[1] == MembershipRecord(1, (0, 1), 1, (2, 3))  # bucket 0 was reduced by all four: kept
    died = max(d.round for d in sim.deaths)
    assert [d.rank for d in sim.deaths] == [2, 3] and {d.round for d in sim.deaths} == {died}
    assert sim.written[1] >= died + ttl  # no deadline: the keys vanishing ended the wait
    assert all(p.result is None for p in sim.polls if p.round < died + ttl)


def test_the_node_of_rank_0_lost_with_the_leader_and_a_join_request_during_the_failure() -> None:
    sim = Sim(Scenario(world=4, buckets=2, micro_batches=6, steps=3, deaths={0: ("sent", 0, 1)},
                       together=frozenset({0, 1}), liveness=True, liveness_delay=5, joiner_at=10,
                       seed=2)).run()  # an interleaving where rank 1 dies before entering bucket 1
    check_all(sim)
    assert sim.records()[1] == MembershipRecord(1, (2, 3), 1, (0, 1))  # rank 0 died having sent bucket 1
    assert any(d.was_leader for d in sim.deaths)
    assert [rank for _, rank in sim.admitted] == [4]  # admitted by the new leader, rank 2
    assert set(sim.reduced[2]) == {2, 3, 4}


def test_a_member_of_the_new_generation_dies_before_its_group_forms() -> None:
    sim = Sim(Scenario(world=5, buckets=3, micro_batches=10, steps=2,
                       deaths={4: ("bucket", 0, 2), 2: ("form", 0)}, liveness=True, liveness_delay=3)).run()
    check_all(sim)
    records = sim.records()
    assert records[1].members == (0, 1, 2, 3) and records[1].kept_buckets == 2
    assert records[2] == MembershipRecord(2, (0, 1, 3), 2, (2,))


def test_a_member_dies_during_the_redo() -> None:
    sim = Sim(Scenario(world=4, buckets=3, micro_batches=9, steps=2,
                       deaths={3: ("micro", 0, 3), 1: ("redo", 0)}, liveness=True, liveness_delay=2)).run()
    check_all(sim)
    records = sim.records()
    assert records[1] == MembershipRecord(1, (0, 1, 2), 0, (3,))
    assert records[2] == MembershipRecord(2, (0, 2), 0, (1,))


def test_without_liveness_only_the_deadline_ends_the_wait() -> None:
    sim = Sim(Scenario(world=3, buckets=2, micro_batches=6, steps=2, deaths={2: ("micro", 0, 2)},
                       liveness=False, deadline=15)).run()
    check_all(sim)
    assert sim.records()[1] == MembershipRecord(1, (0, 1), 0, (2,))
    assert all(p.deadline_passed for p in sim.polls if p.result is not None)
    assert sum(p.result is None for p in sim.polls) >= 15


def test_last_bucket_completed_on_some_survivors_only() -> None:
    # the last bucket's all-reduce completes on some survivors and fails on others: the first ones stepped and fail
    # in the next step, the others are behind; the record's members are the newest step's, the others rejoin
    behind_seen = 0
    for seed in range(30):
        sim = Sim(Scenario(world=4, buckets=1, micro_batches=4, steps=2, deaths={3: ("sent", 0, 0)},
                           partial=1.0, partial_last=True, seed=seed)).run()
        check_all(sim)
        behind_seen += any(reason == "behind" for _, _, reason in sim.excluded)
    assert behind_seen > 0  # the case did occur


@FAST
@given(scenarios(), st.floats(0.0, 1.0))
def test_recovery_protocol_properties_when_the_last_bucket_completes_on_some_only(scenario: Scenario,
                                                                                   partial: float) -> None:
    from dataclasses import replace
    check_all(run(replace(scenario, partial=partial, partial_last=True)))


# -- deal + redistribute over successive failures -----------------------------------------------
@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.integers(1, 40), st.integers(2, 8), st.data())
def test_successive_redistributions_keep_every_micro_batch_once(b: int, world: int, data: st.DataObject) -> None:
    members = list(range(world))
    assignment = deal(b, members)
    while len(members) > 1 and data.draw(st.booleans()):  # one more failure: some (not all) members die
        dead = data.draw(st.lists(st.sampled_from(members), min_size=1, max_size=len(members) - 1, unique=True))
        moved = redistribute(assignment, dead)
        members = [r for r in members if r not in dead]
        assert set(moved) == set(members)
        orphans = sorted(j for r in dead for j in assignment[r])
        assert sorted(j for js in moved.values() for j in js) == orphans
        sizes = [len(js) for js in moved.values()]
        assert max(sizes) - min(sizes) <= 1  # dealt round-robin
        assignment = {r: assignment[r] + moved[r] for r in members}
        assert sorted(j for js in assignment.values() for j in js) == list(range(b))


# -- decide_record, role: the pure decisions alone --------------------------------------------
@st.composite
def poll_inputs(draw: st.DrawFn) -> tuple:
    previous = sorted(draw(st.sets(st.integers(0, 12), min_size=1, max_size=8)))
    strangers = [20, 21]  # not previous members (e.g. a joiner): ignored
    checked = draw(st.dictionaries(st.sampled_from(previous + strangers),
                                   st.builds(CheckIn, st.integers(5, 7), st.integers(0, 4))))
    alive = draw(st.none() | st.sets(st.sampled_from(previous + strangers)))
    return draw(st.integers(1, 10**6)), previous, checked, alive, draw(st.booleans())


@settings(max_examples=300, deadline=None, derandomize=True)
@given(poll_inputs())
def test_decide_record_waits_for_exactly_the_live_ranks_missing(inputs: tuple) -> None:
    generation, previous, checked, alive, passed = inputs
    record = decide_record(generation, previous, checked, alive, passed)
    live = [r for r in previous if alive is None or r in alive]
    missing = [r for r in live if r not in checked]
    live_in = [r for r in live if r in checked]
    if not live_in or (missing and not passed):  # nobody to form a group, or a live member to wait for
        assert record is None
        return
    assert record is not None  # (4) nothing to wait for (or the deadline passed): decided at once
    assert record.generation == generation and not record.resize
    newest = max(checked[r].step for r in live_in)
    assert record.step == newest
    assert list(record.members) == [r for r in live_in if checked[r].step == newest]  # (2) behind ones rejoin
    assert record.dead == tuple(sorted(set(previous) - set(record.members)))
    assert record.kept_buckets == min(checked[r].done for r in record.members)
    assert all(role(record, r) == "member" and role(record, r, newest) == "member" for r in record.members)
    assert all(role(record, r, newest - 1) == "joiner" for r in record.members)  # behind
    assert all(role(record, r) == "joiner" for r in [*record.dead, 20, 21])
    assert MembershipRecord.from_json(record.to_json()) == record


def test_a_dead_rank_that_checked_in_is_still_left_out_and_a_dead_leader_hands_over() -> None:
    checked = {0: CheckIn(4, 2), 1: CheckIn(4, 1), 2: CheckIn(4, 1)}
    record = decide_record(3, [0, 1, 2], checked, alive={1, 2}, deadline_passed=False)
    assert record == MembershipRecord(3, (1, 2), 1, (0,), step=4) and record.leader == 1


def test_ranks_behind_the_newest_step_are_left_out() -> None:
    # ranks 0 and 1 completed step 4's last bucket and failed in step 5; rank 2 failed step 4's last bucket
    checked = {0: CheckIn(5, 0), 1: CheckIn(5, 0), 2: CheckIn(4, 3)}
    record = decide_record(7, [0, 1, 2, 3], checked, alive={0, 1, 2}, deadline_passed=False)
    assert record == MembershipRecord(7, (0, 1), 0, (2, 3), step=5)
    assert role(record, 2, 4) == "joiner" and role(record, 0, 5) == "member"


def test_a_resize_record_admits_and_retires() -> None:
    record = resize_record(4, [0, 1, 2], [0, 2, 5], step=9)
    assert record == MembershipRecord(4, (0, 2, 5), 0, (1,), step=9, resize=True)
    assert MembershipRecord.from_json(record.to_json()) == record
    with pytest.raises(MembershipError):
        resize_record(4, [0, 1], [2, 2], step=9)


@pytest.mark.parametrize(("checked", "alive", "passed", "verdict"), [
    ({0: CheckIn(9, 0), 2: CheckIn(9, 0), 5: CheckIn(9, 0)}, {0, 2, 5}, False, "build"),
    ({0: CheckIn(9, 0), 2: CheckIn(9, 0)}, {0, 2, 5}, False, "wait"),  # the joiner is on its way
    ({0: CheckIn(9, 0), 2: CheckIn(9, 0)}, {0, 2, 5}, True, "abandon"),  # ... not by the deadline
    ({0: CheckIn(9, 0), 2: CheckIn(9, 0)}, {0, 2}, False, "abandon"),  # it died
    ({0: CheckIn(9, 0), 2: CheckIn(8, 3), 5: CheckIn(9, 0)}, None, False, "abandon"),  # rank 2 is behind
    ({0: CheckIn(9, 0), 2: CheckIn(9, 0)}, None, False, "wait"),  # no liveness: only the deadline ends it
])
def test_formation(checked: dict, alive: set | None, passed: bool, verdict: str) -> None:
    record = resize_record(4, [0, 1, 2], [0, 2, 5], step=9)
    assert formation(record, checked, alive, passed) == verdict


@pytest.mark.parametrize("text", ['{"step": -1, "done": 0}', '{"step": 1}', '{"step": true, "done": 0}', "[", "7"])
def test_malformed_checkins_are_refused(text: str) -> None:
    with pytest.raises(MembershipError):
        CheckIn.from_json(text)


# -- MembershipRecord JSON ---------------------------------------------------------------------
@st.composite
def records(draw: st.DrawFn) -> MembershipRecord:
    members = sorted(draw(st.sets(st.integers(0, 2**40), min_size=1, max_size=8)))
    dead = sorted(draw(st.sets(st.integers(0, 2**40).filter(lambda r: r not in members), max_size=5)))
    return MembershipRecord(draw(st.integers(0, 2**40)), tuple(members), draw(st.integers(0, 64)), tuple(dead),
                            draw(st.integers(0, 2**40)), draw(st.booleans()))


@settings(max_examples=100, deadline=None, derandomize=True)
@given(records())
def test_record_round_trips_through_json(record: MembershipRecord) -> None:
    assert MembershipRecord.from_json(record.to_json()) == record
    assert MembershipRecord.from_json(record.to_json().encode()) == record


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 2**70) | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=10)
record_fields = st.fixed_dictionaries(
    {"generation": json_values, "members": json_values | st.lists(st.integers(-2, 5), max_size=4),
     "kept_buckets": json_values}, optional={"dead": json_values | st.lists(st.integers(-2, 5), max_size=3)})
deeply_nested = st.integers(1, 5000).map(lambda n: '{"generation": ' + "[" * n + "]" * n + "}")
junk = st.one_of(st.binary(max_size=40), st.text(max_size=40), json_values.map(json.dumps),
                 record_fields.map(json.dumps), record_fields.map(lambda d: json.dumps(d).encode("utf-16")),
                 deeply_nested, st.integers(1, 5000).map(lambda n: "[" * n))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(junk)
def test_from_json_accepts_a_valid_record_or_raises_membership_error_only(data: str | bytes) -> None:
    try:
        record = MembershipRecord.from_json(data)
    except MembershipError:
        return
    assert MembershipRecord.from_json(record.to_json()) == record


@pytest.mark.parametrize("raw", [
    {"generation": 1, "members": [], "kept_buckets": 0},
    {"generation": 1, "members": [1, 0], "kept_buckets": 0},
    {"generation": 1, "members": [0, 0], "kept_buckets": 0},
    {"generation": 1, "members": [True], "kept_buckets": 0},
    {"generation": 1.0, "members": [0], "kept_buckets": 0},
    {"generation": 1, "members": [0], "kept_buckets": -1},
    {"generation": 1, "members": [0, 1], "kept_buckets": 0, "dead": [1]},
    {"generation": 1, "members": [0], "kept_buckets": 0, "dead": [3, 2]},
    {"generation": 1, "members": [0], "kept_buckets": 0, "dead": [2, 2]},
    {"generation": 1, "members": [0], "kept_buckets": 0, "step": -1},
    {"generation": 1, "members": [0], "kept_buckets": 0, "resize": 1},
    {"generation": 1, "members": ["0"], "kept_buckets": 0},
    {"members": [0], "kept_buckets": 0},
    [1, [0], 0],
])
def test_malformed_records_are_refused(raw: object) -> None:
    with pytest.raises(MembershipError):
        MembershipRecord.from_json(json.dumps(raw))


# -- proposal ----------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.integers(0, 6), st.lists(st.integers(0, 9), min_size=1, max_size=6, unique=True),
       st.lists(st.integers(0, 12), max_size=6),
       st.dictionaries(st.integers(0, 6), st.lists(st.integers(0, 9), min_size=1, max_size=6, unique=True),
                       max_size=3),
       st.lists(st.integers(0, 12), max_size=6))
def test_proposal_admits_waiting_ranks_once_and_lets_leaving_ones_go_unless_a_schedule_decides(
        step: int, members: list[int], waiting: list[int], schedule: dict[int, list[int]], leaving: list[int]) -> None:
    wanted = proposal(step, members, schedule, waiting, leaving)
    if schedule:  # the schedule alone decides: nobody is admitted or let go on their own
        assert wanted == list(schedule.get(step, members))
    else:
        stay = [r for r in members if r not in leaving] or members  # somebody must keep the state
        assert wanted[: len(stay)] == stay  # order kept
        assert wanted[len(stay):] == sorted(set(waiting) - set(members) - set(leaving))
    assert len(set(wanted)) == len(wanted)


def test_ranks_asked_to_leave_retire_at_a_step_boundary_and_the_others_keep_every_micro_batch() -> None:
    # the node of ranks 2 and 3 leaves (the plan gave it to another task): the leader lets them go between steps
    sim = Sim(Scenario(world=4, buckets=2, micro_batches=8, steps=4, leaving={2: 5, 3: 5}, liveness=True)).run()
    check_all(sim)
    assert sim.outcome == "finished" and not sim.deaths and not sim.excluded
    [(step, _), _] = sim.retired
    assert sorted(rank for _, rank in sim.retired) == [2, 3] and {s for s, _ in sim.retired} == {step}
    assert 0 < step < 4 and set(sim.reduced[3]) == {0, 1}
    assert not any(k.startswith("unicron-dp/leave/") for k in sim.store.data)  # requests withdrawn


def test_the_leader_asked_to_leave_hands_over_and_a_lone_member_is_never_let_go() -> None:
    sim = Sim(Scenario(world=3, buckets=1, micro_batches=6, steps=3, leaving={0: 3}, liveness=True)).run()
    check_all(sim)
    assert [rank for _, rank in sim.retired] == [0] and set(sim.reduced[2]) == {1, 2}
    alone = Sim(Scenario(world=2, buckets=1, micro_batches=4, steps=3, leaving={0: 3, 1: 3}, liveness=True)).run()
    check_all(alone)
    assert alone.outcome == "finished" and alone.retired == []  # nobody else would hold the state


@FAST
@given(scenarios(), st.data())
def test_recovery_protocol_properties_with_ranks_asked_to_leave(scenario: Scenario, data: st.DataObject) -> None:
    """Leave requests at any round, together with deaths, slow and late ranks, joiners."""
    leaving = data.draw(st.dictionaries(st.integers(0, scenario.world - 1), st.integers(1, 80), max_size=2))
    sim = run(dataclasses.replace(scenario, leaving=leaving))
    check_all(sim)
    retired = {rank for _, rank in sim.retired}
    assert retired <= set(leaving)
    assert not {rank for d in sim.deaths for rank in [d.rank]} & retired


# -- the two transports ------------------------------------------------------------------------------
def test_both_transports_execute_every_effect_of_the_protocol() -> None:
    import dataclasses
    import inspect
    from datetime import timedelta

    import torch

    from fake_dp import _Rank
    from unicron_elastic.strategy import protocol
    from unicron_elastic.strategy.elastic_dp import ElasticDataParallel
    from unicron_elastic.strategy.microbatch import GlobalBatchPlan

    effects = {cls for _, cls in inspect.getmembers(protocol, inspect.isclass)
               if cls.__module__ == protocol.__name__ and dataclasses.is_dataclass(cls)
               and cls not in (protocol.StepReport, protocol.Regrouped)}
    assert len(effects) > 20
    fake = _Rank(Sim(Scenario(world=2, buckets=1, micro_batches=2)), 0, [0, 1], joining=False)
    assert set(fake.handlers) == effects
    model = torch.nn.Linear(2, 1)
    real = ElasticDataParallel(model, torch.optim.SGD(model.parameters(), lr=0.1), GlobalBatchPlan(8, 4, 2),
                               batch=lambda idx: idx, loss_fn=lambda m, b: m.weight.sum(), store=None,
                               rank=0, world_size=1, joining=True, timeout=timedelta(seconds=5))
    assert set(real._handlers) == effects


def test_every_replica_lost_while_a_rank_waits_to_rejoin_it_resumes_alone() -> None:
    # rank 3 dies, rank 2 checks in past the deadline and is left out; then ranks 0 and 1 (a node) die before
    # admitting it: no replica is left, the waiting rank resumes (the engine: snapshot, checkpoint, step 0)
    sim = Sim(Scenario(world=4, buckets=2, micro_batches=8, steps=3, deaths={3: ("bucket", 0, 0), 0: ("bucket", 0, 1)},
                       together=frozenset({0, 1}), late={2: 12}, liveness=True, liveness_delay=3, deadline=5)).run()
    check_all(sim)
    assert sim.excluded == [(1, 2, "left out")]
    assert [rank for _, rank in sim.fallbacks] == [2]
    assert sim.records()[2] == MembershipRecord(2, (2,), 0, (0, 1), step=0, resize=True)
    assert sim.outcome == "finished" and {s: sorted(by) for s, by in sim.reduced.items()} == {0: [2], 1: [2], 2: [2]}


def test_a_node_lost_before_the_first_group_formed_the_survivors_start_from_step_0() -> None:
    """Ranks 2 and 3 died while the first group was built (no group, no members record); ranks 0 and 1
    were restarted and wait to join: with liveness keys they know 2 and 3 are gone, and the lowest starts
    the group from the fallback (snapshot, checkpoint, else step 0). Without liveness keys nobody can know."""
    sim = Sim(Scenario(world=4, buckets=2, micro_batches=6, steps=3, unformed=frozenset({2, 3}),
                       liveness=True)).run()
    check_all(sim)
    assert sim.outcome == "finished" and [rank for _, rank in sim.fallbacks] == [0]
    assert set(sim.reduced[2]) == {0, 1}
    blind = Sim(Scenario(world=4, buckets=2, micro_batches=6, steps=3, unformed=frozenset({2, 3}),
                         liveness=False)).run()
    assert blind.outcome == "no_replica" and blind.fallbacks == []


@FAST
@given(scenarios(), st.data())
def test_recovery_protocol_properties_after_a_loss_before_the_first_group(scenario: Scenario,
                                                                          data: st.DataObject) -> None:
    lost = data.draw(st.sets(st.integers(0, scenario.world - 1), min_size=1, max_size=scenario.world - 1))
    survivors = [r for r in range(scenario.world) if r not in lost]
    sim = run(dataclasses.replace(scenario, unformed=frozenset(lost), deaths={}, together=frozenset(),
                                  joiner_at=None, liveness=True))
    check_all(sim)
    # (a group that did not form - a slow or late rank past the deadline - is started again: same rank)
    assert sim.outcome == "finished" and {rank for _, rank in sim.fallbacks} == {min(survivors)}
