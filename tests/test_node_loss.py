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
import signal
import subprocess
import time
from pathlib import Path

import etcd3
import pytest
import torch

from conftest import BIN, EXAMPLES
from unicron_elastic.store import EmbeddedEtcd
from unicron_elastic.testing import Fault, fail_at, faults_env, kill_node, process_tree, run_workers

WORKER = os.path.join(EXAMPLES, "elastic_dp_worker.py")
STEPS, B, PER_NODE = 6, 6, 2
COMMON = ["--steps", str(STEPS), "--grad-dtype", "float64", "--bucket-numel", "64"]


@pytest.fixture(scope="session")
def baseline(failure_free) -> list[torch.Tensor]:
    def reference_run(out: Path) -> list[torch.Tensor]:
        results = run_workers(WORKER, 4, [*COMMON, "--out", str(out)], timeout=120)
        assert [r.returncode for r in results] == [0] * 4, results[0].stderr[-2000:]
        return torch.load(out / "params0.pt")

    return failure_free("test_node_loss.baseline", reference_run)


def _command(etcd: EmbeddedEtcd, run_id: str, nodes: int, out: Path, *extra: str) -> list[str]:
    return [os.path.join(BIN, "unicron-run"), f"--rdzv-endpoint={etcd.endpoint}", f"--rdzv-id={run_id}",
            f"--nnodes={nodes}", f"--nproc-per-node={PER_NODE}", "--monitor-interval=0.05", "--log-format=json",
            f"--rdzv-conf=cluster={run_id},keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=1",
            WORKER, *COMMON, "--step-time", "0.2", "--out", str(out), *extra]


def _start(cmd: list[str], out: Path, faults: list[Fault], nodes: int, first: int = 0) -> list[subprocess.Popen]:
    """``nodes`` launchers running ``cmd`` with ``faults``, logging to ``OUT/node<i>.log`` from ``first`` on."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=BIN + os.pathsep + os.environ["PATH"],
               **faults_env(faults, str(out / "faults.log")))
    out.mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen(cmd, stdout=(out / f"node{i}.log").open("w"), stderr=subprocess.STDOUT, env=env)
            for i in range(first, first + nodes)]


def _launch(etcd: EmbeddedEtcd, run_id: str, nodes: int, out: Path, fault: Fault,
            *extra: str) -> list[subprocess.Popen]:
    return _start(_command(etcd, run_id, nodes, out, *extra), out, [fault], nodes)


def _same_params(out: Path, rank: int, reference: list[torch.Tensor]) -> bool:
    """Whether ``rank``'s final parameters equal ``reference`` exactly."""
    return all(torch.equal(ours, ref) for ours, ref in zip(torch.load(out / f"params{rank}.pt"), reference))


def _wait_for_fault(out: Path, launchers: list[subprocess.Popen], deadline_s: float = 120) -> dict:
    log = out / "faults.log"
    deadline = time.monotonic() + deadline_s
    while not (log.exists() and log.read_text().strip()):
        assert time.monotonic() < deadline, "the fault did not fire"
        assert all(p.poll() is None for p in launchers), (out / "node0.log").read_text()[-3000:]
        time.sleep(0.01)
    return json.loads(log.read_text().splitlines()[0])


#: Processes a worker starts besides training: our snapshot writer, and torch 2.8's inductor compile workers
#: (megatron-core's import starts their pool there; they exit with their parent).
HELPERS = (b"snapshot_writer", b"torch/_inductor/compile_worker")


def helper_processes(pids: list[int]) -> list[int]:
    """The helper processes (:data:`HELPERS`) among ``pids``."""
    found = []
    for pid in pids:
        try:
            if any(name in Path(f"/proc/{pid}/cmdline").read_bytes() for name in HELPERS):
                found.append(pid)
        except OSError:  # (exited meanwhile: it was killed)
            pass
    return found


def _lose_node_of(fired: dict, launchers: list[subprocess.Popen]) -> int:
    victim = next(i for i, p in enumerate(launchers) if fired["pid"] in process_tree(p.pid))
    tree = process_tree(launchers[victim].pid)
    workers = [pid for pid in tree if pid != launchers[victim].pid and pid not in helper_processes(tree)]
    killed = kill_node(launchers[victim].pid)
    # the launcher and its workers (and their helpers: a snapshot writer, torch's compile workers, and any
    # process started between the look and the kill, not yet named as one)
    assert len(workers) >= PER_NODE and {launchers[victim].pid, *workers} <= set(killed), (workers, killed)
    return victim


