"""Partial-iteration resumption with real killed processes on gloo (paper section 6).

The test process hosts the TCPStore, as the agent does; worker processes train a
tiny MLP with ElasticDataParallel; one is SIGKILLed at a chosen micro-batch or
gradient bucket. The survivors must finish with the parameters of a failure-free
run, every micro-batch of every step counted exactly once.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import EXAMPLES
from unicron_elastic.testing import Fault, fail_at, faults_env, run_workers

WORKER = os.path.join(EXAMPLES, "elastic_dp_worker.py")
WORLD, STEPS, B = 3, 3, 6  # 24 samples per step in micro-batches of 4
NUMEL = 8 * 16 + 16 + 16 + 1  # 161 parameters -> 3 buckets of 64


def train(out: Path, faults: list[Fault], bucket_numel: int | None = None, steps: int = STEPS) -> list[subprocess.CompletedProcess]:
    extra = ["--bucket-numel", str(bucket_numel)] if bucket_numel else []
    return run_workers(WORKER, WORLD, ["--steps", str(steps), "--out", str(out), *extra],
                       faults_env(faults, str(out / "faults.log")), timeout=90)


@pytest.fixture(scope="session")
def baseline(failure_free) -> list[torch.Tensor]:
    def reference_run(out: Path) -> list[torch.Tensor]:
        results = train(out, [])
        assert [r.returncode for r in results] == [0] * WORLD, results[0].stderr[-2000:]
        params = [torch.load(out / f"params{r}.pt") for r in range(WORLD)]
        for other in params[1:]:  # replicas agree
            assert all(torch.equal(a, b) for a, b in zip(params[0], other))
        return params[0]

    return failure_free("test_elastic_dp.baseline", reference_run)


def _check(out: Path, results, victim: int, baseline: list[torch.Tensor], recomputed: bool = True) -> list[dict]:
    fired = (out / "faults.log").read_text().splitlines()
    assert len(fired) == 1, "the fault did not fire"
    assert results[victim].returncode == -9
    survivors = [r for r in range(WORLD) if r != victim]
    for r in survivors:
        assert results[r].returncode == 0, results[r].stderr[-3000:]
        params = torch.load(out / f"params{r}.pt")
        for ours, reference in zip(params, baseline):
            torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    reports = {r: json.loads((out / f"rank{r}.json").read_text()) for r in survivors}
    failed_step = json.loads(fired[0])["step"]
    recovery = [reports[r][failed_step] for r in survivors]
    assert all(rep["recoveries"] == 1 and rep["dead"] == [victim] for rep in recovery)
    if recomputed:
        # scenario 1: the survivors' micro-batches now cover the whole global batch exactly once
        counted = sorted(j for rep in recovery for j in rep["micro_batches"])
        assert counted == list(range(B))
    for step, rep in enumerate(reports[survivors[0]]):
        if step > failed_step:
            assert rep["recoveries"] == 0  # the smaller group goes on normally
    return recovery


@pytest.mark.timeout(120)
@pytest.mark.parametrize("micro_batch", [0, pytest.param(1, marks=pytest.mark.matrix)])
def test_failure_at_each_micro_batch_scenario_1(tmp_path: Path, baseline, micro_batch: int) -> None:
    # rank 2 owns micro-batches 2 and 5 of each step (round-robin over 3 ranks)
    j = [2, 5][micro_batch]
    results = train(tmp_path, [fail_at(rank=2, step=1, micro_batch=j)])
    _check(tmp_path, results, 2, baseline)


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_failure_before_the_first_step(tmp_path: Path, baseline) -> None:
    results = train(tmp_path, [fail_at(rank=1, step=0, micro_batch=1)])
    _check(tmp_path, results, 1, baseline)


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_failure_after_the_optimizer_step(tmp_path: Path, baseline) -> None:
    # dies right after finishing step 1: the first micro-batch of step 2
    results = train(tmp_path, [fail_at(rank=0, step=2, micro_batch=0)])
    _check(tmp_path, results, 0, baseline)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bucket", [pytest.param(0, marks=pytest.mark.matrix), 1,
                                    pytest.param(2, marks=pytest.mark.matrix)])
def test_failure_during_each_gradient_bucket_scenario_2(tmp_path: Path, baseline, bucket: int) -> None:
    results = train(tmp_path, [fail_at(rank=1, step=1, bucket=bucket)], bucket_numel=64)
    recovery = _check(tmp_path, results, 1, baseline, recomputed=True)
    # The victim died right before it started bucket `bucket`: no later bucket completed. The ones it started
    # before (from backward, or together when its reduction began) may have completed, and are then kept.
    kept = {rep["kept_buckets"] for rep in recovery}
    assert len(kept) == 1 and kept.pop() <= bucket, recovery


@pytest.mark.timeout(120)
def test_a_rank_killed_in_backward_while_a_bucket_is_in_flight(tmp_path: Path, baseline) -> None:
    """Rank 1 dies in its last micro-batch's backward right after bucket 0's all-reduce started from it."""
    results = train(tmp_path, [fail_at(rank=1, step=1, at="backward")], bucket_numel=64)
    recovery = _check(tmp_path, results, 1, baseline, recomputed=True)
    assert len({rep["kept_buckets"] for rep in recovery}) == 1, recovery


# -- reconfiguration with a constant global batch ------------------------------


def train_schedule(out: Path, world: int, steps: int, members: list[int], member_schedule: dict[int, list[int]]):
    args = ["--steps", str(steps), "--out", str(out), "--members", ",".join(map(str, members)),
            "--member-schedule", json.dumps({str(k): v for k, v in member_schedule.items()})]
    return [(r.returncode, r.stderr[-2000:]) for r in run_workers(WORKER, world, args, timeout=90)]


@pytest.fixture(scope="session")
def baseline4(failure_free) -> list[torch.Tensor]:
    def reference_run(out: Path) -> list[torch.Tensor]:
        codes = train_schedule(out, 4, 5, [0, 1, 2, 3], {})
        assert [c for c, _ in codes] == [0] * 4, codes
        return torch.load(out / "params0.pt")

    return failure_free("test_elastic_dp.baseline4", reference_run)


def _same(out: Path, rank: int, reference: list[torch.Tensor]) -> None:
    for ours, ref in zip(torch.load(out / f"params{rank}.pt"), reference):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.e2e
@pytest.mark.timeout(150)
def test_scale_in_4_3_2_keeps_the_trajectory(tmp_path: Path, baseline4) -> None:
    codes = train_schedule(tmp_path, 4, 5, [0, 1, 2, 3], {2: [0, 1, 2], 4: [0, 1]})
    assert [c for c, _ in codes] == [0] * 4, codes
    assert json.loads((tmp_path / "rank3.json").read_text())[-1] == {"retired_at": 2}
    assert json.loads((tmp_path / "rank2.json").read_text())[-1] == {"retired_at": 4}
    for rank in (0, 1):
        _same(tmp_path, rank, baseline4)
    last = json.loads((tmp_path / "rank0.json").read_text())[-1]
    assert len(last["micro_batches"]) == 3  # B = 6 over 2 ranks: global batch unchanged


@pytest.mark.e2e
@pytest.mark.timeout(150)
def test_scale_out_2_to_4_with_state_from_a_replica(tmp_path: Path, baseline4) -> None:
    codes = train_schedule(tmp_path, 4, 5, [0, 1], {2: [0, 1, 2, 3]})
    assert [c for c, _ in codes] == [0] * 4, codes
    for rank in range(4):
        _same(tmp_path, rank, baseline4)  # joiners got parameters and momentum from the replica
    joined = json.loads((tmp_path / "rank3.json").read_text())
    assert [r["step"] for r in joined] == [2, 3, 4]


# -- under unicron-run: the agent restarts the dead rank, which rejoins ---------


def _reference(tmp_path: Path, steps: int) -> list[torch.Tensor]:
    """Parameters of a failure-free run of ``steps`` (rank 0's)."""
    reference = tmp_path / "reference"
    assert [r.returncode for r in train(reference, [], steps=steps)] == [0] * WORLD
    return torch.load(reference / "params0.pt")


def _unicron_run(tmp_path: Path, faults: list[Fault], steps: int, step_time: float, timeout: float,
                 *extra: str) -> subprocess.CompletedProcess:
    """The example worker under ``unicron-run --standalone`` with ``faults`` (logged to tmp_path/faults.log)."""
    from conftest import BIN

    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=BIN + os.pathsep + os.environ["PATH"])
    env.update(faults_env(faults, str(tmp_path / "faults.log")))
    cmd = [os.path.join(BIN, "unicron-run"), "--standalone", f"--nproc-per-node={WORLD}", "--log-format=json",
           "--monitor-interval=0.05", WORKER, "--steps", str(steps), "--step-time", str(step_time),
           "--out", str(tmp_path), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.e2e
@pytest.mark.timeout(200)
def test_killed_rank_is_restarted_by_the_agent_and_rejoins_from_a_replica(tmp_path: Path) -> None:
    steps = 12
    baseline = _reference(tmp_path, steps)
    log = tmp_path / "faults.log"
    result = _unicron_run(tmp_path, [fail_at(rank=2, step=1, micro_batch=5)], steps, 0.4, 140,
                          # however slow the restart (loaded machine), it is admitted in time
                          "--hold-for-joiner", str(steps - 2))
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(log.read_text().splitlines()) == 1  # the fault fired
    agent = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    assert [(e["severity"], e["kind"], e["rank"]) for e in agent if e["event"] == "error_event"] == \
        [("SEV2", "exited_abnormally", 2)]
    assert [(e["action"], e["rank"]) for e in agent if e["event"] == "agent_action"] == [("restart_worker", 2)]
    survivors = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert all(rep[1]["recoveries"] == 1 and rep[1]["dead"] == [2] for rep in survivors.values())
    back = json.loads((tmp_path / "rank2.json").read_text())
    joined = back[0]["joined_at"]
    assert back[0]["state_from"] == "replica" and 2 <= joined < steps  # no checkpoint: state by broadcast
    assert [r["step"] for r in back[1:]] == list(range(joined, steps))
    assert json.loads((tmp_path / "rank0.json").read_text())[joined]["micro_batches"] == [0, 3]  # full group again
    for rank in range(WORLD):  # everyone, the restarted rank included, ends where a failure-free run ends
        for ours, ref in zip(torch.load(tmp_path / f"params{rank}.pt"), baseline):
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


# -- four ranks, every victim, every point: no healthy rank is ever excluded ------------

POINTS4 = [dict(micro_batch=None), dict(bucket=0), dict(bucket=2), dict(at="before_optimizer_step"),
           dict(at="after_optimizer_step")]


@pytest.fixture(scope="session")
def baseline_f64(failure_free) -> list[torch.Tensor]:
    def reference_run(out: Path) -> list[torch.Tensor]:
        results = run_workers(WORKER, 4, ["--steps", "3", "--out", str(out), "--bucket-numel", "64",
                                          "--grad-dtype", "float64"], timeout=90)
        assert [r.returncode for r in results] == [0] * 4, results[0].stderr[-2000:]
        return torch.load(out / "params0.pt")

    return failure_free("test_elastic_dp.baseline_f64", reference_run)


POINT_IDS = ["micro-batch", "bucket0", "bucket2", "before-step", "after-step"]


def _victim_point_params() -> list:
    """Every (point, victim); the e2e tier runs a kill in a micro-batch and one in the last bucket's reduction
    (the rest: -m matrix)."""
    return [pytest.param(point, victim, id=f"{POINT_IDS[point]}-{victim}",
                         marks=() if (point, victim) in ((0, 0), (2, 2)) else pytest.mark.matrix)
            for point in range(len(POINTS4)) for victim in range(4)]


@pytest.mark.e2e
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("point", "victim"), _victim_point_params())
def test_four_ranks_any_victim_any_point_survivors_bit_identical(tmp_path: Path, baseline_f64, victim: int,
                                                                  point: int) -> None:
    where = dict(POINTS4[point])
    if "micro_batch" in where:
        where["micro_batch"] = victim + 4 if victim < 2 else victim  # its second micro-batch, or its only one
    fault = fail_at(rank=victim, step=1, **where)
    started = time.monotonic()
    results = run_workers(WORKER, 4, ["--steps", "3", "--out", str(tmp_path), "--bucket-numel", "64",
                                      "--grad-dtype", "float64"], faults_env([fault], str(tmp_path / "faults.log")),
                          timeout=90)
    assert len((tmp_path / "faults.log").read_text().splitlines()) == 1, "the fault did not fire"
    assert results[victim].returncode == -9
    survivors = [r for r in range(4) if r != victim]
    for r in survivors:  # none excluded, none hung: each finished every step
        assert results[r].returncode == 0, results[r].stderr[-3000:]
        reports = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert [rep["step"] for rep in reports] == [0, 1, 2]
        assert sorted(d for rep in reports for d in rep["dead"]) == [victim]
        params = torch.load(tmp_path / f"params{r}.pt")
        assert all(torch.equal(ours, ref) for ours, ref in zip(params, baseline_f64)), f"rank {r} diverged"
    failed = 2 if "at" in where else 1  # after the last bucket: the next step finds the loss
    counted = sorted(j for r in survivors for j in json.loads((tmp_path / f"rank{r}.json").read_text())[failed]["micro_batches"])
    assert counted == list(range(B))
    assert time.monotonic() - started < 60


