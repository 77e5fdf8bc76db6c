"""The coordinator's pure decisions: plans, placement, escalation, the one-step table, specs (issue #11, item 4)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unicron_elastic.coordinator.api import ClusterPlan, Command, NodeRecord, SpecError, TaskSpec
from unicron_elastic.coordinator.observe import Observed, changes
from unicron_elastic.coordinator.policy import decide, fold, replan
from unicron_elastic.coordinator.sizing import place, replica_sizes, task_throughput
from unicron_elastic.coordinator.standby import state_from_json, state_to_json
from unicron_elastic.coordinator.vocabulary import (
    Alert,
    ClusterState,
    Failure,
    NodeJoined,
    NodeLeft,
    NodeLost,
    PolicyConfig,
    Replan,
    TaskFinished,
    TaskSubmitted,
    WritePlan,
)
from unicron_elastic.coordinator.service import task_status
from unicron_elastic.events import ErrorEvent, Severity
from unicron_elastic.planner import CostModel, PlanTask, Problem, solve
from unicron_elastic.planner.throughput import GptModel, TabulatedThroughput

CONFIG = PolicyConfig(failure_rate=1e-4, d_transition=60.0)


def spec(name: str, weight: float = 1.0, lo: int = 2, hi: int = 6, table: dict | None = None, **kw) -> TaskSpec:
    table = table or {"2": 2.0, "4": 3.6, "6": 5.0}
    doc = dict(name=name, command=["python"], weight=weight, min_workers=lo, max_workers=hi, global_batch=12,
               model={"calibration": table})
    doc.update(kw)
    return TaskSpec.from_dict(doc)


A = spec("a", 1.0)
B = spec("b", 2.0, hi=4, table={"2": 1.0, "4": 1.5})


def cluster(*events) -> ClusterState:
    state = ClusterState(config=CONFIG)
    for e in events:
        state = decide(state, e).state
    return state


def optimum(state: ClusterState, faulted=frozenset(), current=None) -> dict[str, int]:
    """The planner's optimum, built here from the specs by hand (node units)."""
    slots = state.slots()
    n = len(state.usable())
    table = {t.name: task_throughput(t, slots, n, CONFIG.gpu)[0] for t in state.tasks}
    cost = CostModel(TabulatedThroughput(table), CONFIG.failure_rate, CONFIG.d_transition)
    current = current or {}
    tasks = tuple(PlanTask(t.name, GptModel(t.name, 1, 1, 1), t.weight, 1, current.get(t.name, 0), t.name in faulted)
                  for t in state.tasks)
    return solve(Problem(tasks, n, cost)).assignment


def sizes(plan: ClusterPlan) -> dict[str, int]:
    return {n: len(t.nodes) for n, t in plan.tasks.items()}


def test_initial_plan_is_the_planners_optimum_and_every_node_gets_a_command() -> None:
    state = cluster(*(NodeJoined(f"n{i}", 2) for i in range(3)))
    d = fold(state, [TaskSubmitted(A), TaskSubmitted(B)])
    assert sizes(d.state.plan) == optimum(d.state) == {"a": 2, "b": 1}
    assert d.state.plan.tasks["a"].workers == 4 and d.state.plan.tasks["b"].workers == 2
    assert d.state.plan.tasks["b"].waf == pytest.approx(2.0 * 1.0)
    assert d.state.plan.generation == state.plan.generation + 1  # one generation per plan written
    (write,) = [a for a in d.actions if isinstance(a, WritePlan)]
    assert {c.node: c.task for c in write.commands} == {"n0": "a", "n1": "a", "n2": "b"}


def test_node_lost_replans_with_the_task_faulted_and_alerts() -> None:
    state = cluster(*(NodeJoined(f"n{i}", 2) for i in range(3)), TaskSubmitted(A), TaskSubmitted(B))
    d = decide(state, NodeLost("n1"))
    assert sizes(d.state.plan) == optimum(d.state, frozenset({"a"}), {"a": 2, "b": 1})
    assert "n1" not in d.state.plan.nodes
    alerts = [a for a in d.actions if isinstance(a, Alert)]
    assert alerts and alerts[0].severity == Severity.SEV1 and alerts[0].task == "a"
    (write,) = [a for a in d.actions if isinstance(a, WritePlan)]
    assert write.forget == ("n1",)  # a lost node's commands are deleted, none are sent to it