def _lose_a_node_and_wait(out: Path, launchers: list[subprocess.Popen], timeout: float,
                          deadline_s: float = 120) -> tuple[int, int]:
    """Lose the node whose rank fired the fault; wait for the other launcher. Returns (victim, its exit code).

    Whatever happens, no launcher is left running.
    """
    try:
        victim = _lose_node_of(_wait_for_fault(out, launchers, deadline_s=deadline_s), launchers)
        return victim, launchers[1 - victim].wait(timeout=timeout)
    finally:
        for p in launchers:
            if p.poll() is None:
                kill_node(p.pid)


POINTS = {  # where the victim's rank is parked when its node is lost; the step that fails
    "micro-batch": (lambda r: fail_at(rank=r, step=2, micro_batch=r, kind="hang"), 2),  # its first of step 2
    "bucket": (lambda r: fail_at(rank=r, step=2, bucket=1, kind="hang"), 2),  # during the gradient all-reduce
    "between-steps": (lambda r: fail_at(rank=r, step=2, at="after_optimizer_step", kind="hang"), 3),
}
DEFAULT_CASE = (2, 2, "micro-batch")  # the default tier's node loss; the other CI cases run with -m e2e
CI_CASES = {DEFAULT_CASE, (3, 0, "bucket")}


def _cases() -> list:
    cases = []
    for nodes in (2, 3):
        for node in range(nodes):
            for point in POINTS:
                rank = node * PER_NODE + (1 if point == "between-steps" else 0)
                case = (nodes, rank, point)
                marks = [pytest.mark.compat] if case == DEFAULT_CASE else [pytest.mark.e2e] if case in CI_CASES else [pytest.mark.matrix]
                cases.append(pytest.param(nodes, rank, point, marks=marks,
                                          id=f"{nodes}nodes-rank{rank}-node{'(rank0)' if node == 0 else node}-{point}"))
    return cases


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("nodes", "rank", "point"), _cases())
def test_a_lost_node_leaves_the_survivors_on_the_failure_free_trajectory(
        etcd: EmbeddedEtcd, tmp_path: Path, baseline, nodes: int, rank: int, point: str) -> None:
    make, failed_step = POINTS[point]
    fault = make(rank)
    out = tmp_path / "out"
    launchers = _launch(etcd, f"lose-{nodes}-{rank}-{point}", nodes, out, fault)
    try:
        fired = _wait_for_fault(out, launchers)
        victim = _lose_node_of(fired, launchers)
        killed_at = time.time()
        survivors = [p for i, p in enumerate(launchers) if i != victim]
        codes = [p.wait(timeout=200) for p in survivors]
    finally:
        for p in launchers:
            if p.poll() is None:
                kill_node(p.pid)
    logs = "\n".join((out / f"node{i}.log").read_text()[-3000:] for i in range(nodes))
    assert codes == [0] * len(survivors), logs
    reports = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    lost = sorted(set(range(nodes * PER_NODE)) - set(reports))
    assert fault.rank in lost and len(lost) == PER_NODE, (lost, logs)  # exactly the lost node's ranks
    for r in reports:
        assert _same_params(out, r, baseline), f"rank {r} diverged"
        steps = reports[r]
        assert [s["step"] for s in steps] == list(range(STEPS))  # trained to the last step
        failed = steps[failed_step]
        assert failed["recoveries"] >= 1 and sorted(failed["dead"]) == lost, failed
    for step in range(failed_step, STEPS):  # every micro-batch counted once, the failed step's included
        counted = sorted(j for r in reports for j in reports[r][step]["micro_batches"])
        assert counted == list(range(B)), (step, counted)
    for step in range(failed_step + 1, STEPS):  # the smaller world
        assert sum(bool(reports[r][step]["micro_batches"]) for r in reports) == min(B, len(reports))
    recovered = max(reports[r][failed_step]["finished_at"] for r in reports) - killed_at
    print(f"{nodes} nodes, rank {rank}'s node lost at {point}: survivors finished step {failed_step} "
          f"{recovered:.2f} s after the kill")


