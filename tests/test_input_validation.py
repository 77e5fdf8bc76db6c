"""Hostile numbers and files (issue #9 items 6 and 13): one clear error, never a hang or a traceback.

Non-finite, non-positive and absurdly large values of every timeout, cluster
size, trace and calibration input are refused with a message naming the key;
the CLI prints one line and exits 2.
"""

from __future__ import annotations

import json
import math
import re

import pytest

from unicron_elastic.api import MAX_TIMEOUT_S, ConfigError, EtcdConfig, finite_positive
from unicron_elastic.cli import main
from unicron_elastic.planner import CostModel, PlanTask, Problem, ThroughputModel, gpu_type, model
from unicron_elastic.planner.solver import MAX_GPUS
from unicron_elastic.rendezvous import parse_options
from unicron_elastic.sim import load_trace
from unicron_elastic.sim.trace import MAX_TRACE_S
from unicron_elastic.testing import FAULTS_ENV, maybe_fail

BAD_NUMBERS = ["nan", "inf", "-inf", "0", "-1", "1e20", "abc", ""]


def _cli_error(capsys, *argv: str) -> str:
    """Run ``unicron ARGV`` in-process; assert exit 2 and one clear error line; return that line.

    argparse's own refusals print the usage first, then ``unicron SUBCOMMAND: error: ...``.
    """
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert re.match(r"unicron( \w+)?: error: ", last), err
    return last


# -- the validator ------------------------------------------------------------------


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 0, -1.0, MAX_TIMEOUT_S * 2, "x", None, 10**400],
                         ids=["nan", "inf", "-inf", "zero", "negative", "too_big", "text", "none", "huge_int"])
def test_finite_positive_refuses_and_names_the_key(value) -> None:
    with pytest.raises(ConfigError, match="my_key"):
        finite_positive("my_key", value)


def test_finite_positive_accepts_the_range() -> None:
    assert finite_positive("k", "2.5") == 2.5
    assert finite_positive("k", MAX_TIMEOUT_S) == MAX_TIMEOUT_S
    assert finite_positive("k", 0, allow_zero=True) == 0.0
    assert finite_positive("k", "7", integer=True) == 7
    with pytest.raises(ConfigError, match="integer"):
        finite_positive("k", "7.5", integer=True)


# -- etcd config and --rdzv-conf -----------------------------------------------------


@pytest.mark.parametrize("key", ["request_timeout", "reconnect_timeout"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e20])
def test_etcd_config_refuses_non_finite_and_absurd_timeouts(key: str, value: float) -> None:
    with pytest.raises(ConfigError, match=key):
        EtcdConfig(**{key: value})


def test_etcd_config_bad_port_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="port"):
        EtcdConfig(port="http")  # type: ignore[arg-type]


NUMERIC_KEYS = ["request_timeout", "reconnect_timeout", "store_timeout", "join_timeout", "last_call_timeout",
                "close_timeout", "heartbeat_timeout", "keep_alive_interval", "keep_alive_max_attempt", "timeout"]


@pytest.mark.parametrize("key", NUMERIC_KEYS)
@pytest.mark.parametrize("raw", [*BAD_NUMBERS, "100000000000000000000"])
def test_rdzv_conf_refuses_bad_numbers_naming_the_key(key: str, raw: str) -> None:
    with pytest.raises(ConfigError, match=f"--rdzv-conf {key}="):
        parse_options("127.0.0.1:2379", "job", {key: raw})