@pytest.mark.e2e
@pytest.mark.timeout(200)
def test_every_replica_lost_and_nothing_persisted_restarts_from_step_0(tmp_path: Path) -> None:
    steps = 6
    baseline = _reference(tmp_path, steps)
    log = tmp_path / "faults.log"
    result = _unicron_run(tmp_path, [fail_at(rank=r, step=2, micro_batch=r) for r in range(WORLD)], steps, 0.2, 180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(log.read_text().splitlines()) == WORLD  # every rank died in step 2
    assert "dp_restart_from_step_0" in result.stdout + result.stderr  # said clearly
    for rank in range(WORLD):
        back = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert back[0] == {"joined_at": 0, "state_from": "step0"}  # no replica, snapshot or checkpoint
        assert [r["step"] for r in back[1:]] == list(range(steps))
        for ours, ref in zip(torch.load(tmp_path / f"params{rank}.pt"), baseline):
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.e2e
@pytest.mark.timeout(150)
@pytest.mark.parametrize("faults", [
    [fail_at(rank=0, step=1, micro_batch=0), fail_at(rank=3, step=1, micro_batch=3)],  # two at once, rank 0 too
    [fail_at(rank=1, step=1, micro_batch=5), fail_at(rank=2, step=1, bucket=1)],  # the second during the redo
], ids=["two-in-one-step", "second-during-recovery"])
def test_two_failures_in_one_step_survivors_bit_identical(tmp_path: Path, baseline_f64, faults: list[Fault]) -> None:
    results = run_workers(WORKER, 4, ["--steps", "3", "--out", str(tmp_path), "--bucket-numel", "64",
                                      "--grad-dtype", "float64"], faults_env(faults, str(tmp_path / "faults.log")),
                          timeout=90)
    assert len((tmp_path / "faults.log").read_text().splitlines()) == 2, "a fault did not fire"
    victims = sorted(f.rank for f in faults)
    survivors = [r for r in range(4) if r not in victims]
    assert all(results[v].returncode == -9 for v in victims)
    counted = []
    for r in survivors:
        assert results[r].returncode == 0, results[r].stderr[-3000:]
        reports = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert [rep["step"] for rep in reports] == [0, 1, 2]
        assert sorted(reports[1]["dead"]) == victims
        counted += reports[1]["micro_batches"]
        params = torch.load(tmp_path / f"params{r}.pt")
        assert all(torch.equal(ours, ref) for ours, ref in zip(params, baseline_f64)), f"rank {r} diverged"
    assert sorted(counted) == list(range(B))  # every micro-batch of the failed step counted once