def test_a_node_that_left_is_planned_out_like_a_lost_one_without_an_alert() -> None:
    state = cluster(*(NodeJoined(f"n{i}", 2) for i in range(3)), TaskSubmitted(A), TaskSubmitted(B))
    left, lost = decide(state, NodeLeft("n1")), decide(state, NodeLost("n1"))
    assert left.state.plan.tasks == lost.state.plan.tasks and "n1" not in left.state.plan.nodes
    assert not [a for a in left.actions if isinstance(a, Alert)]
    assert "left" in left.state.plan.reason and "SEV1" not in left.state.plan.reason
    (write,) = [a for a in left.actions if isinstance(a, WritePlan)]
    assert write.forget == ("n1",)
    assert decide(left.state, NodeLost("n1")).actions == ()  # its record lapsing later changes nothing


def test_a_returning_node_is_used_again_and_the_survivors_keep_their_nodes() -> None:
    state = cluster(*(NodeJoined(f"n{i}", 2) for i in range(3)), TaskSubmitted(A), TaskSubmitted(B), NodeLost("n0"))
    before = {n: set(t.nodes) for n, t in state.plan.tasks.items()}
    after = decide(state, NodeJoined("n0", 2)).state
    assert "n0" in {n for t in after.plan.tasks.values() for n in t.nodes}
    for name, nodes in before.items():
        assert nodes <= set(after.plan.tasks[name].nodes) or len(after.plan.tasks[name].nodes) < len(nodes)


def test_task_finished_gives_its_nodes_to_the_other_and_is_never_planned_again() -> None:
    state = cluster(*(NodeJoined(f"n{i}", 2) for i in range(3)), TaskSubmitted(A), TaskSubmitted(B))
    d = decide(state, TaskFinished("b"))
    assert sizes(d.state.plan) == {"a": 3}
    assert d.state.plan.finished == ("b",)
    assert decide(d.state, TaskSubmitted(B)).state == d.state  # a finished name is not reused


def test_cancel_is_a_finish_that_says_so() -> None:
    state = cluster(NodeJoined("n0", 2), TaskSubmitted(A))
    assert "cancelled" in decide(state, TaskFinished("a", cancelled=True)).state.plan.reason


def test_repeated_failures_on_one_node_alert_then_isolate_it() -> None:
    state = cluster(*(NodeJoined(f"n{i}", 2) for i in range(3)), TaskSubmitted(A))
    e = lambda t: Failure(ErrorEvent(Severity.SEV2, "exited_abnormally", "process", "n1", 0, "a", detected_at=t))
    first = decide(state, e(100.0))
    assert first.actions == () and first.state.plan is state.plan  # the agent handles one SEV2 in place
    second = decide(first.state, e(101.0))
    assert [a.severity for a in second.actions] == [Severity.SEV2]  # repeated: an alert, no re-plan
    third = decide(second.state, e(102.0))
    assert "n1" in third.state.isolated and "n1" not in third.state.plan.nodes
    assert any(isinstance(a, Alert) and a.severity == Severity.SEV1 for a in third.actions)
    late = decide(first.state, e(100.0 + CONFIG.window_s + 1))
    assert late.actions == ()  # outside the window the count starts again


