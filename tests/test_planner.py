"""Planner: throughput model, cost model, exact solver, evaluator, one-step table."""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unicron_elastic.api import ConfigError
from unicron_elastic.planner import (
    GPU_TYPES,
    MODELS,
    CostModel,
    Event,
    GptModel,
    OneStepTable,
    Plan,
    PlannerError,
    PlanTask,
    Problem,
    ThroughputModel,
    UnknownNodeError,
    estimate,
    evaluate,
    gpu_type,
    solve,
    solve_plain,
)

A800 = GPU_TYPES["A800-80GB"]


# -- throughput model ----------------------------------------------------------

# Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
# Clusters Using Megatron-LM", SC'21, Table 1 (A100 80GB, seq 2048, vocab 51200):
# (name, layers, hidden, heads, global batch, GPUs, achieved TFLOP/s per GPU).
# The 1T row is cross-checked by the paper's abstract (502 PFLOP/s on 3072 GPUs
# = 163 TFLOP/s per GPU); the other rows are as printed in its Table 1.
MEGATRON_SC21 = [
    ("1.7B", 24, 2304, 24, 512, 32, 137),
    ("3.6B", 30, 3072, 32, 512, 64, 138),
    ("7.5B", 36, 4096, 32, 512, 128, 142),
    ("18.4B", 40, 6144, 48, 1024, 256, 135),
    ("39.1B", 48, 8192, 64, 1536, 512, 138),
    ("76.1B", 60, 10240, 80, 1792, 1024, 140),
    ("145.6B", 80, 12288, 96, 2304, 1536, 148),
    ("310.1B", 96, 16384, 128, 2160, 1920, 155),
    ("529.6B", 105, 20480, 128, 2520, 2520, 163),
    ("1T", 128, 25600, 160, 3072, 3072, 163),
]


@pytest.mark.parametrize(("name", "layers", "hidden", "heads", "batch", "gpus", "published"), MEGATRON_SC21)
def test_throughput_model_tracks_published_megatron(name, layers, hidden, heads, batch, gpus, published) -> None:
    m = GptModel(name, layers, hidden, heads, global_batch=batch)
    est = estimate(m, GPU_TYPES["A100-80GB"], gpus)
    assert est.feasible
    ours = est.hardware_flops / gpus / 1e12  # Megatron reports FLOPs incl. recomputation
    assert 0.7 <= ours / published <= 1.4, (ours, published, est.config)
    assert est.memory_bytes <= GPU_TYPES["A100-80GB"].memory_bytes


def test_throughput_is_jagged_and_sometimes_non_monotonic() -> None:
    tm = ThroughputModel(A800)
    m = MODELS["1.3B"]
    sizes = tm.candidates(m, 4096)
    values = [tm.flops(m, x) for x in sizes]
    assert tm.flops(MODELS["7B"], 24) == 0.0 and tm.flops(MODELS["7B"], 32) > 0  # infeasible sizes
    drops = [(a, b) for (a, fa), (b, fb) in itertools.pairwise(zip(sizes, values)) if fb < fa]
    assert drops, "more GPUs should sometimes give less throughput"
    per_gpu = [v / x for x, v in zip(sizes, values)]
    assert per_gpu[-1] < 0.5 * max(per_gpu)  # strongly sub-linear


def test_calibration_overrides_model(tmp_path) -> None:
    path = tmp_path / "cal.csv"
    path.write_text("model,gpus,flops\n7B,24,1e15\n7B,32,0\n")
    tm = ThroughputModel(A800, ThroughputModel.load_calibration(path))
    assert tm.flops(MODELS["7B"], 24) == 1e15 and tm.flops(MODELS["7B"], 32) == 0
    assert 24 in tm.candidates(MODELS["7B"], 64) and 32 not in tm.candidates(MODELS["7B"], 64)


@pytest.mark.parametrize("content", ["model,gpus\n7B,8\n", "model,gpus,flops\n7B,-1,5\n", "model,gpus,flops\n7B,x,5\n"])
def test_malformed_calibration_is_a_clear_error(tmp_path, content: str) -> None:
    path = tmp_path / "cal.csv"
    path.write_text(content)
    with pytest.raises(ConfigError, match="calibration file"):
        ThroughputModel.load_calibration(path)


def test_unknown_gpu_type_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="unknown GPU type 'B300'.*A100-80GB"):
        gpu_type("B300")


# -- cost model ----------------------------------------------------------------