@pytest.mark.e2e
@pytest.mark.matrix  # in CI through Lightning: test_lightning_lost_node_started_again_rejoins_...
@pytest.mark.timeout(300)
def test_the_lost_node_started_again_rejoins_without_restarting_anyone(etcd: EmbeddedEtcd, tmp_path: Path,
                                                                       baseline) -> None:
    out = tmp_path / "out"
    fault = fail_at(rank=2, step=1, micro_batch=2, kind="hang")
    hold = ["--hold-for-joiner", str(STEPS - 2)]  # the run outlasts the node's return, however slow
    launchers = _launch(etcd, "rejoin", 2, out, fault, *hold)
    again: list[subprocess.Popen] = []
    try:
        victim = _lose_node_of(_wait_for_fault(out, launchers), launchers)
        again = _start(_command(etcd, "rejoin", 2, out, *hold), out, [fault], 1, first=2)  # same flags again
        survivor = launchers[1 - victim]
        codes = [survivor.wait(timeout=200), again[0].wait(timeout=60)]
    finally:
        for p in [*launchers, *again]:
            if p.poll() is None:
                kill_node(p.pid)
    logs = (out / f"node{1 - victim}.log").read_text()[-3000:] + (out / "node2.log").read_text()[-3000:]
    assert codes == [0, 0], logs
    assert "rendezvous_rejoined" in (out / "node2.log").read_text()
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
        assert _same_params(out, r, baseline), f"rank {r} diverged"
    assert reports[0][-1]["micro_batches"] == [0, 4]  # the full world again (B = 6 over 4 ranks), same global batch


# -- the Lightning strategy: a whole node lost, rank 0's included ------------------------------

GPT = os.path.join(EXAMPLES, "lightning_gpt.py")
GPT_STEPS = 8


def _gpt(etcd: EmbeddedEtcd, run_id: str, out: Path, nodes: int, faults: list[Fault], *extra: str,
         first: int = 0, nnodes: str | None = None) -> list[subprocess.Popen]:
    cmd = [os.path.join(BIN, "unicron-run"), f"--rdzv-endpoint={etcd.endpoint}", f"--rdzv-id={run_id}",
           f"--nnodes={nnodes or nodes}", f"--nproc-per-node={PER_NODE}", "--monitor-interval=0.05",
           f"--rdzv-conf=cluster={run_id},keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=1",
           GPT, "--steps", str(GPT_STEPS), "--out", str(out), "--step-time", "0.2", *extra]
    return _start(cmd, out, faults, nodes, first)


@pytest.fixture(scope="session")
def gpt_baseline(failure_free, etcd: EmbeddedEtcd) -> list[torch.Tensor]:
    def reference_run(out: Path) -> list[torch.Tensor]:
        launchers = _gpt(etcd, "gpt-baseline", out, 2, [])
        assert [p.wait(timeout=200) for p in launchers] == [0, 0], (out / "node0.log").read_text()[-3000:]
        params = [torch.load(out / f"params{r}.pt") for r in range(4)]
        assert all(all(torch.equal(a, b) for a, b in zip(params[0], other)) for other in params[1:])
        return params[0]

    return failure_free("test_node_loss.gpt_baseline", reference_run)


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("victim", [pytest.param(0, id="rank0-node"),  # the leader's node: the harder case
                                    pytest.param(2, id="other-node", marks=pytest.mark.matrix)])
def test_lightning_task_survives_a_lost_node_with_default_detectors(etcd: EmbeddedEtcd, tmp_path: Path,
                                                                    gpt_baseline, victim: int) -> None:
    out = tmp_path / "out"
    fault = fail_at(rank=victim, step=3, micro_batch=victim, kind="hang")  # its first micro-batch of step 3
    launchers = _gpt(etcd, f"gpt-lose-{victim}", out, 2, [fault])
    lost, code = _lose_a_node_and_wait(out, launchers, timeout=200, deadline_s=200)
    assert code == 0, (out / f"node{1 - lost}.log").read_text()[-4000:]
    assert "worker_restarted" not in (out / f"node{1 - lost}.log").read_text()  # default detectors: no false hang
    done = sorted(int(p.stem[4:]) for p in out.glob("rank*.json"))
    assert victim not in done and len(done) == PER_NODE, done
    for rank in done:
        summary = json.loads((out / f"rank{rank}.json").read_text())
        assert summary["global_step"] == GPT_STEPS and summary["joined_at"] is None  # no restart
        failed = summary["reports"][fault.step]
        assert failed["recoveries"] == 1 and sorted(failed["dead"]) == sorted(set(range(4)) - set(done))
        assert _same_params(out, rank, gpt_baseline), f"rank {rank} diverged"