def test_a_task_failing_on_several_nodes_fails_and_no_node_is_isolated() -> None:
    """A crashing task must not take the cluster's nodes out one after another, nor be restarted forever:
    it fails (never planned again) and its nodes go to the other tasks."""
    state = cluster(*(NodeJoined(f"n{i}", 2) for i in range(3)), TaskSubmitted(A))
    assert len(state.plan.tasks["a"].nodes) == 3
    e = lambda node, t, task="a": Failure(ErrorEvent(Severity.SEV2, "exited_abnormally", "process", node, 0, task,
                                                     detected_at=t))
    for event in (e("n0", 100.0), e("n1", 100.5), e("n0", 101.0), e("n1", 101.5)):
        state = decide(state, event).state
    third = decide(state, e("n0", 102.0))  # n0's third failure; a failed on n1 too
    assert third.state.isolated == frozenset()
    assert "a" not in third.state.plan.tasks and third.state.plan.failed == ("a",) and "a" in third.state.finished
    assert third.state.plan.reason == "task a failed" and task_status(third.state, "a")["state"] == "failed"
    [alert, _write] = third.actions
    assert alert.severity == Severity.SEV1 and alert.task == "a" and "not a node, is suspect" in alert.message
    assert "n1" in alert.message
    assert decide(third.state, TaskSubmitted(A)).actions == ()  # a failed task is never planned again
    assert third.state.failures == {} and third.state.task_failures == {}  # its failures are explained by it
    assert decide(third.state, e("n0", 102.5)).actions == ()  # a late event of the failed task: nothing
    assert "n0" not in decide(third.state, e("n0", 103.0, "b")).state.isolated  # one more failure: no isolation
    restored, _ = state_from_json(state_to_json(third.state, 7, "me"), third.state.plan, {"a": A}, CONFIG)
    assert restored.failed == {"a"} and ClusterPlan.from_json(third.state.plan.to_json()).failed == ("a",)
    # failures of the same node under another task (or none) still isolate it
    other = decide(third.state, e("n2", 103.0, "b"))
    other = decide(decide(other.state, e("n2", 104.0, "b")).state, e("n2", 105.0, "b"))
    assert "n2" in other.state.isolated
    # an isolated node's failures are explained by it: they no longer make a task suspect
    lone = cluster(*(NodeJoined(f"n{i}", 2) for i in range(3)), TaskSubmitted(A))
    for t in (1.0, 2.0, 3.0):
        lone = decide(lone, e("n0", t)).state
    assert "n0" in lone.isolated and all(n != "n0" for f in lone.task_failures.values() for _, n in f)
    for t in (4.0, 5.0, 6.0):
        lone = decide(lone, e("n1", t)).state
    assert lone.isolated == {"n0", "n1"}


def test_a_sev1_event_isolates_the_node_at_once() -> None:
    state = cluster(NodeJoined("n0", 2), NodeJoined("n1", 2), TaskSubmitted(A))
    d = decide(state, Failure(ErrorEvent(Severity.SEV1, "ecc", "nvml", "n0", -1, "a")))
    assert d.state.isolated == {"n0"} and d.state.plan.tasks["a"].nodes == ("n1",)


def test_events_for_unknown_or_repeated_things_change_nothing() -> None:
    state = cluster(NodeJoined("n0", 2), TaskSubmitted(A))
    for event in (NodeLost("zz"), NodeJoined("n0", 2), TaskSubmitted(A), TaskFinished("zz"),
                  Failure(ErrorEvent(Severity.SEV2, "x", "d", "zz"))):
        assert decide(state, event) == type(decide(state, event))(state)
    with pytest.raises(TypeError):
        decide(state, "node lost")


def test_a_task_with_no_feasible_size_waits_with_no_nodes() -> None:
    state = cluster(NodeJoined("n0", 2), TaskSubmitted(spec("big", lo=4, hi=8, table={"4": 1.0})))
    assert state.plan.tasks["big"].nodes == () and state.plan.tasks["big"].workers == 0


def test_analytic_model_gives_the_megatron_parallel_config() -> None:
    s = spec("gpt", lo=8, hi=64, model="1.3B", global_batch=512)
    state = cluster(*(NodeJoined(f"n{i}", 8) for i in range(2)), TaskSubmitted(s))
    share = state.plan.tasks["gpt"]
    assert share.workers == 16 and share.parallel.startswith("tp=") and share.waf > 0


def test_place_keeps_tasks_where_they_run() -> None:
    usable = ["a1", "a2", "b1", "c1", "c2"]
    got = place({"x": 2, "y": 2}, {"x": ("a2", "b1", "zz"), "y": ("c1",)}, usable)
    assert got == {"x": ("a2", "b1"), "y": ("a1", "c1")}
    with pytest.raises(ValueError, match="needs 6 nodes"):
        place({"x": 6}, {}, usable)