def _table_model(tables: list[list[float]]) -> tuple[ThroughputModel, list[GptModel]]:
    models = [GptModel(f"m{i}", 2, 64, 2) for i in range(len(tables))]
    calibration = {(m.name, x + 1): v for m, table in zip(models, tables) for x, v in enumerate(table)}
    return ThroughputModel(A800, calibration), models


def test_task_below_its_minimum_gets_zero_waf() -> None:
    tm, (m,) = _table_model([[1.0, 2.0, 3.0, 4.0]])
    cost = CostModel(tm)
    task = PlanTask("t", m, weight=2.0, min_gpus=3)
    assert cost.waf(task, 2) == 0 and cost.waf(task, 3) == 6.0
    plan = solve(Problem((task,), 2, cost))
    assert plan.assignment == {"t": 0}


def test_transition_penalty_stops_needless_reconfiguration() -> None:
    # moving one GPU from a to b gains 0.5% WAF
    tm, (ma, mb) = _table_model([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.02, 4.0]])
    a = PlanTask("a", ma, current=2)
    b = PlanTask("b", mb, current=2)
    cheap = CostModel(tm, failure_rate=1e-3, d_transition=0.0)
    costly = CostModel(tm, failure_rate=1e-3, d_transition=600.0)
    assert solve(Problem((a, b), 4, cheap)).assignment == {"a": 1, "b": 3}
    assert solve(Problem((a, b), 4, costly)).assignment == {"a": 2, "b": 2}


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda m: PlanTask("t", m, weight=-1.0), "weight"),
        (lambda m: PlanTask("t", m, weight=0.0), "weight"),
        (lambda m: PlanTask("", m), "name"),
        (lambda m: PlanTask("t", m, current=-1), "current"),
    ],
)
def test_bad_tasks_are_clear_errors(build, match: str) -> None:
    with pytest.raises(PlannerError, match=match):
        build(MODELS["7B"])


def test_negative_gpus_is_a_clear_error() -> None:
    cost = CostModel(ThroughputModel(A800))
    with pytest.raises(PlannerError, match=r"n'=-1 GPUs"):
        Problem((PlanTask("t", MODELS["7B"]),), -1, cost)
    with pytest.raises(PlannerError, match=r"n'=-8 GPUs"):
        cost.d_running(-8)
    with pytest.raises(PlannerError, match=r"n'=-1 GPUs"):
        cost.rewards(PlanTask("t", MODELS["7B"]), -1)
    with pytest.raises(ValueError, match="failure_rate"):
        CostModel(ThroughputModel(A800), failure_rate=0)


def test_cost_model_with_no_gpu_up() -> None:
    """n' = 0: D_running is infinite, only size 0 is a candidate, G is minus the penalty (no NaN)."""
    cost = CostModel(ThroughputModel(A800), d_transition=60.0)
    running = PlanTask("run", MODELS["7B"], weight=2.0, current=8)
    idle = PlanTask("idle", MODELS["7B"])
    assert cost.d_running(0) == math.inf
    assert cost.running(0.0, 0) == 0.0
    penalty = cost.waf(running, 8) * 60.0
    assert penalty > 0
    for task, lost in ((running, penalty), (idle, 0.0)):
        sizes, gains = cost.rewards(task, 0)
        assert sizes.tolist() == [0] and gains.tolist() == [-lost]
        assert cost.reward(task, 0, 0) == -lost
    with pytest.raises(PlannerError, match=r"size 8 not in 0\.\.0"):
        cost.reward(running, 8, 0)


def test_no_gpu_up_gives_the_empty_plan() -> None:
    """Every node down: every task gets 0 GPUs; the objective is the transition penalty of stopping."""
    cost = CostModel(ThroughputModel(A800), d_transition=60.0)
    tasks = (
        PlanTask("a", MODELS["7B"], weight=2.0, current=16, faulted=True),
        PlanTask("b", MODELS["1.3B"], current=8),
        PlanTask("queued", MODELS["13B"]),
    )
    problem = Problem(tasks, 0, cost)
    expected = -60.0 * (cost.waf(tasks[0], 16) + cost.waf(tasks[1], 8))
    for solver in (solve, solve_plain):
        plan = solver(problem)
        assert plan.assignment == {"a": 0, "b": 0, "queued": 0}
        assert plan.gpus_used == 0
        assert plan.value == pytest.approx(expected, rel=1e-12)
    assert evaluate(problem, {"a": 0, "b": 0, "queued": 0}) == pytest.approx(expected, rel=1e-12)
    assert solve(Problem((), 0, cost)) == solve_plain(Problem((), 0, cost))
    assert solve(Problem((), 0, cost)).assignment == {}
    with pytest.raises(PlannerError, match="uses 1 GPUs but only 0"):
        evaluate(problem, {"a": 1, "b": 0, "queued": 0})