# -- plain torchrun with the unicron rendezvous: what survives without unicron-run ------------------

@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_plain_torchrun_survives_losing_a_node_other_than_rank_0s(etcd: EmbeddedEtcd, tmp_path: Path,
                                                                   baseline) -> None:
    # no agent of ours: workers meet in torch's TCPStore on rank 0's node and no liveness keys are kept, so the
    # survivors wait out checkin_timeout (10 s) for the lost ranks; torch's exit barrier then waits for the lost
    # node (300 s), so the test stops the surviving launcher once its workers are done
    out = tmp_path / "out"
    fault = fail_at(rank=2, step=2, micro_batch=2, kind="hang")
    cmd = [os.path.join(BIN, "torchrun"), "--rdzv-backend=unicron", f"--rdzv-endpoint={etcd.endpoint}",
           "--rdzv-id=plain-torchrun-node", "--nnodes=2", f"--nproc-per-node={PER_NODE}", "--monitor-interval=0.05",
           "--rdzv-conf=cluster=plain-torchrun-node,keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=1",
           WORKER, *COMMON, "--step-time", "0.2", "--out", str(out)]
    launchers = _start(cmd, out, [fault], 2)
    try:
        victim = _lose_node_of(_wait_for_fault(out, launchers), launchers)
        survivor = launchers[1 - victim]
        deadline = time.monotonic() + 200
        while len(list(out.glob("params*.pt"))) < PER_NODE:  # the survivors' workers finished training
            assert time.monotonic() < deadline and survivor.poll() in (None, 0), \
                (out / f"node{1 - victim}.log").read_text()[-3000:]
            time.sleep(0.1)
    finally:
        for p in launchers:
            if p.poll() is None:
                kill_node(p.pid)
    reports = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    assert sorted(reports) == [0, 1]  # rank 0's node survived
    for r in reports:
        assert [s["step"] for s in reports[r]] == list(range(STEPS))
        assert sorted(reports[r][2]["dead"]) == [2, 3]
        assert _same_params(out, r, baseline), f"rank {r} diverged"