def test_changes_derives_events_worst_first() -> None:
    state = cluster(NodeJoined("n0", 2), NodeJoined("n1", 2), TaskSubmitted(A))
    err = ErrorEvent(Severity.SEV3, "timeout", "exception", "n0")
    seen = Observed({"n0": 2, "n2": 2}, (A, B), frozenset(), {"a": frozenset(state.plan.tasks["a"].nodes)}, ((5, err),))
    assert changes(state, seen) == [NodeLost("n1"), NodeJoined("n2", 2), TaskFinished("a"), TaskSubmitted(B),
                                    Failure(err)]
    assert changes(ClusterState(config=CONFIG), Observed()) == [Replan("first plan")]
    assert changes(state, Observed({"n0": 2, "n1": 2}, (A,))) == []
    assert changes(state, Observed({"n0": 2}, (A,), leaving=frozenset({"n1"}))) == [NodeLeft("n1")]


def test_a_task_is_finished_when_every_node_of_its_share_reported_done() -> None:
    state = cluster(NodeJoined("n0", 2), NodeJoined("n1", 2), TaskSubmitted(A))
    share = state.plan.tasks["a"].nodes
    assert len(share) == 2
    nodes = {"n0": 2, "n1": 2}
    one = Observed(nodes, (A,), done={"a": frozenset(share[:1])})
    assert changes(state, one) == []  # one launcher ended alone (e.g. its rendezvous closed): a trains on
    assert changes(state, Observed(nodes, (A,), done={"a": frozenset(share)})) == [TaskFinished("a")]
    assert changes(state, Observed(nodes, (A,), frozenset({"a"}), done={"a": frozenset(share[:1])})) == [
        TaskFinished("a", cancelled=True)]


def test_state_survives_its_json_form() -> None:
    state = cluster(NodeJoined("n0", 2), NodeJoined("n1", 2), TaskSubmitted(A), TaskSubmitted(B),
                    Failure(ErrorEvent(Severity.SEV2, "x", "d", "n0", task="a", detected_at=5.0)), TaskFinished("b"))
    assert state.task_failures == {"a": ((5.0, "n0"),)}
    plan = ClusterPlan.from_json(state.plan.to_json())
    assert plan == state.plan
    back, cursor = state_from_json(state_to_json(state, 42, "me"), plan, {"a": A, "b": B}, CONFIG)
    assert cursor == 42 and back == state


# -- the one-step table ----------------------------------------------------------------------------
weights = st.sampled_from([0.5, 1.0, 1.5, 2.0])
flops = st.lists(st.floats(0.5, 10.0), min_size=3, max_size=3)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=st.lists(weights, min_size=1, max_size=3), f=st.lists(flops, min_size=3, max_size=3),
       nodes=st.integers(1, 5), victim=st.integers(0, 4), event=st.sampled_from(["lost", "joined", "finished"]))
def test_one_step_events_come_from_the_table_and_equal_a_fresh_solve(w, f, nodes, victim, event) -> None:
    tasks = [spec(f"t{i}", wi, table={"2": f[i][0], "4": f[i][0] + f[i][1], "6": f[i][0] + f[i][1] + f[i][2]})
             for i, wi in enumerate(w)]
    state = cluster(*(NodeJoined(f"n{i}", 2) for i in range(nodes)), *(TaskSubmitted(t) for t in tasks))
    assert state.table is not None
    if event == "lost":
        node = f"n{victim % nodes}"
        e, hit = NodeLost(node), frozenset({state.plan.task_of(node)} - {None})
    elif event == "joined":
        e, hit = NodeJoined(f"n{nodes}", 2), frozenset()
    else:
        e, hit = TaskFinished(tasks[victim % len(tasks)].name), frozenset()
    via_table = decide(state, e).state
    fresh = decide(replace(state, table=None), e).state
    assert sizes(via_table.plan) == sizes(fresh.plan)
    held = {n: len(t.nodes) for n, t in state.plan.tasks.items() if n in {t.name for t in via_table.tasks}}
    assert sizes(via_table.plan) == optimum(via_table, hit, held)


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["join", "lose", "leave", "submit", "finish", "fail"]), st.integers(0, 4)),
                    max_size=25))
