"""Losing a whole node: real ``unicron-run`` launchers on loopback sharing a real etcd (issue 10).

A "node" is a launcher with its own process tree; losing it SIGKILLs the whole
tree (:func:`unicron_elastic.testing.kill_node`). The victim node is chosen by
the rank that reaches a point of the step first: a ``hang`` fault parks that
rank there and logs it, then the test kills its node. Survivors must finish
with the parameters of a failure-free run (float64 gradient sums:
``torch.equal``), every micro-batch of the failed step counted once.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import BIN, EXAMPLES
from unicron_elastic.store import EmbeddedEtcd
from unicron_elastic.testing import Fault, fail_at, faults_env, kill_node, process_tree, run_workers

pytestmark = pytest.mark.slow
WORKER = os.path.join(EXAMPLES, "elastic_dp_worker.py")
STEPS, B, PER_NODE = 6, 6, 2
COMMON = ["--steps", str(STEPS), "--grad-dtype", "float64", "--bucket-numel", "64"]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> list[torch.Tensor]:
    out = tmp_path_factory.mktemp("baseline")
    results = run_workers(WORKER, 4, [*COMMON, "--out", str(out)], timeout=120)
    assert [r.returncode for r in results] == [0] * 4, results[0].stderr[-2000:]
    return torch.load(out / "params0.pt")


def _command(etcd: EmbeddedEtcd, run_id: str, nodes: int, out: Path, *extra: str) -> list[str]:
    return [os.path.join(BIN, "unicron-run"), f"--rdzv-endpoint={etcd.endpoint}", f"--rdzv-id={run_id}",
            f"--nnodes={nodes}", f"--nproc-per-node={PER_NODE}", "--monitor-interval=0.05", "--log-format=json",
            f"--rdzv-conf=cluster={run_id},keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=1",
            WORKER, *COMMON, "--step-time", "0.2", "--out", str(out), *extra]


def _launch(etcd: EmbeddedEtcd, run_id: str, nodes: int, out: Path, fault: Fault,
            *extra: str) -> list[subprocess.Popen]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=BIN + os.pathsep + os.environ["PATH"],
               **faults_env([fault], str(out / "faults.log")))
    cmd = _command(etcd, run_id, nodes, out, *extra)
    out.mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen(cmd, stdout=(out / f"node{i}.log").open("w"), stderr=subprocess.STDOUT, env=env)
            for i in range(nodes)]


def _wait_for_fault(out: Path, launchers: list[subprocess.Popen], deadline_s: float = 120) -> dict:
    log = out / "faults.log"
    deadline = time.monotonic() + deadline_s
    while not (log.exists() and log.read_text().strip()):
        assert time.monotonic() < deadline, "the fault did not fire"
        assert all(p.poll() is None for p in launchers), (out / "node0.log").read_text()[-3000:]
        time.sleep(0.01)
    return json.loads(log.read_text().splitlines()[0])


def _lose_node_of(fired: dict, launchers: list[subprocess.Popen]) -> int:
    victim = next(i for i, p in enumerate(launchers) if fired["pid"] in process_tree(p.pid))
    killed = kill_node(launchers[victim].pid)
    assert len(killed) == 1 + PER_NODE  # the launcher and its workers
    return victim


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("nodes", "fault", "failed_step"), [
    (2, fail_at(rank=2, step=2, micro_batch=2, kind="hang"), 2),  # in the middle of a micro-batch
    (2, fail_at(rank=0, step=2, bucket=1, kind="hang"), 2),  # rank 0's node, during a gradient bucket
    (2, fail_at(rank=1, step=2, at="after_optimizer_step", kind="hang"), 3),  # rank 0's node, between steps
], ids=["other-node-micro-batch", "rank0-node-bucket", "rank0-node-between-steps"])
def test_a_lost_node_leaves_the_survivors_on_the_failure_free_trajectory(
        etcd: EmbeddedEtcd, tmp_path: Path, baseline, nodes: int, fault: Fault, failed_step: int) -> None:
    out = tmp_path / "out"
    launchers = _launch(etcd, f"lose-{fault.rank}-{fault.step}", nodes, out, fault)
    try:
        fired = _wait_for_fault(out, launchers)
        victim = _lose_node_of(fired, launchers)
        survivors = [p for i, p in enumerate(launchers) if i != victim]
        codes = [p.wait(timeout=150) for p in survivors]
    finally:
        for p in launchers:
            if p.poll() is None:
                kill_node(p.pid)
    logs = "\n".join((out / f"node{i}.log").read_text()[-3000:] for i in range(nodes))
    assert codes == [0] * len(survivors), logs
    reports = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    lost = sorted(set(range(nodes * PER_NODE)) - set(reports))
    assert fault.rank in lost and len(lost) == PER_NODE, (lost, logs)  # exactly the lost node's ranks
    for rank in reports:
        params = torch.load(out / f"params{rank}.pt")
        assert all(torch.equal(ours, ref) for ours, ref in zip(params, baseline)), f"rank {rank} diverged"
        steps = reports[rank]
        assert [s["step"] for s in steps] == list(range(STEPS))  # trained to the last step
        failed = steps[failed_step]
        assert failed["recoveries"] >= 1 and sorted(failed["dead"]) == lost, failed
        assert all(len(s["micro_batches"]) == B // len(reports) for s in steps[failed_step + 1:])  # smaller world after
    counted = sorted(j for rank in reports for j in reports[rank][failed_step]["micro_batches"])
    assert counted == list(range(B))  # every micro-batch of the failed step counted once


@pytest.mark.timeout(300)
def test_the_lost_node_started_again_rejoins_without_restarting_anyone(etcd: EmbeddedEtcd, tmp_path: Path,
                                                                       baseline) -> None:
    out = tmp_path / "out"
    fault = fail_at(rank=2, step=1, micro_batch=2, kind="hang")
    hold = ["--hold-for-joiner", str(STEPS - 2)]  # the run outlasts the node's return, however slow
    launchers = _launch(etcd, "rejoin", 2, out, fault, *hold)
    again: subprocess.Popen | None = None
    try:
        victim = _lose_node_of(_wait_for_fault(out, launchers), launchers)
        env = dict(os.environ, OMP_NUM_THREADS="1", PATH=BIN + os.pathsep + os.environ["PATH"],
                   **faults_env([fault], str(out / "faults.log")))
        again = subprocess.Popen(_command(etcd, "rejoin", 2, out, *hold), env=env, stderr=subprocess.STDOUT,
                                 stdout=(out / "again.log").open("w"))  # same flags, as an operator would
        survivor = launchers[1 - victim]
        codes = [survivor.wait(timeout=200), again.wait(timeout=60)]
    finally:
        for p in [*launchers, *([again] if again else [])]:
            if p.poll() is None:
                kill_node(p.pid)
    logs = (out / f"node{1 - victim}.log").read_text()[-3000:] + (out / "again.log").read_text()[-3000:]
    assert codes == [0, 0], logs
    assert "rendezvous_rejoined" in (out / "again.log").read_text()
    reports = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(4)}
    for r in (0, 1):  # the healthy workers: one process each, every step, never restarted
        assert [s["step"] for s in reports[r]] == list(range(STEPS))
        assert len({s["pid"] for s in reports[r]}) == 1
        assert reports[r][1]["dead"] == [2, 3]
    for r in (2, 3):  # the returned node's ranks joined from a replica and trained to the end
        joined = reports[r][0]
        assert joined["state_from"] == "replica" and 2 <= joined["joined_at"] < STEPS, joined
        assert [s["step"] for s in reports[r][1:]] == list(range(joined["joined_at"], STEPS))
    for r in range(4):
        params = torch.load(out / f"params{r}.pt")
        assert all(torch.equal(ours, ref) for ours, ref in zip(params, baseline)), f"rank {r} diverged"
    assert reports[0][-1]["micro_batches"] == [0, 4]  # the full world again (B = 6 over 4 ranks), same global batch


# -- the Lightning strategy: a whole node lost, rank 0's included ------------------------------

GPT = os.path.join(EXAMPLES, "lightning_gpt.py")
GPT_STEPS = 8


def _gpt(etcd: EmbeddedEtcd, run_id: str, out: Path, nodes: int, faults: list[Fault]) -> list[subprocess.Popen]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=BIN + os.pathsep + os.environ["PATH"],
               **faults_env(faults, str(out / "faults.log")))
    cmd = [os.path.join(BIN, "unicron-run"), f"--rdzv-endpoint={etcd.endpoint}", f"--rdzv-id={run_id}",
           f"--nnodes={nodes}", f"--nproc-per-node={PER_NODE}", "--monitor-interval=0.05",
           f"--rdzv-conf=cluster={run_id},keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=1",
           GPT, "--steps", str(GPT_STEPS), "--out", str(out), "--step-time", "0.2"]
    out.mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen(cmd, stdout=(out / f"node{i}.log").open("w"), stderr=subprocess.STDOUT, env=env)
            for i in range(nodes)]


@pytest.fixture(scope="module")
def gpt_baseline(etcd: EmbeddedEtcd, tmp_path_factory) -> list[torch.Tensor]:
    out = tmp_path_factory.mktemp("gpt_baseline")
    launchers = _gpt(etcd, "gpt-baseline", out, 2, [])
    assert [p.wait(timeout=200) for p in launchers] == [0, 0], (out / "node0.log").read_text()[-3000:]
    params = [torch.load(out / f"params{r}.pt") for r in range(4)]
    assert all(all(torch.equal(a, b) for a, b in zip(params[0], other)) for other in params[1:])
    return params[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("victim", [0, 2], ids=["rank0-node", "other-node"])
def test_lightning_task_survives_a_lost_node_with_default_detectors(etcd: EmbeddedEtcd, tmp_path: Path,
                                                                    gpt_baseline, victim: int) -> None:
    out = tmp_path / "out"
    fault = fail_at(rank=victim, step=3, micro_batch=victim, kind="hang")  # its first micro-batch of step 3
    launchers = _gpt(etcd, f"gpt-lose-{victim}", out, 2, [fault])
    try:
        lost = _lose_node_of(_wait_for_fault(out, launchers, deadline_s=200), launchers)
        survivor = launchers[1 - lost]
        code = survivor.wait(timeout=200)
    finally:
        for p in launchers:
            if p.poll() is None:
                kill_node(p.pid)
    assert code == 0, (out / f"node{1 - lost}.log").read_text()[-4000:]
    assert "worker_restarted" not in (out / f"node{1 - lost}.log").read_text()  # default detectors: no false hang
    done = sorted(int(p.stem[4:]) for p in out.glob("rank*.json"))
    assert victim not in done and len(done) == PER_NODE, done
    for rank in done:
        summary = json.loads((out / f"rank{rank}.json").read_text())
        assert summary["global_step"] == GPT_STEPS and summary["joined_at"] is None  # no restart
        failed = summary["reports"][fault.step]
        assert failed["recoveries"] == 1 and sorted(failed["dead"]) == sorted(set(range(4)) - set(done))
        params = torch.load(out / f"params{rank}.pt")
        assert all(torch.equal(ours, ref) for ours, ref in zip(params, gpt_baseline)), f"rank {rank} diverged"