@pytest.mark.e2e  # (a rank's rejoin from a replica runs by default: test_lightning_strategy)
@pytest.mark.timeout(400)
def test_lightning_lost_node_started_again_rejoins_without_restarting_anyone(etcd: EmbeddedEtcd, tmp_path: Path,
                                                                             gpt_baseline) -> None:
    out = tmp_path / "out"
    fault = fail_at(rank=2, step=2, micro_batch=2, kind="hang")
    hold = ["--hold-for-joiner", str(GPT_STEPS - 2)]  # the run outlasts the node's return, however slow
    launchers = _gpt(etcd, "gpt-rejoin", out, 2, [fault], *hold)
    again: list[subprocess.Popen] = []
    try:
        victim = _lose_node_of(_wait_for_fault(out, launchers, deadline_s=200), launchers)
        again = _gpt(etcd, "gpt-rejoin", out, 1, [fault], *hold, first=2)  # same flags, as an operator would
        survivor = launchers[1 - victim]
        codes = [survivor.wait(timeout=250), again[0].wait(timeout=100)]
    finally:
        for p in [*launchers, *again]:
            if p.poll() is None:
                kill_node(p.pid)
    logs = (out / f"node{1 - victim}.log").read_text()[-3000:] + (out / "node2.log").read_text()[-3000:]
    assert codes == [0, 0], logs
    assert "rendezvous_rejoined" in (out / "node2.log").read_text()
    assert "worker_restarted" not in (out / f"node{1 - victim}.log").read_text()  # the healthy workers ran on
    summaries = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(4)}
    for r in (0, 1):
        assert summaries[r]["joined_at"] is None and summaries[r]["global_step"] == GPT_STEPS
        assert sorted(summaries[r]["reports"][fault.step]["dead"]) == [2, 3]
    for r in (2, 3):  # the returned node's ranks joined from a replica and trained to the end
        joined = summaries[r]
        assert joined["state_from"] == "replica" and fault.step < joined["joined_at"] < GPT_STEPS, joined
        assert joined["global_step"] == GPT_STEPS
    for r in range(4):
        assert _same_params(out, r, gpt_baseline), f"rank {r} diverged"


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_a_new_node_grows_a_running_lightning_task_without_restarting_anyone(etcd: EmbeddedEtcd, tmp_path: Path,
                                                                            gpt_baseline) -> None:
    # one launcher forms the round alone (--nnodes=1:2); a second one, same flags, arrives while it trains: it
    # adds a place to the running round (no torch restart-all), its ranks 2 and 3 join at a step boundary
    out = tmp_path / "out"
    hold = ["--hold-for-joiner", str(GPT_STEPS - 2), "--hold-ranks", "4", "--record-times"]
    launchers = _gpt(etcd, "gpt-grow", out, 1, [], *hold, nnodes="1:2")
    grown: list[subprocess.Popen] = []
    try:
        deadline = time.monotonic() + 200
        while not ((out / "times0.jsonl").exists() and (out / "times0.jsonl").read_text().strip()):
            assert time.monotonic() < deadline and launchers[0].poll() is None, (out / "node0.log").read_text()[-3000:]
            time.sleep(0.1)
        grown = _gpt(etcd, "gpt-grow", out, 1, [], *hold, first=1, nnodes="1:2")
        codes = [launchers[0].wait(timeout=250), grown[0].wait(timeout=100)]
    finally:
        for p in [*launchers, *grown]:
            if p.poll() is None:
                kill_node(p.pid)
    logs = (out / "node0.log").read_text()[-3000:] + (out / "node1.log").read_text()[-3000:]
    assert codes == [0, 0], logs
    assert "rendezvous_grown" in (out / "node1.log").read_text(), logs
    assert "worker_restarted" not in (out / "node0.log").read_text()  # the running workers ran on
    summaries = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(4)}
    for r in (2, 3):  # the new node's ranks joined from a replica and trained to the end
        joined = summaries[r]
        assert joined["state_from"] == "replica" and 0 < joined["joined_at"] < GPT_STEPS, joined
        assert joined["global_step"] == GPT_STEPS
    first = min(summaries[r]["joined_at"] for r in (2, 3))
    for r in (0, 1):  # never restarted: trained every step, on 2 ranks (3 micro-batches each), then on 3 or 4 (2)
        reports = summaries[r]["reports"]
        assert summaries[r]["joined_at"] is None and summaries[r]["global_step"] == GPT_STEPS
        assert [len(x["micro_batches"]) for x in reports] == [3] * first + [2] * (GPT_STEPS - first), reports
    last = sorted(j for r in range(4) for j in summaries[r]["reports"][-1]["micro_batches"])
    assert last == list(range(6))  # the last step: the 6 micro-batches over all 4 ranks, each once
    for r in range(4):  # the same global batch all along: the failure-free trajectory
        assert _same_params(out, r, gpt_baseline), f"rank {r} diverged"


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_node_asked_to_leave_retires_its_ranks_at_a_step_boundary_and_nobody_sees_a_failure(
        etcd: EmbeddedEtcd, tmp_path: Path, baseline) -> None:
    """SIGUSR2 to one launcher (what the node daemon sends when the plan takes the node away): its ranks
    leave the group between two steps, it exits 0 without waiting for the others, and the others train on
    with the same global batch, never regrouping, to the failure-free parameters."""
    out, release = tmp_path / "out", tmp_path / "release"
    hold = STEPS - 2  # the run waits there until the leave was seen: it cannot end first
    cmd = _command(etcd, "leave", 2, out, "--progress", "--hold-until", str(release), "--hold-step", str(hold))
    launchers = _start(cmd, out, [], 2)
    try:
        deadline = time.monotonic() + 120
        while not all((out / f"progress{r}").exists() for r in range(4)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in launchers), \
                (out / "node0.log").read_text()[-3000:]
            time.sleep(0.05)
        leaving = launchers[1]
        leaving.send_signal(signal.SIGUSR2)
        while "leaving_task" not in (out / "node1.log").read_text():
            assert time.monotonic() < deadline + 60 and leaving.poll() is None, (out / "node1.log").read_text()[-3000:]
            time.sleep(0.05)
        release.touch()
        codes = [leaving.wait(timeout=120), launchers[0].wait(timeout=120)]
    finally:
        for p in launchers:
            if p.poll() is None:
                kill_node(p.pid)
    logs = [(out / f"node{i}.log").read_text() for i in range(2)]
    assert codes == [0, 0], logs[1][-3000:] + logs[0][-3000:]
    assert "exit_barrier_skipped" in logs[1] and "worker_restarted" not in logs[0] + logs[1]
    reports = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(4)}
    for r in (2, 3):  # the leaving node's ranks retired together at a step boundary before the end
        [retired] = [x["retired_at"] for x in reports[r] if "retired_at" in x]
        assert 0 < retired < STEPS
    assert reports[2][-1]["retired_at"] == reports[3][-1]["retired_at"]
    for r in (0, 1):
        steps = [x for x in reports[r] if "step" in x]
        assert [x["step"] for x in steps] == list(range(STEPS))
        assert not any(x.get("recoveries") for x in steps) and not any("excluded_at" in x for x in reports[r])
        assert _same_params(out, r, baseline), f"rank {r} diverged"


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_node_lost_before_the_first_group_formed_the_others_start_without_it(
        etcd: EmbeddedEtcd, tmp_path: Path, baseline) -> None:
    """Node 1 is lost while the run's first data-parallel group is built: ranks 0 and 1 fail to build it,
    are restarted, know ranks 2 and 3 are gone (their liveness keys left with the node's lease) and the
    lowest starts the group from step 0 (nothing persisted yet): the run ends on the failure-free
    trajectory instead of waiting for members that never come."""
    fault = fail_at(rank=2, step=-1, at="before_first_group", kind="hang")
    out = tmp_path / "out"
    launchers = _launch(etcd, "lose-before-group", 2, out, fault)
    victim, code = _lose_a_node_and_wait(out, launchers, timeout=240)
    log = (out / f"node{1 - victim}.log").read_text()
    assert code == 0, log[-3000:]
    assert "dp_restart_from_step_0" in log or "dp_no_replica_left" in log
    # the survivors stopped waiting for the lost ranks' gloo addresses when their liveness keys went,
    # not at the collective timeout (20 s here)
    assert f"MemberGoneError: ranks {[2 * victim, 2 * victim + 1]} are gone" in log, log[-3000:]
    for r in (0, 1):
        assert _same_params(out, r, baseline), f"rank {r} diverged"


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_every_lease_lapsing_at_once_is_renewed_and_training_goes_on(private_etcd: EmbeddedEtcd, tmp_path: Path,
                                                                     baseline) -> None:
    """What an overloaded host did under the CPU hog: every etcd lease of the run lapsed at once while
    all nodes were alive. Each holder grants a new lease and puts its keys back (node records, agent
    keys, workers' liveness keys, snapshot servers): no node gives up, nobody is restarted, and the run
    ends on the failure-free trajectory."""
    out, release = tmp_path / "out", tmp_path / "release"
    cmd = _command(private_etcd, "lapse", 2, out, "--progress", "--hold-until", str(release),
                   "--hold-step", str(STEPS - 2))
    launchers = _start(cmd, out, [], 2)
    client = etcd3.client(host="127.0.0.1", port=private_etcd.client_port)
    try:
        deadline = time.monotonic() + 120
        while not all((out / f"progress{r}").exists() for r in range(4)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in launchers), \
                (out / "node0.log").read_text()[-3000:]
            time.sleep(0.05)
        leases = {meta.lease_id for _value, meta in client.get_all() if meta.lease_id}
        assert len(leases) >= 4  # per node: its record's lease and its meeting keys' lease
        for lease in leases:
            client.revoke_lease(lease)
        while sum((out / f"node{i}.log").read_text().count('"lease_renewed"') for i in range(2)) < len(leases):
            assert time.monotonic() < deadline + 60 and all(p.poll() is None for p in launchers), \
                (out / "node0.log").read_text()[-3000:]
            time.sleep(0.05)
        release.touch()
        codes = [p.wait(timeout=120) for p in launchers]
    finally:
        client.close()
        for p in launchers:
            if p.poll() is None:
                kill_node(p.pid)
    logs = "".join((out / f"node{i}.log").read_text() for i in range(2))
    assert codes == [0, 0], logs[-4000:]
    assert "meeting_keys_renewed" in logs and "worker_restarted" not in logs and '"give_up"' not in logs
    for r in range(4):
        assert _same_params(out, r, baseline), f"rank {r} diverged"