def test_any_sequence_of_events_gives_consistent_plans(ops) -> None:
    state = ClusterState(config=CONFIG)
    pool = [spec(f"t{i}", 0.5 + i * 0.5) for i in range(4)]
    for op, i in ops:
        event = {"join": NodeJoined(f"n{i}", 2), "lose": NodeLost(f"n{i}"), "leave": NodeLeft(f"n{i}"),
                 "submit": TaskSubmitted(pool[i % 4]),
                 "finish": TaskFinished(f"t{i % 4}"),
                 "fail": Failure(ErrorEvent(Severity.SEV2, "x", "d", f"n{i}", detected_at=float(len(ops))))}[op]
        before = state
        d = decide(state, event)
        state = d.state
        if state.plan is None:
            continue
        used = [n for t in state.plan.tasks.values() for n in t.nodes]
        assert len(used) == len(set(used)) and set(used) <= set(state.usable())
        assert set(state.plan.tasks) == {t.name for t in state.tasks}
        for name, share in state.plan.tasks.items():
            assert share.workers == len(share.nodes) * state.slots()
        for action in d.actions:
            if isinstance(action, WritePlan):
                assert all(c.node in state.nodes for c in action.commands)
                assert all(c.generation == state.plan.generation for c in action.commands)
        if before.plan is not None and state.plan is not before.plan:
            assert state.plan.generation == before.plan.generation + 1


# -- the replica unit: model_parallel = TP x PP workers -----------------------------------------------
def test_replica_sizes() -> None:
    assert replica_sizes(2, 4, 1, 10) == (2, 4, 6, 8, 10)  # a replica spans two nodes
    assert replica_sizes(8, 2, 1, 5) == (1, 2, 3, 4, 5)  # four replicas on every node
    assert replica_sizes(6, 4, 1, 7) == (2, 4, 6)  # lcm(6, 4) = 12 workers: two nodes
    assert replica_sizes(4, 8, 3, 9) == (4, 6, 8)
    assert replica_sizes(2, 1, 0, 3) == (1, 2, 3)  # never zero nodes
    assert replica_sizes(2, 4, 5, 5) == () and replica_sizes(0, 4, 1, 9) == ()
    with pytest.raises(ValueError):
        replica_sizes(2, 0, 1, 4)


@settings(max_examples=300, deadline=None)
@given(slots=st.integers(1, 16), unit=st.integers(1, 32), low=st.integers(0, 20), high=st.integers(0, 40))
def test_replica_sizes_are_exactly_the_node_counts_of_whole_replicas(slots, unit, low, high) -> None:
    assert replica_sizes(slots, unit, low, high) == tuple(
        k for k in range(max(low, 1), high + 1) if (k * slots) % unit == 0)


#: T at 6 workers is tempting, but 6 is not a whole number of 4-worker replicas.
WIDE = {"4": 1.0, "6": 100.0, "8": 2.0, "12": 3.0, "16": 3.5}


def test_a_task_of_four_worker_replicas_on_two_slot_nodes_gets_an_even_node_count() -> None:
    mp4 = spec("mp4", lo=4, hi=16, table=WIDE, model_parallel=4, global_batch=4)
    assert set(task_throughput(mp4, 2, 9, CONFIG.gpu)[0]) == {2, 4, 6, 8}
    for n in range(1, 10):
        state = cluster(*(NodeJoined(f"n{i}", 2) for i in range(n)), TaskSubmitted(mp4))
        share = state.plan.tasks["mp4"]
        expected = 0 if n < 2 else min(n - n % 2, 8)
        assert len(share.nodes) == expected and share.workers == 2 * expected and share.workers % 4 == 0
        assert share.parallel == ("" if n < 2 else f"tp*pp=4 dp={expected // 2}")


