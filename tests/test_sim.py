"""Simulator: traces, policies, the multi-task table, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from unicron_elastic.api import ConfigError
from unicron_elastic.planner import GPU_TYPES, CostModel, ThroughputModel
from unicron_elastic.sim import (
    CASES,
    POLICIES,
    Failure,
    Trace,
    case_tasks,
    compare,
    load_trace,
    save_trace,
    simulate,
    trace_a,
    trace_b,
)
from unicron_elastic.sim.engine import MINUTE, policy
from unicron_elastic.sim.trace import DAY, WEEK


def cost_for(trace: Trace) -> CostModel:
    return CostModel(ThroughputModel(GPU_TYPES["A800-80GB"]), failure_rate=trace.failure_rate(), d_transition=60.0)


# -- traces ----------------------------------------------------------------------


def test_trace_a_matches_the_paper_and_is_reproducible() -> None:
    a = trace_a(seed=3)
    assert a.counts()["sev1"] == 10 and a.counts()["sev2"] + a.counts()["sev3"] == 33
    assert (a.gpus, a.duration_s) == (128, 8 * WEEK)
    assert all(1 * DAY <= e.repair_s <= 7 * DAY for e in a.events if e.kind == "sev1")
    assert trace_a(seed=3) == a and trace_a(seed=4) != a


def test_trace_never_fails_a_node_that_is_down() -> None:
    for trace in (trace_a(seed=1), trace_b(seed=1)):
        down_until = {}
        for e in trace.events:
            assert down_until.get(e.node, 0.0) <= e.time_s, e
            if e.kind == "sev1":
                down_until[e.node] = e.time_s + e.repair_s


def test_trace_b_is_twenty_times_denser() -> None:
    counts = [trace_b(seed=s).counts() for s in range(5)]
    sev1 = sum(c["sev1"] for c in counts) / 5
    other = sum(c["sev2"] + c["sev3"] for c in counts) / 5
    assert 15 <= sev1 <= 35 and 60 <= other <= 105  # expected 25 and 82.5 per week
    assert trace_b(seed=0).duration_s == WEEK


@pytest.mark.parametrize("suffix", [".csv", ".json"])
def test_trace_files_round_trip(tmp_path, suffix: str) -> None:
    trace = trace_a(seed=2)
    path = tmp_path / f"t{suffix}"
    save_trace(trace, path)
    loaded = load_trace(path)
    assert loaded.events == trace.events
    if suffix == ".json":
        assert loaded.duration_s == trace.duration_s


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("time_s,kind,node,repair_s\n10,sev9,0,\n", "kind 'sev9'"),
        ("time_s,kind,node,repair_s\n10,sev2,99,\n", "node 99"),
        ("time_s,kind,node,repair_s\n10,sev1,0,\n", "needs repair_s"),
        ("time_s,kind\n10,sev2\n", "row 2"),
        ("time_s,kind,node,repair_s\nabc,sev2,0,\n", "row 2"),
    ],
)
def test_malformed_trace_files_are_clear_errors(tmp_path, content: str, match: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(content)
    with pytest.raises(ConfigError, match=match):
        load_trace(path)


def test_missing_trace_file_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="nope.csv"):
        load_trace(tmp_path / "nope.csv")


# -- policies ----------------------------------------------------------------------


def _one_failure(kind: str, repair: float | None = None) -> Trace:
    return Trace("one", 16, 8, 10 * DAY, (Failure(1 * DAY, kind, 0, repair),))


def _task_on_node0(trace: Trace) -> tuple[str, float]:
    from unicron_elastic.planner import Problem, solve

    tasks = case_tasks(5)
    plan = solve(Problem(tasks, trace.gpus, cost_for(trace)))
    name = next(n for n, k in plan.assignment.items() if k > 0)  # packed first: it holds node 0
    task = next(t for t in tasks if t.name == name)
    return name, cost_for(trace).waf(task, plan.assignment[name])


@pytest.mark.parametrize("kind", ["sev2", "sev3"])
def test_transient_failure_costs_exactly_detection_plus_transition(kind: str) -> None:
    trace = _one_failure(kind)
    empty = replace(trace, events=())
    _, lost_waf = _task_on_node0(trace)
    for name in ("unicron", "megatron"):
        pol = policy(name)
        loss = simulate(empty, case_tasks(5), cost_for(trace), pol).total - simulate(trace, case_tasks(5), cost_for(trace), pol).total
        expected = lost_waf * pol.efficiency * (pol.detect[kind] + pol.transition[kind])
        assert loss == pytest.approx(expected, rel=1e-9), name
    assert policy("megatron").detect[kind] + policy("megatron").transition[kind] == 68 * MINUTE  # section 1


def test_megatron_waits_for_the_repair_unicron_replans() -> None:
    trace = _one_failure("sev1", repair=3 * DAY)
    name, waf = _task_on_node0(trace)
    mega = simulate(trace, case_tasks(5), cost_for(trace), POLICIES["megatron"])
    uni = simulate(trace, case_tasks(5), cost_for(trace), POLICIES["unicron"])
    empty = simulate(replace(trace, events=()), case_tasks(5), cost_for(trace), POLICIES["megatron"]).total
    # Megatron: the task is gone from the failure to repair + 38 min
    assert empty - mega.total == pytest.approx(waf * (3 * DAY + 38 * MINUTE), rel=1e-9)
    assert uni.total > mega.total
    assert min(uni.gpus) == 120 and uni.gpus[-1] == 128


def _whole_cluster_outage() -> Trace:
    """2 nodes x 8 GPUs for a day: both fail at 1 h; node 0 is back at 2 h, node 1 at 3 h."""
    events = (Failure(3600.0, "sev1", 0, 3600.0), Failure(3600.0, "sev1", 1, 7200.0))
    return Trace("outage", 2, 8, DAY, events)


@pytest.mark.parametrize("key", sorted(POLICIES))
def test_every_node_down_means_no_waf_until_a_repair(key: str) -> None:
    trace = _whole_cluster_outage()
    cost = cost_for(trace)
    result = simulate(trace, case_tasks(5), cost, POLICIES[key])
    calm = simulate(replace(trace, events=()), case_tasks(5), cost, POLICIES[key])
    at = dict(zip(result.times, zip(result.waf, result.gpus)))
    assert at[0.0] == (calm.waf[0], 16) and calm.waf[0] > 0
    outage = [(w, g) for t, w, g in zip(result.times, result.waf, result.gpus) if 3600.0 <= t < 7200.0]
    assert outage and all(w == 0 and g == 0 for w, g in outage)
    assert at[7200.0][1] == 8 and result.gpus[-1] == 16
    assert result.waf[-1] == pytest.approx(calm.waf[0], rel=1e-12)  # re-planned onto the repaired nodes
    assert 0 < result.total < calm.total - calm.waf[0] * 3600.0 + 1e-6 * calm.total


def test_unicron_replans_onto_the_first_repaired_node() -> None:
    trace = _whole_cluster_outage()
    result = simulate(trace, case_tasks(5), cost_for(trace), POLICIES["unicron"])
    half = [w for t, w, g in zip(result.times, result.waf, result.gpus) if 7200.0 <= t < 10800.0 and g == 8]
    assert half and max(half) > 0  # trains on 8 GPUs before node 1 is back


def test_no_failures_means_constant_waf() -> None:
    trace = Trace("calm", 16, 8, 2 * DAY, ())
    for key, pol in POLICIES.items():
        result = simulate(trace, case_tasks(5), cost_for(trace), pol)
        assert len(set(result.waf)) == 1 and result.total == pytest.approx(result.waf[0] * 2 * DAY), key


@pytest.mark.parametrize("make", [trace_a, trace_b])
def test_unicron_beats_every_policy_on_the_paper_traces(make) -> None:
    trace = make(seed=0)
    totals = {k: simulate(trace, case_tasks(5), cost_for(trace), p).total for k, p in POLICIES.items()}
    assert all(totals["unicron"] >= v for v in totals.values())
    assert totals["megatron"] > totals["oobleck"] > totals["bamboo"] > totals["varuna"]


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="unknown policy 'slurm'"):
        policy("slurm")


# -- multi-task --------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_unicron_plan_at_least_every_baseline(case: int) -> None:
    cost = CostModel(ThroughputModel(GPU_TYPES["A800-80GB"]))
    result = compare(case, case_tasks(case), 128, cost)
    for kind, waf in result.baselines.items():
        assert result.unicron >= waf, kind
        assert sum(result.allocations[kind].values()) <= 128


def test_unknown_case_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="case 9"):
        case_tasks(9)


# -- CLI ---------------------------------------------------------------------------


def _unicron(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "unicron_elastic.cli", *args], capture_output=True, text=True, timeout=120)


def test_cli_regenerates_trace_results_with_plots(tmp_path) -> None:
    result = _unicron("simulate", "trace-b", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "| Megatron |" in result.stdout and "1.9x" in result.stdout
    doc = json.loads((tmp_path / "trace-b.json").read_text())
    assert doc["ratio_unicron_over"]["megatron"] > 1.0
    assert (tmp_path / "trace-b.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_multitask_table() -> None:
    result = _unicron("simulate", "multitask")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("| yes |") == 5


def test_cli_simulates_a_whole_cluster_outage(tmp_path) -> None:
    """Every node down at once, then repaired: an empty plan while none is up, not an error."""
    trace = _whole_cluster_outage()
    path = tmp_path / "outage.json"
    save_trace(trace, path)
    result = _unicron("simulate", str(path), "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert "n'=0" not in result.stderr and "Traceback" not in result.stderr
    assert "outage: 16 GPUs, 1 days, failures {'sev1': 2, 'sev2': 0, 'sev3': 0}" in result.stdout
    for name in ("Unicron", "Megatron", "Oobleck", "Bamboo", "Varuna"):
        assert f"| {name} |" in result.stdout
    assert "nan" not in result.stdout and "inf" not in result.stdout
    doc = json.loads((tmp_path / "out" / "outage.json").read_text())
    cost = cost_for(trace)
    expected = simulate(trace, case_tasks(5), cost, POLICIES["unicron"]).total
    calm = simulate(replace(trace, events=()), case_tasks(5), cost, POLICIES["unicron"]).total
    assert doc["accumulated_waf"]["unicron"] == pytest.approx(expected, rel=1e-12)
    assert 0 < doc["accumulated_waf"]["unicron"] < calm
    assert all(r is not None and r >= 1.0 for r in doc["ratio_unicron_over"].values())


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("simulate", "missing.csv"), "trace file missing.csv"),
        (("simulate", "multitask", "--gpus", "0"), "argument --gpus: '0' must be > 0"),
        (("simulate", "multitask", "--gpu", "TPU"), "unknown GPU type 'TPU'"),
        (("simulate", "trace-a", "--policies", "slurm"), "unknown policy 'slurm'"),
        (("simulate", "trace-a", "--case", "7"), "case 7"),
    ],
)
def test_cli_bad_input_is_one_clear_line(args, match: str) -> None:
    result = _unicron(*args)
    assert result.returncode == 2
    assert match in result.stderr and "Traceback" not in result.stderr


def test_cli_status_with_unreachable_etcd_is_one_clear_line() -> None:
    from unicron_elastic.store import free_port

    result = _unicron("status", "--endpoint", f"127.0.0.1:{free_port()}", "--timeout", "1")
    assert result.returncode == 2
    assert "unreachable for 1.0s" in result.stderr and "Traceback" not in result.stderr