@pytest.mark.timeout(60)
def test_rdzv_conf_accepts_every_timeout_at_its_maximum(etcd_config: EtcdConfig) -> None:
    """The documented maxima work end to end: nothing overflows, a rendezvous completes, etcd answers."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from unicron_elastic.rendezvous import create_handler

    year = str(int(MAX_TIMEOUT_S))
    conf = {key: year for key in NUMERIC_KEYS if key != "keep_alive_max_attempt"}
    params = RendezvousParameters(backend="unicron", endpoint=f"{etcd_config.host}:{etcd_config.port}", run_id="job",
                                  min_nodes=1, max_nodes=1, cluster=etcd_config.cluster,
                                  keep_alive_max_attempt="1000", **conf)
    handler = create_handler(params)
    info = handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    info.store.set("k", b"v")
    assert info.store.get("k") == b"v"
    store = handler.status_store
    store.put_json(store.keys.node("probe"), {"ok": 1})
    assert store.get_json(store.keys.node("probe")) == {"ok": 1}
    handler.shutdown()


# -- unicron status --timeout ---------------------------------------------------------


@pytest.mark.parametrize("raw", ["nan", "inf", "0", "-5", "1e20"])
def test_status_timeout_refuses_bad_numbers(capsys, raw: str) -> None:
    err = _cli_error(capsys, "status", "--endpoint", "127.0.0.1:1", "--timeout", raw)
    assert "argument --timeout" in err


# -- planner inputs ------------------------------------------------------------------


@pytest.mark.parametrize("flops", ["inf", "nan", "-1", "1e300"])
@pytest.mark.parametrize("suffix", [".csv", ".json"])
def test_calibration_refuses_non_finite_flops(tmp_path, flops: str, suffix: str) -> None:
    path = tmp_path / f"cal{suffix}"
    if suffix == ".csv":
        path.write_text(f"model,gpus,flops\n7B,8,{flops}\n")
    else:
        path.write_text(json.dumps([{"model": "7B", "gpus": 8, "flops": float(flops)}]))
    with pytest.raises(ConfigError, match=rf"calibration file .*flops"):
        ThroughputModel.load_calibration(path)


@pytest.mark.parametrize(
    "content",
    ["[" * 100_000 + "]" * 100_000, '{"model": "7B"}', "5",
     '[{"model": "7B", "gpus": 100000000000000000000, "flops": 1}]'],
    ids=["nested", "object", "number", "huge_gpus"],
)
def test_calibration_refuses_nested_and_wrong_json(tmp_path, content: str) -> None:
    path = tmp_path / "cal.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match="calibration file"):
        ThroughputModel.load_calibration(path)


def test_calibration_zero_flops_still_marks_a_size_infeasible(tmp_path) -> None:
    path = tmp_path / "cal.csv"
    path.write_text("model,gpus,flops\n7B,8,0\n")
    assert ThroughputModel.load_calibration(path) == {("7B", 8): 0.0}


@pytest.mark.parametrize("field", ["d_transition", "failure_rate"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_cost_model_refuses_non_finite(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=field):
        CostModel(ThroughputModel(gpu_type("A800-80GB")), **{field: value})


@pytest.mark.parametrize("weight", [math.inf, math.nan, 1e300])
def test_task_weight_must_be_finite(weight: float) -> None:
    with pytest.raises(ConfigError, match="weight"):
        PlanTask("t", model("7B"), weight=weight)


def test_problem_refuses_more_than_max_gpus() -> None:
    cost = CostModel(ThroughputModel(gpu_type("A800-80GB")))
    with pytest.raises(ConfigError, match=f"at most {MAX_GPUS}"):
        Problem((PlanTask("t", model("7B")),), MAX_GPUS + 1, cost)


# -- unicron simulate ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "raw"),
    [("--d-transition", "nan"), ("--d-transition", "inf"), ("--d-transition", "-1"), ("--d-transition", "1e20"),
     ("--gpus", "0"), ("--gpus", "-3"), ("--gpus", str(MAX_GPUS + 1)), ("--gpus", "10000000000000")],
)
def test_simulate_refuses_bad_numbers(capsys, flag: str, raw: str) -> None:
    err = _cli_error(capsys, "simulate", "multitask", flag, raw)
    assert f"argument {flag}" in err


def test_simulate_with_bad_calibration_is_one_clear_line(capsys, tmp_path) -> None:
    path = tmp_path / "cal.csv"
    path.write_text("model,gpus,flops\n7B,8,inf\n")
    err = _cli_error(capsys, "simulate", "multitask", "--calibration", str(path))
    assert f"calibration file {path}" in err


def _json_trace(**overrides) -> str:
    doc = {"nodes": 2, "gpus_per_node": 8, "duration_s": 86400.0,
           "events": [{"time_s": 100.0, "kind": "sev1", "node": 1, "repair_s": 3600.0}]}
    doc.update(overrides)
    return json.dumps(doc)


def _event(**overrides) -> list[dict]:
    return [{"time_s": 100.0, "kind": "sev1", "node": 1, "repair_s": 3600.0, **overrides}]


BAD_TRACES = {
    "nested": '{"events": ' + "[" * 100_000 + "]" * 100_000 + "}",
    "not_an_object": "[1, 2]",
    "events_not_list": _json_trace(events=5),
    "events_dict": _json_trace(events={"a": 1}),
    "event_not_object": _json_trace(events=[7]),
    "duration_huge": _json_trace(duration_s=1e300),
    "duration_inf": '{"nodes": 2, "duration_s": Infinity, "events": []}',
    "duration_nan": '{"nodes": 2, "duration_s": NaN, "events": []}',
    "nodes_huge": _json_trace(nodes=10**12),
    "nodes_float": _json_trace(nodes=2.5),
    "nodes_bool": _json_trace(nodes=True),
    "nodes_string": _json_trace(nodes="many"),
    "gpus_per_node_huge": _json_trace(gpus_per_node=10**7),
    "time_nan": '{"nodes": 2, "events": [{"time_s": NaN, "kind": "sev2", "node": 0}]}',
    "repair_inf": _json_trace(events=_event(repair_s="inf")),
    "repair_huge": _json_trace(events=_event(repair_s=1e300)),
    "node_huge": _json_trace(events=_event(node=10**30)),
    "kind_list": _json_trace(events=_event(kind=["sev1"])),
}


@pytest.mark.parametrize("name", sorted(BAD_TRACES))
def test_simulate_refuses_bad_json_traces(capsys, tmp_path, name: str) -> None:
    path = tmp_path / f"{name}.json"
    path.write_text(BAD_TRACES[name])
    err = _cli_error(capsys, "simulate", str(path), "--policies", "megatron")
    assert f"trace file {path}: " in err


@pytest.mark.parametrize(
    "rows",
    ["0,sev1,0,inf", "0,sev1,0,1e300", "nan,sev2,0,", "inf,sev2,0,", "1e300,sev2,0,", "0,sev2,100000000000000000000,"],
)
def test_simulate_refuses_bad_csv_traces(capsys, tmp_path, rows: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("time_s,kind,node,repair_s\n" + rows + "\n")
    err = _cli_error(capsys, "simulate", str(path), "--policies", "megatron")
    assert f"trace file {path}: " in err


def test_simulate_accepts_the_largest_cluster_quickly(capsys) -> None:
    assert main(["simulate", "multitask", "--gpus", str(MAX_GPUS)]) == 0
    assert f"on {MAX_GPUS} x" in capsys.readouterr().out


def test_trace_limits_are_generous_enough_for_real_traces(tmp_path) -> None:
    path = tmp_path / "big.json"
    path.write_text(_json_trace(nodes=MAX_GPUS // 8, duration_s=MAX_TRACE_S))
    trace = load_trace(path)
    assert trace.gpus == MAX_GPUS and trace.duration_s == MAX_TRACE_S


def test_simulate_report_has_no_nan(capsys, tmp_path) -> None:
    """A valid, long trace gives finite verdicts (no 'nanx')."""
    path = tmp_path / "long.json"
    path.write_text(_json_trace(duration_s=MAX_TRACE_S))
    assert main(["simulate", str(path), "--policies", "megatron"]) == 0
    out = capsys.readouterr().out
    assert "nan" not in out and "inf" not in out


# -- UNICRON_FAULTS ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    ["{not json", '{"rank": 1, "step": 2}', "[5]", '[{"rnak": 1, "step": 2}]',
     '[{"rank": 1, "step": 2, "kind": "boom"}]', "[" * 100_000 + "]" * 100_000],
    ids=["not_json", "not_a_list", "not_an_object", "unknown_key", "bad_kind", "nested"],
)
def test_bad_unicron_faults_names_the_variable(monkeypatch, raw: str) -> None:
    monkeypatch.setenv(FAULTS_ENV, raw)
    with pytest.raises(ValueError, match=f"^{FAULTS_ENV}: "):
        maybe_fail(0, 1)


@pytest.mark.parametrize(("raw", "match"), [("many", "UNICRON_MAX_WORLD='many' is not an integer"),
                                            ("3", "UNICRON_MAX_WORLD=3 is below WORLD_SIZE=4")])
def test_bad_unicron_max_world_names_the_variable(monkeypatch, raw: str, match: str) -> None:
    from unicron_elastic.strategy.lightning.environment import UnicronEnvironment

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("UNICRON_MAX_WORLD", raw)
    with pytest.raises(ConfigError, match=re.escape(match)):
        UnicronEnvironment().max_world_size


def test_ranks_past_a_round_follow_its_own_and_stay_below_max_world() -> None:
    from unicron_elastic.rendezvous.api import max_world, ranks_past_round

    for nodes, world, most, nproc in [(1, 2, 2, 2), (2, 5, 4, 3), (3, 3, 3, 1)]:
        grown = [r for place in range(nodes, most) for r in ranks_past_round(nodes, world, place, nproc)]
        assert grown == list(range(world, max_world(nodes, world, most, nproc)))  # disjoint, in order, bounded
    with pytest.raises(ValueError, match="one of the round's"):
        ranks_past_round(2, 4, 1, 2)