def test_a_task_of_two_worker_replicas_on_eight_slot_nodes_takes_any_node_count() -> None:
    mp2 = spec("mp2", lo=2, hi=64, table={"8": 1.0, "16": 2.0, "24": 3.0, "32": 4.0}, model_parallel=2,
               global_batch=32)
    assert set(task_throughput(mp2, 8, 4, CONFIG.gpu)[0]) == {1, 2, 3, 4}
    for n in (1, 2, 3):
        state = cluster(*(NodeJoined(f"n{i}", 8) for i in range(n)), TaskSubmitted(mp2))
        assert len(state.plan.tasks["mp2"].nodes) == n and state.plan.tasks["mp2"].parallel == f"tp*pp=2 dp={4 * n}"


def test_replicas_bound_the_size_by_the_global_batch_not_the_workers() -> None:
    one = spec("one", lo=4, hi=16, table=WIDE, model_parallel=4, global_batch=2)  # at most 2 replicas: 8 workers
    state = cluster(*(NodeJoined(f"n{i}", 2) for i in range(8)), TaskSubmitted(one))
    assert state.plan.tasks["one"].workers == 8


def test_after_a_node_loss_the_replan_keeps_whole_replicas() -> None:
    mp4 = spec("mp4", 2.0, lo=4, hi=8, table=WIDE, model_parallel=4, global_batch=4)
    small = spec("small", 0.5, lo=2, hi=8, table={"2": 1.0, "4": 1.5})
    state = cluster(*(NodeJoined(f"n{i}", 2) for i in range(4)), TaskSubmitted(mp4), TaskSubmitted(small))
    assert sizes(state.plan) == {"mp4": 4, "small": 0}
    victim = state.plan.tasks["mp4"].nodes[0]
    via_table = decide(state, NodeLost(victim)).state
    fresh = decide(replace(state, table=None), NodeLost(victim)).state
    assert sizes(via_table.plan) == sizes(fresh.plan) == {"mp4": 2, "small": 1}  # not 3 nodes: 6 workers
    assert set(via_table.plan.tasks["mp4"].nodes) < set(state.plan.tasks["mp4"].nodes)  # keeps its nodes
    assert via_table.plan.tasks["mp4"].workers == 4


def test_the_analytic_model_splits_model_parallel_into_tp_and_pp() -> None:
    gpt = spec("gpt", lo=4, hi=64, model="1.3B", global_batch=512, model_parallel=4)
    state = cluster(*(NodeJoined(f"n{i}", 2) for i in range(5)), TaskSubmitted(gpt))
    share = state.plan.tasks["gpt"]
    assert share.workers == 8 and share.waf > 0
    config = dict(part.split("=") for part in share.parallel.split())
    assert int(config["tp"]) * int(config["pp"]) == 4 and int(config["dp"]) == 2


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(slots=st.sampled_from([1, 2, 4, 8]), units=st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=3),
       ops=st.lists(st.tuples(st.sampled_from(["join", "lose", "finish"]), st.integers(0, 5)), max_size=12))
def test_every_plan_gives_whole_replicas_and_one_step_plans_equal_fresh_ones(slots, units, ops) -> None:
    tasks = [spec(f"t{i}", 0.5 + i * 0.5, lo=u, hi=8 * u, model_parallel=u, global_batch=64,
                  table={str(x): float(x) ** 0.8 for x in range(1, 8 * u + 1)}) for i, u in enumerate(units)]
    state = cluster(*(NodeJoined(f"n{i}", slots) for i in range(4)), *(TaskSubmitted(t) for t in tasks))
    for op, i in ops:
        event = {"join": NodeJoined(f"n{i}", slots), "lose": NodeLost(f"n{i}"),
                 "finish": TaskFinished(f"t{i % len(units)}")}[op]
        after, fresh = decide(state, event).state, decide(replace(state, table=None), event).state
        assert after.plan is None or sizes(after.plan) == sizes(fresh.plan)
        state = after
        for t in state.tasks:
            assert state.plan.tasks[t.name].workers % t.model_parallel == 0


# -- specs -----------------------------------------------------------------------------------------
GOOD = dict(name="t", command=["python", "train.py"], weight=1.0, min_workers=1, max_workers=4, global_batch=8,
            model="1.3B")