# -- solver vs brute force -------------------------------------------------------


def brute_force(problem: Problem) -> float:
    best = -float("inf")
    ranges = [range(problem.n + 1)] * len(problem.tasks)
    for sizes in itertools.product(*ranges):
        if sum(sizes) <= problem.n:
            best = max(best, evaluate(problem, {t.name: k for t, k in zip(problem.tasks, sizes)}))
    return best


@st.composite
def problems(draw):
    n = draw(st.integers(0, 9))
    m = draw(st.integers(1, 3))
    tables = [
        draw(st.lists(st.sampled_from([0.0, 1.0, 2.0, 3.5, 5.0, 8.0, 9.0]), min_size=n + 2, max_size=n + 2))
        for _ in range(m)
    ]
    tm, models = _table_model(tables)
    tasks = tuple(
        PlanTask(
            f"t{i}",
            models[i],
            weight=draw(st.sampled_from([0.5, 1.0, 1.7, 2.0])),
            min_gpus=draw(st.integers(0, 3)),
            current=draw(st.integers(0, n + 1)),
            faulted=draw(st.booleans()),
        )
        for i in range(m)
    )
    cost = CostModel(tm, failure_rate=draw(st.sampled_from([1e-3, 1e-2, 0.1])), d_transition=draw(st.sampled_from([0.0, 5.0, 50.0])))
    return Problem(tasks, n, cost)


@settings(max_examples=150, deadline=None)
@given(problems())
def test_solver_optimum_equals_brute_force(problem: Problem) -> None:
    plan = solve(problem)
    expected = brute_force(problem)
    assert plan.value == pytest.approx(expected, rel=1e-9, abs=1e-9)
    assert solve_plain(problem).value == pytest.approx(expected, rel=1e-9, abs=1e-9)
    assert evaluate(problem, plan.assignment) == pytest.approx(plan.value, rel=1e-9, abs=1e-9)
    assert plan.gpus_used <= problem.n
    assert all(k >= 0 for k in plan.assignment.values())


def test_evaluator_rejects_infeasible_assignments() -> None:
    tm, (m,) = _table_model([[1.0, 2.0]])
    problem = Problem((PlanTask("t", m),), 2, CostModel(tm))
    with pytest.raises(PlannerError, match="uses 3 GPUs"):
        evaluate(problem, {"t": 3})
    with pytest.raises(PlannerError, match="no entry"):
        evaluate(problem, {})


def test_fast_solver_equals_plain_dp_on_real_models() -> None:
    cost = CostModel(ThroughputModel(A800))
    tasks = tuple(PlanTask(f"t{i}", MODELS[name], weight=w) for i, (name, w) in enumerate(
        [("1.3B", 2.0), ("7B", 1.1), ("13B", 0.5), ("1.3B", 1.4)]))
    problem = Problem(tasks, 128, cost)
    fast, plain = solve(problem), solve_plain(problem)
    assert fast.value == pytest.approx(plain.value, rel=1e-12)
    assert evaluate(problem, fast.assignment) == pytest.approx(fast.value, rel=1e-12)


# -- one-step table --------------------------------------------------------------


def test_one_step_table_matches_direct_solves() -> None:
    cost = CostModel(ThroughputModel(A800))
    base = tuple(PlanTask(f"t{i}", MODELS[n]) for i, n in enumerate(["1.3B", "7B", "13B"]))
    plan = solve(Problem(base, 64, cost))
    tasks = tuple(replace(t, current=plan.assignment[t.name]) for t in base)
    queued = (PlanTask("new", MODELS["1.3B"], weight=2.0),)
    table = OneStepTable(Problem(tasks, 64, cost), gpus_per_node=8, queued=queued)
    victim = table.owners[0]
    faulted = tuple(replace(t, faulted=t.name in victim) for t in tasks)
    assert table.on_node_lost(0) == solve(Problem(faulted, 56, cost))
    assert table.lookup(Event("node_joined")) == solve(Problem(tasks, 72, cost))
    rest = tasks[1:]
    assert table.lookup(Event("task_finished", frozenset({"t0"}))) == solve(Problem(rest, 64, cost))
    launched = table.lookup(Event("task_launched", frozenset({"new"})))
    assert launched == solve(Problem((*tasks, queued[0]), 64, cost))
    with pytest.raises(PlannerError):
        OneStepTable(Problem(tasks, 64, cost), gpus_per_node=0)


def _small_table(n: int = 64, used: tuple[int, ...] = (16, 24, 8)) -> OneStepTable:
    """A table with nodes of 8 GPUs, tasks holding ``used`` GPUs; the rest of the n GPUs idle."""
    cost = CostModel(ThroughputModel(A800))
    names = ["1.3B", "7B", "1.3B", "13B"]
    tasks = tuple(PlanTask(f"t{i}", MODELS[names[i]], current=x) for i, x in enumerate(used))
    return OneStepTable(Problem(tasks, n, cost), gpus_per_node=8)


_table = functools.cache(_small_table)  # hypothesis runs the property many times on one table


def _loss_plan(table: OneStepTable, victims: frozenset[str]) -> Plan:
    faulted = tuple(replace(t, faulted=t.name in victims) for t in table.problem.tasks)
    return solve(Problem(faulted, table.problem.n - table.gpus_per_node, table.problem.cost))


def test_one_step_table_numbers_every_node_idle_ones_included() -> None:
    table = _table()
    assert table.nodes == 8 and len(table.owners) == 8
    assert table.owners[:6] == [frozenset({"t0"})] * 2 + [frozenset({"t1"})] * 3 + [frozenset({"t2"})]
    assert table.owners[6:] == [frozenset()] * 2  # 48 of 64 GPUs used: nodes 6 and 7 are idle
    assert table.on_node_lost(7) == _loss_plan(table, frozenset())
    assert table.on_node_lost(2) == _loss_plan(table, frozenset({"t1"}))


@settings(max_examples=200, deadline=None)
@given(st.integers(-(2**70), 2**70) | st.integers(-20, 20))
def test_on_node_lost_answers_exactly_the_cluster_s_nodes(node: int) -> None:
    table = _table()
    if 0 <= node < table.nodes:
        assert table.on_node_lost(node) == _loss_plan(table, table.owners[node])
    else:
        with pytest.raises(UnknownNodeError, match=rf"node {node} is not a node of this cluster \(valid: 0\.\.7\)"):
            table.on_node_lost(node)


@pytest.mark.parametrize("node", [True, 1.0, "0", None])
def test_on_node_lost_refuses_what_is_not_a_node_number(node) -> None:
    with pytest.raises(UnknownNodeError, match="valid: 0..7") as info:
        _table().on_node_lost(node)
    assert isinstance(info.value, PlannerError)  # typed, and a ValueError like every planner refusal


def test_losing_the_last_node_gives_the_empty_plan() -> None:
    table = _small_table(n=8, used=(8,))
    plan = table.on_node_lost(0)
    assert plan.assignment == {"t0": 0} and plan.gpus_used == 0
    assert plan == _loss_plan(table, frozenset({"t0"}))
    assert table.lookup(Event("node_lost", frozenset({"t0"}))) == plan
    with pytest.raises(UnknownNodeError, match="valid: 0..0"):
        table.on_node_lost(1)


def test_a_table_of_a_cluster_with_no_gpu_up() -> None:
    table = _small_table(n=0, used=(0, 0))
    with pytest.raises(UnknownNodeError, match="the cluster has no node"):
        table.on_node_lost(0)
    joined = table.lookup(Event("node_joined"))
    assert joined == solve(Problem(table.problem.tasks, 8, table.problem.cost)) and joined.gpus_used > 0
    assert table.lookup(Event("task_finished", frozenset({"t0"}))).assignment == {"t1": 0}


def test_one_step_table_refuses_an_inconsistent_cluster() -> None:
    with pytest.raises(PlannerError, match="n=60 GPUs is not a whole number of nodes of 8"):
        _small_table(n=60)
    with pytest.raises(PlannerError, match="the tasks hold 48 GPUs but the cluster has n=40"):
        _small_table(n=40)


def test_lookup_of_an_event_not_in_the_table_names_it() -> None:
    with pytest.raises(KeyError, match="no precomputed plan for .*task_finished.*nope"):
        _table().lookup(Event("task_finished", frozenset({"nope"})))