@pytest.mark.parametrize("change, field", [
    ({"colour": "red"}, "colour"),
    ({"weight": 0}, "weight"), ({"weight": -1}, "weight"), ({"weight": float("nan")}, "weight"),
    ({"weight": True}, "weight"),
    ({"min_workers": 5}, "min_workers"), ({"min_workers": 0}, "min_workers"), ({"max_workers": 1.5}, "max_workers"),
    ({"global_batch": 0}, "global_batch"),
    ({"command": []}, "command"), ({"command": "python"}, "command"),
    ({"command": ["no-such-command-unicron"]}, "command"),
    ({"name": "a/b"}, "name"), ({"name": ""}, "name"),
    ({"model": "3B"}, "model"), ({"model": {"calibration": {"x": 1}}}, "model"),
    ({"model": {"calibration": {"2": -1}}}, "model"), ({"model": {"layers": 2}}, "model"),
    ({"model": {"layers": 24.0, "hidden": 64, "heads": 4}}, "model"),
    ({"model": {"layers": 10**9, "hidden": 64, "heads": 4}}, "model"),
    ({"model": {"calibration": {"2": "2.0e12"}}}, "model"),
    ({"model_parallel": 0}, "model_parallel"), ({"model_parallel": 1.5}, "model_parallel"),
    ({"model_parallel": True}, "model_parallel"), ({"model_parallel": "2"}, "model_parallel"),
    ({"model_parallel": None}, "model_parallel"),
    ({"model_parallel": 2}, "min_workers"),  # GOOD has min_workers=1
    ({"model_parallel": 2, "min_workers": 2, "max_workers": 5}, "max_workers"),
    ({"model_parallel": 4, "min_workers": 8, "max_workers": 8, "global_batch": 1}, "global_batch"),  # 2 replicas
])
def test_a_bad_spec_names_its_field(change, field) -> None:
    with pytest.raises(SpecError, match=repr(field)):
        TaskSpec.from_dict({**GOOD, **change})


def test_a_missing_field_is_named() -> None:
    with pytest.raises(SpecError, match="'global_batch'"):
        TaskSpec.from_dict({k: v for k, v in GOOD.items() if k != "global_batch"})


def test_model_parallel_is_optional_and_round_trips() -> None:
    old = TaskSpec.from_dict(GOOD)
    assert old.model_parallel == 1 and "model_parallel" not in old.to_dict()  # old documents stay as they were
    assert TaskSpec.from_dict({**GOOD, "model_parallel": 1}) == old
    tp = TaskSpec.from_dict({**GOOD, "model_parallel": 4, "min_workers": 4, "max_workers": 8, "global_batch": 2})
    assert tp.model_parallel == 4 and tp.to_dict()["model_parallel"] == 4
    assert TaskSpec.from_dict(json.loads(json.dumps(tp.to_dict()))) == tp


def test_spec_files_json_and_yaml(tmp_path) -> None:
    (tmp_path / "t.json").write_text(json.dumps(GOOD))
    (tmp_path / "t.yaml").write_text("name: t\ncommand: [python, train.py]\nweight: 1.0\nmin_workers: 1\n"
                                     "max_workers: 4\nglobal_batch: 8\nmodel: 1.3B\n")
    assert TaskSpec.from_file(tmp_path / "t.json") == TaskSpec.from_file(tmp_path / "t.yaml")
    (tmp_path / "bad.yaml").write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match="bad.yaml"):
        TaskSpec.from_file(tmp_path / "bad.yaml")


def test_records_survive_json() -> None:
    assert NodeRecord.from_json(NodeRecord("n", 2, "h", 3).to_json()) == NodeRecord("n", 2, "h", 3)
    assert Command.from_json(Command("n", 4, None).to_json()) == Command("n", 4, None)


@pytest.mark.parametrize(("weight", "warned"), [(0.5, False), (1.0, False), (2.0, False), (0.49, True), (2.5, True),
                                                (100.0, True)])
def test_a_weight_outside_the_papers_range_is_accepted_with_a_warning(weight: float, warned: bool) -> None:
    task = spec("w", weight=weight)
    assert task.weight == weight  # accepted
    warning = task.weight_warning()
    assert (warning is not None) == warned
    if warned:
        assert "'w'" in warning and f"{weight:g}" in warning and "0.5-2" in warning
