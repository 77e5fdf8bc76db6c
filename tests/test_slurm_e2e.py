"""examples/slurm/train.sbatch and ``unicron node --slurm`` on a real three-node loopback SLURM (issue 45).

Every node is a ``slurmd`` on this machine; a node is lost as on a cluster (its ``slurmd`` and every process
of its job steps SIGKILLed, then marked down), drained with ``scontrol update ... state=drain``, and the
job's warning is the SIGUSR1 ``--signal=B:USR1@N`` sends its batch shell (``scancel --batch --signal=USR1``:
SLURM's timer fires up to a minute early, so a test cannot place it). Parameters are compared with a
failure-free run of the same global batch (``torch.equal``: float64 gradient sums).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import BIN, EXAMPLES, REPO, json_log_entries, wait_for
from unicron_elastic.api import EtcdConfig
from unicron_elastic.coordinator.service import read_plan
from unicron_elastic.events import ErrorEvent, Severity
from unicron_elastic.store import EmbeddedEtcd, StatusStore

pytestmark = pytest.mark.e2e

GPT = os.path.join(EXAMPLES, "lightning_gpt.py")
RECIPE = os.path.join(REPO, "examples", "slurm", "train.sbatch")
STEPS = 14
#: Each sample takes 50 ms to load, so a step (8 samples a rank) is ~0.45 s of work inside the step: a node
#: killed at a random moment is killed mid-step, and the hang threshold (3 x the mean step) stays above the
#: ~1 s an etcd election can hold a request.
TRAIN = ("--steps", str(STEPS), "--record-times", "--load-delay", "0.05")
NODE_TTL = 2  # unicron-run's default
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL")


@pytest.fixture(scope="session")
def gpt_baseline(failure_free) -> list[torch.Tensor]:
    """The failure-free run: three ranks, the same global batch, no SLURM."""
    def reference_run(out: Path) -> list[torch.Tensor]:
        run = subprocess.run([os.path.join(BIN, "unicron-run"), "--standalone", "--nproc-per-node=3", GPT,
                              "--steps", str(STEPS), "--out", str(out)], capture_output=True, text=True, timeout=400,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert run.returncode == 0, run.stderr[-3000:]
        for rank in range(3):  # failure-free indeed: every rank trained every step, none was restarted
            summary = json.loads((out / f"rank{rank}.json").read_text())
            assert summary["trained"] and summary["global_step"] == STEPS and summary["joined_at"] is None, summary
        assert "worker_restarted" not in run.stderr + run.stdout
        return torch.load(out / "params0.pt")

    return failure_free("test_slurm_e2e.gpt_baseline", reference_run)


def _env(out: Path, run_flags: str = "", srun_flags: str = "", **extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=BIN + os.pathsep + os.environ["PATH"], UNICRON_OUT=str(out),
               UNICRON_SRUN_FLAGS=f"--output={out}/node-%t.log --open-mode=append {srun_flags}",
               UNICRON_RUN_FLAGS=f"--log-format=json --monitor-interval=0.05 {run_flags}")
    return {**env, **extra}


def submit(slurm, out: Path, *script_args: str, run_flags: str = "", sbatch_flags: tuple[str, ...] = (),
           **extra: str) -> str:
    """``sbatch examples/slurm/train.sbatch`` from the repository, as a user types it; the job id.

    ``OMP_NUM_THREADS`` is 1 unless ``extra`` names it (``""``: not set, the recipe decides).
    """
    out.mkdir(parents=True, exist_ok=True)
    env = _env(out, run_flags, **extra)
    if env.get("OMP_NUM_THREADS") == "":
        del env["OMP_NUM_THREADS"]
    return slurm.sbatch(f"--chdir={REPO}", "-o", str(out / "batch.log"), *sbatch_flags, RECIPE, *script_args, env=env)


def ended(slurm, job: str, seconds: float = 400) -> dict[str, str]:
    """The job's record once it has ended."""
    wait_for(lambda: slurm.job(job).get("JobState") in ENDED, seconds, why=f"job {job} ended")
    return slurm.job(job)


def times(out: Path, rank: int) -> list[dict]:
    path = out / f"times{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def entries(out: Path, pattern: str = "node-*.log") -> list[dict]:
    return [e for path in sorted(out.glob(pattern)) for e in json_log_entries(path)]


def text(out: Path, pattern: str) -> str:
    return "".join(path.read_text(errors="replace") for path in sorted(out.glob(pattern)))


def endpoint(out: Path) -> str:
    """The members' endpoint list the recipe's ``unicron slurm etcd`` step printed."""
    log = out / "batch.log"
    found = wait_for(lambda: log.exists() and re.search(r"--rdzv-endpoint=(\S+)", log.read_text()), 120,
                     why="the etcd members ready")
    return found.group(1)


#: What a survivor's agent logs when the survivor was *behind*: its step's last all-reduce failed on it but
#: completed on the others, who stepped their optimizer (a node lost at any instant may do that); it is
#: left out of the record of the newest step and restarted to rejoin from a replica (docs/strategy.md
#: "Failures inside a step"). The one case where a survivor restarts.
BEHIND = re.compile(r"rank (\d+) \(step (\d+)\) was left out of generation \d+ \(members \[[^\]]*\], step (\d+)\)")


def behind(out: Path) -> list[int]:
    """The ranks restarted because they were behind the newest step's members (see :data:`BEHIND`)."""
    return sorted({int(m[1]) for e in entries(out) if e["event"] == "worker_rejoining"
                   and (m := BEHIND.search(e.get("reason", ""))) and int(m[2]) < int(m[3])})


def check_survivors(out: Path, survivors: list[int], lost: list[int]) -> None:
    """No survivor restarted, except one behind; each trained every step, one recovered without the lost ranks."""
    late = behind(out)
    assert sorted({e["rank"] for e in entries(out) if e["event"] == "worker_restarted"}) == late  # nobody else
    assert set(late) <= set(survivors), (late, survivors)
    summaries = {r: json.loads((out / f"rank{r}.json").read_text()) for r in survivors}
    for r in survivors:
        assert summaries[r]["global_step"] == STEPS
        if r in late:  # restarted after the loss, it rejoined from a replica
            assert summaries[r]["state_from"] == "replica" and summaries[r]["joined_at"] is not None, summaries[r]
            continue
        assert summaries[r]["joined_at"] is None
        failed = [x for x in summaries[r]["reports"] if x["recoveries"]]
        assert len(failed) == 1 and failed[0]["dead"] == sorted(lost + late), failed


def same_params(out: Path, rank: int, baseline: list[torch.Tensor]) -> bool:
    params = torch.load(out / f"params{rank}.pt")
    return len(params) == len(baseline) and all(torch.equal(a, b) for a, b in zip(params, baseline))


def ranks_of(out: Path, node: str) -> list[int]:
    """The ranks of ``node`` (one worker a node: its place in the round, from its launcher's log)."""
    return sorted({e["group_rank"] for e in entries(out) if e["event"] == "agent_rendezvous_complete"
                   and e["node"] == node})


def stall_after(out: Path, ranks: list[int], killed_at: float) -> float:
    """Seconds from the kill to the survivors' next completed step."""
    return min(next(t["t"] for t in times(out, r) if t["t"] > killed_at) for r in ranks) - killed_at


@pytest.mark.timeout(900)
def test_a_lost_node_costs_the_survivors_one_ttl_nobody_restarts_and_the_node_joins_again(
        slurm, tmp_path: Path, gpt_baseline) -> None:
    out = tmp_path / "out"
    hold = ("--hold-for-joiner", "11", "--hold-ranks", "3")  # before step 11, wait (bounded) for the returning node
    job = submit(slurm, out, *TRAIN, *hold)
    members = endpoint(out)
    leader = slurm.etcd_leader(members)
    victim = "n3" if leader != "n3" else "n2"  # not the batch host (SLURM ends a job whose batch host is lost)
    wait_for(lambda: all(len(times(out, r)) >= 3 for r in range(3)), 300, why="three steps on every node")
    slurm.kill_node(victim)  # slurmd, slurmstepd, unicron-run, its worker and the etcd member on it
    killed_at = slurm.killed_at[victim]
    lost = ranks_of(out, victim)
    survivors = [r for r in range(3) if r not in lost]
    wait_for(lambda: all(any(t["t"] > killed_at for t in times(out, r)) for r in survivors), 120,
             why="the survivors' next step")
    stall = stall_after(out, survivors, killed_at)

    # the node comes back: its slurmd again, back in service, and a job on it joins the run in its place
    slurm.start_node(victim)
    step = next(e for e in entries(out) if e["event"] == "slurm_step")
    joiner = slurm.sbatch(
        f"--chdir={REPO}", "-N1", f"--nodelist={victim}", "--no-kill", "-o", str(out / "join-batch.log"), "--wrap",
        f"srun --ntasks-per-node=1 --no-kill --kill-on-bad-exit=0 --output={out}/join-node.log "
        f"unicron-run --slurm --nnodes=2:3 --nproc-per-node=1 --rdzv-endpoint={members} --rdzv-id={step['run_id']} "
        f"--rdzv-conf=request_timeout=1 --log-format=json --monitor-interval=0.05 {GPT} --out {out} "
        f"--preemption-checkpoint {out}/preempted.ckpt {' '.join(TRAIN)} {' '.join(hold)}",
        env=_env(out))
    record = ended(slurm, job)
    ended(slurm, joiner, 120)
    logs = "".join(p.read_text()[-2000:] for p in out.glob("*.log"))
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", logs
    assert stall <= NODE_TTL + 1, f"survivors stalled {stall:.2f} s (target: node TTL + 1 = {NODE_TTL + 1} s)"
    print(f"\nlost node {victim} (an etcd follower's node): survivors' stall {stall:.3f} s")
    check_survivors(out, survivors, lost)  # nobody restarted (unless behind)
    lost_events = [e for e in entries(out) if e["event"] == "error_event" and e.get("kind") == "lost_connection"]
    assert lost_events and {e["message"] for e in lost_events} == {f"lease of node {victim} expired"}
    summaries = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(3)}
    for r in lost:  # the returning node's rank took its place and joined from a replica
        assert summaries[r]["state_from"] == "replica" and 3 < summaries[r]["joined_at"] < STEPS, summaries[r]
    for r in range(3):
        assert same_params(out, r, gpt_baseline), f"rank {r} diverged"


@pytest.mark.timeout(900)
def test_losing_the_node_of_the_etcd_leader_restarts_nobody(slurm, tmp_path: Path, gpt_baseline) -> None:
    out = tmp_path / "out"
    job = submit(slurm, out, *TRAIN, "--hold-for-joiner", str(STEPS - 2), "--hold-ranks", "2")  # (for a rank behind)
    members = endpoint(out)
    if slurm.etcd_leader(members) != "n3":
        slurm.move_etcd_leader(members, "n3")
    wait_for(lambda: all(len(times(out, r)) >= 3 for r in range(3)), 300, why="three steps on every node")
    slurm.kill_node("n3")
    killed_at = slurm.killed_at["n3"]
    survivors = [r for r in range(3) if r not in ranks_of(out, "n3")]
    wait_for(lambda: all(any(t["t"] > killed_at for t in times(out, r)) for r in survivors), 120,
             why="the survivors' next step")
    assert slurm.etcd_leader(members) in ("n1", "n2")  # the store lost its leader and a survivor's member leads
    record = ended(slurm, job)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", (out / "batch.log").read_text()[-3000:]
    late = behind(out)
    assert len(survivors) == 2 and all(len(times(out, r)) == STEPS for r in survivors if r not in late)
    stall = stall_after(out, survivors, killed_at)
    print(f"\nlost node n3 (the etcd leader's node): survivors' stall {stall:.3f} s")
    # an election, then the lost node's lease (which the new leader extends) expires: more than a TTL
    assert stall <= NODE_TTL + 3, stall
    check_survivors(out, survivors, ranks_of(out, "n3"))  # nobody restarted (unless behind)
    for r in survivors:
        assert same_params(out, r, gpt_baseline), f"rank {r} diverged"


@pytest.mark.timeout(900)
def test_a_drained_node_leaves_at_a_step_boundary_and_nobody_sees_a_failure(
        slurm, etcd: EmbeddedEtcd, tmp_path: Path, gpt_baseline) -> None:
    out, cluster = tmp_path / "out", "slurm-drain"
    job = submit(slurm, out, *TRAIN, run_flags=f"--slurm-poll=0.5 --rdzv-conf=cluster={cluster}",
                 UNICRON_ETCD=etcd.endpoint)  # a site etcd: the test reads the events after the job
    wait_for(lambda: all(len(times(out, r)) >= 3 for r in range(3)), 300, why="three steps on every node")
    slurm.drain("n3")
    record = ended(slurm, job)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", (out / "batch.log").read_text()[-3000:]
    assert "DRAIN" in slurm.node_flags("n3")
    drained = [e for e in entries(out) if e["event"] == "slurm_node_drained"]
    assert [e["node"] for e in drained] == ["n3"]
    assert [e for e in entries(out) if e["event"] == "leaving_task"]
    with StatusStore(EtcdConfig(host="127.0.0.1", port=etcd.client_port, cluster=cluster)) as store:
        assert store.get_prefix(store.keys.events()) == []  # no failure event at all
    summaries = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(3)}
    left = [r for r, s in summaries.items() if s["retired_at"] is not None]
    assert len(left) == 1 and 3 <= summaries[left[0]]["retired_at"] < STEPS  # at a step boundary
    for r, summary in summaries.items():
        assert all(not x["recoveries"] and not x["dead"] for x in summary["reports"])  # nobody saw a failure
        if r not in left:
            assert summary["joined_at"] is None and summary["global_step"] == STEPS
            assert same_params(out, r, gpt_baseline), f"rank {r} diverged"


@pytest.mark.timeout(900)
def test_the_warning_signal_checkpoints_the_step_requeues_the_job_and_the_requeued_job_resumes_after_it(
        slurm, tmp_path: Path, gpt_baseline) -> None:
    out = tmp_path / "out"
    job = submit(slurm, out, *TRAIN)
    wait_for(lambda: all(len(times(out, r)) >= 4 for r in range(3)), 300, why="four steps on every node")
    slurm.run("scancel", "--batch", "--signal=USR1", job)  # what --signal=B:USR1@120 sends the batch shell
    saved = wait_for(lambda: re.search(r"preemption_checkpoint_saved\s+next_step=(\d+)", text(out, "node-*.log")), 120,
                     why="the preemption checkpoint")  # (a worker's line)
    resume_at = int(saved.group(1))
    # SLURM holds a requeued job back for a credential's lifetime (the loopback cluster's: 10 s), then starts it
    record = ended(slurm, job)
    batch = (out / "batch.log").read_text()
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0" and record["Restarts"] == "1", batch
    assert f"requeued job {job}" in batch
    stops = [e for e in entries(out) if e["event"] == "stopped_by_signal"]
    assert len(stops) == 3 and {e["signal"] for e in stops} == {"SIGUSR1"}  # every node stopped, none killed
    check_resumed_after(out, resume_at, job, gpt_baseline)


def check_left_cleanly(out: Path, etcd: EmbeddedEtcd, cluster: str, node: str, baseline: list[torch.Tensor],
                       failed: tuple[int, ...] = ()) -> list[int]:
    """``node`` was drained: its rank retired at a step boundary, no failure event (but those of the ranks
    ``failed`` on purpose), the others equal the baseline.

    Returns:
        The ranks that retired.
    """
    assert [e["node"] for e in entries(out) if e["event"] == "slurm_node_drained"] == [node]
    assert [e for e in entries(out) if e["event"] == "leaving_task"]
    assert not [e for e in entries(out) if e["event"] in ("leave_by_stopping", "stopped_by_signal")]
    with StatusStore(EtcdConfig(host="127.0.0.1", port=etcd.client_port, cluster=cluster)) as store:
        events = [ErrorEvent.from_json(kv.value) for kv in store.get_prefix(store.keys.events())]
    assert {e.rank for e in events} == set(failed), events  # the drain is no failure: no lost node, no stop
    summaries = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(3)}
    # a worker that trained retires at a step boundary; one restarted meanwhile does not join at all
    left = [r for r, summary in summaries.items() if summary["retired_at"] is not None or not summary["trained"]]
    assert left == ranks_of(out, node), (left, summaries)
    for r, summary in summaries.items():
        if r not in left:
            assert summary["global_step"] == STEPS
            assert same_params(out, r, baseline), f"rank {r} diverged"
    return left


def _drain_event_before(out: Path, node: str, event: str) -> bool:
    """Whether ``node``'s launcher saw its drain before it logged ``event``."""
    mine = [e for e in entries(out) if e.get("node") == node or e.get("node_name") == node]
    names = [e["event"] for e in mine]
    return "slurm_node_drained" in names and (event not in names or
                                              names.index("slurm_node_drained") < names.index(event))


@pytest.mark.timeout(900)
def test_a_node_drained_while_the_rendezvous_forms_takes_no_part_and_exits_0(
        slurm, etcd: EmbeddedEtcd, tmp_path: Path, gpt_baseline) -> None:
    """Drained as the job starts: its launcher sees it at its first look, while it waits for a round, and ends
    with exit code 0 (never 143); the other two nodes form the round without it and train to the failure-free
    parameters (the same global batch), and nobody records a failure."""
    out, cluster = tmp_path / "out", "slurm-drain-rdzv"
    job = submit(slurm, out, *TRAIN, run_flags=f"--slurm-poll=0.5 --rdzv-conf=cluster={cluster}",
                 UNICRON_ETCD=etcd.endpoint)
    wait_for(lambda: slurm.job(job).get("JobState") == "RUNNING", 120, why="the job started")
    slurm.drain("n3")
    record = ended(slurm, job)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", (out / "batch.log").read_text()[-3000:]
    assert _drain_event_before(out, "n3", "agent_rendezvous_complete"), "the drain came after the rendezvous"
    mine = [e["event"] for e in entries(out) if e.get("node") == "n3" or e.get("node_name") == "n3"]
    assert "agent_rendezvous_complete" not in mine and ranks_of(out, "n3") == []
    assert [e for e in entries(out) if e["event"] == "left_before_training"]
    assert not [e for e in entries(out) if e["event"] in ("stopped_by_signal", "leave_by_stopping")]
    with StatusStore(EtcdConfig(host="127.0.0.1", port=etcd.client_port, cluster=cluster)) as store:
        assert store.get_prefix(store.keys.events()) == []  # no failure event at all
    for r in range(2):  # the round of the two others
        summary = json.loads((out / f"rank{r}.json").read_text())
        assert summary["global_step"] == STEPS and summary["joined_at"] is None
        assert all(not x["recoveries"] and not x["dead"] for x in summary["reports"])
        assert same_params(out, r, gpt_baseline), f"rank {r} diverged"
    assert not (out / "rank2.json").exists()


@pytest.mark.timeout(900)
def test_a_node_drained_while_its_worker_restarts_leaves_with_exit_0(
        slurm, etcd: EmbeddedEtcd, tmp_path: Path, gpt_baseline) -> None:
    """Rank 2's worker is killed at step 4; its node is drained while the agent restarts it (a one-worker node:
    its whole group restarts). The new worker does not rejoin for one step only: it leaves, exit 0."""
    from unicron_elastic.testing import fail_at, faults_env

    out, cluster = tmp_path / "out", "slurm-drain-restart"
    # Plain subprocesses: the drain must land while the worker restarts, which takes seconds cold; a warm
    # worker is back in 0.03 s and rejoins before the drain is seen.
    job = submit(slurm, out, *TRAIN, run_flags=f"--slurm-poll=0.5 --rdzv-conf=cluster={cluster} --no-preload",
                 UNICRON_ETCD=etcd.endpoint, **faults_env([fail_at(rank=2, step=4, bucket=0)],
                                                          str(out / "faults.log")))
    wait_for(lambda: (out / "faults.log").exists() and (out / "faults.log").read_text().strip(), 300,
             why="the worker killed")
    [node] = [name for name in slurm.names if ranks_of(out, name) == [2]]
    slurm.drain(node)
    record = ended(slurm, job)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", (out / "batch.log").read_text()[-3000:]
    assert [e["rank"] for e in entries(out) if e["event"] == "worker_restarted"] == [2]
    assert _drain_event_before(out, node, "leaving_task")
    check_left_cleanly(out, etcd, cluster, node, gpt_baseline, failed=(2,))
    assert "dp_join_skipped" in text(out, "node-*.log")  # the restarted worker was asked to leave: it did not join


def check_resumed_after(out: Path, resume_at: int, job: str, baseline: list[torch.Tensor]) -> None:
    """Each step trained once (the first run's up to ``resume_at``, then the requeued run's), parameters equal."""
    for r in range(3):
        steps = [t["step"] for t in times(out, r)]
        assert steps == list(range(STEPS)), steps
        assert steps.index(resume_at) > 0 and all(t["step"] < resume_at for t in times(out, r)[:resume_at])
        assert same_params(out, r, baseline), f"rank {r} diverged"
    resumed = [e for e in entries(out, "node-*.log") if e["event"] == "slurm_step" and e["restart_count"] == 1]
    assert len(resumed) == 3 and {e["run_id"] for e in resumed} == {f"{job}-1"}  # a new run of the same job


@pytest.mark.timeout(900)
def test_a_preempted_job_checkpoints_is_requeued_and_resumes_after_the_checkpoint(
        slurm, tmp_path: Path, gpt_baseline) -> None:
    """SLURM's own preemption (partition_prio, PreemptMode=REQUEUE): a job of the higher partition takes a node;
    SLURM sends the training job's steps SIGTERM (not its batch shell) and keeps it RUNNING for its GraceTime.
    The store is the recipe's own members inside the allocation: SLURM's SIGTERM reaches their etcd processes
    too, which exit; each member starts its etcd again on its data dir, and the launchers' stop and checkpoint
    find the store (docs/slurm.md, "Preemption and the time limit")."""
    out = tmp_path / "out"
    job = submit(slurm, out, *TRAIN, sbatch_flags=("--cpus-per-task=1",), OMP_NUM_THREADS="")  # (the recipe sets
    wait_for(lambda: all(len(times(out, r)) >= 4 for r in range(3)), 300, why="four steps on every node")  # threads)
    urgent = slurm.sbatch("--partition=high", "--nodes=1", "-o", str(tmp_path / "urgent.log"), "--wrap", "sleep 1")
    saved = wait_for(lambda: re.search(r"preemption_checkpoint_saved\s+next_step=(\d+)", text(out, "node-*.log")), 120,
                     why="the preemption checkpoint")
    record = ended(slurm, job)
    batch = (out / "batch.log").read_text()
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0" and record["Restarts"] == "1", batch
    assert f"requeued job {job}" in batch and '"reason": "preempted"' in batch
    # SLURM's SIGTERM reached the members' etcd processes, and the store came back for the stop: a member was
    # started again, none failed, and every launcher stopped on the signal (143, not 1: the store was there)
    assert "slurm_etcd_member_restarted" in batch and "slurm_etcd_member_exited" not in batch, batch
    assert batch.count("Exited with exit code 143") == 3, batch
    assert slurm.job(urgent)["JobState"] == "COMPLETED"  # the preempting job ran
    threads = [e for e in entries(out) if e["event"] == "slurm_threads"]  # both runs: 3 nodes each
    assert len(threads) == 6 and {(e["omp_num_threads"], e["cpus_per_task"]) for e in threads} == {(1, "1")}
    stops = [e for e in entries(out) if e["event"] == "stopped_by_signal"]
    assert len(stops) == 3 and {e["signal"] for e in stops} == {"SIGTERM"}  # every node stopped, none killed
    check_resumed_after(out, int(saved.group(1)), job, gpt_baseline)


@pytest.mark.timeout(1500)
def test_each_task_of_an_array_resumes_from_its_own_checkpoint_and_refuses_anothers(
        slurm, etcd: EmbeddedEtcd, tmp_path: Path, gpt_baseline) -> None:
    """``sbatch --array=0-1`` of the recipe as a user types it (no UNICRON_OUT): each task writes to
    ``unicron-gpt-<array job>_<task>``; each is preempted once, checkpoints, is requeued and resumes from its own
    checkpoint to the failure-free parameters. A job given task 0's folder refuses its checkpoint. On a site
    etcd (the preemption test runs the members inside the allocation)."""
    env = dict(_env(tmp_path, "--rdzv-conf=cluster=slurm-array"), UNICRON_SCRIPT=GPT, UNICRON_ETCD=etcd.endpoint,
               UNICRON_SRUN_FLAGS=f"--output={tmp_path}/node-%A_%a-%t.log --open-mode=append")
    del env["UNICRON_OUT"]
    array = slurm.sbatch(f"--chdir={tmp_path}", "--array=0-1", "-o", str(tmp_path / "batch-%A_%a.log"), RECIPE,
                         *TRAIN, env=env)
    tasks = [f"{array}_{i}" for i in range(2)]
    outs = [tmp_path / f"unicron-gpt-{task}" for task in tasks]
    for task, out in zip(tasks, outs):  # (one task at a time: each needs the three nodes)
        wait_for(lambda: all(len(times(out, r)) >= 4 for r in range(3)), 600, why=f"four steps of task {task}")
        slurm.sbatch("--partition=high", "--nodes=1", "-o", str(tmp_path / f"urgent-{task}.log"), "--wrap", "sleep 1")
        wait_for(lambda: "preemption_checkpoint_saved" in text(tmp_path, f"node-{task}-*.log"), 120,
                 why=f"task {task}'s preemption checkpoint")
    for task, out in zip(tasks, outs):
        record = ended(slurm, task, seconds=600)
        assert record["JobState"] == "COMPLETED" and record["Restarts"] == "1", \
            (tmp_path / f"batch-{task}.log").read_text()[-3000:]
        assert (out / "preempted.ckpt").exists()
        for r in range(3):
            assert [t["step"] for t in times(out, r)] == list(range(STEPS))  # each step once: its own checkpoint
            assert same_params(out, r, gpt_baseline), f"task {task} rank {r} diverged"
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    job = slurm.sbatch(f"--chdir={REPO}", "-o", str(foreign / "batch.log"), RECIPE, *TRAIN,
                       env=dict(_env(foreign), UNICRON_OUT=str(outs[0])))  # (its node logs in foreign/)
    record = ended(slurm, job)
    assert record["JobState"] == "FAILED", record
    assert f"was written by SLURM job {tasks[0]}" in text(foreign, "node-*.log")


@pytest.mark.timeout(600)
def test_a_cancelled_job_is_not_requeued(slurm, tmp_path: Path) -> None:
    out = tmp_path / "out"
    job = submit(slurm, out, *TRAIN)
    wait_for(lambda: all(len(times(out, r)) >= 2 for r in range(3)), 300, why="two steps on every node")
    slurm.run("scancel", job)
    record = ended(slurm, job)
    batch = (out / "batch.log").read_text()
    assert record["JobState"] == "CANCELLED" and record["Restarts"] == "0", batch
    assert "requeued job" not in batch
    assert all(len(times(out, r)) < STEPS for r in range(3))  # (it did not run to the end meanwhile)


POOL_STEPS = 8


@pytest.fixture(scope="session")
def pool_baseline(failure_free) -> list[torch.Tensor]:
    def reference_run(out: Path) -> list[torch.Tensor]:
        run = subprocess.run([os.path.join(BIN, "unicron-run"), "--standalone", "--nproc-per-node=2", GPT,
                              "--steps", str(POOL_STEPS), "--out", str(out)], capture_output=True, text=True,
                             timeout=400, env=dict(os.environ, OMP_NUM_THREADS="1"))  # (as the pool's tasks)
        assert run.returncode == 0, run.stderr[-3000:]
        for rank in range(2):  # failure-free indeed
            summary = json.loads((out / f"rank{rank}.json").read_text())
            assert summary["trained"] and summary["global_step"] == POOL_STEPS and summary["joined_at"] is None
        return torch.load(out / "params0.pt")

    return failure_free("test_slurm_e2e.pool_baseline", reference_run)


def _spec(name: str, out: Path, weight: float, table: dict, most: int, *extra: str) -> str:
    command = [sys.executable, GPT, "--steps", str(POOL_STEPS), "--out", str(out), "--record-times",
               "--load-delay", "0.05", *extra]
    return json.dumps(dict(name=name, command=command, weight=weight, min_workers=1, max_workers=most,
                           global_batch=24, model={"calibration": table}))


@pytest.mark.timeout(900)
def test_the_coordinators_pool_on_slurm_moves_a_drained_nodes_share_and_both_tasks_finish(
        slurm, etcd: EmbeddedEtcd, tmp_path: Path, pool_baseline) -> None:
    cluster, out_a, out_b = "slurm-pool", tmp_path / "a", tmp_path / "b"
    config = EtcdConfig(host="127.0.0.1", port=etcd.client_port, cluster=cluster)
    pool = slurm.sbatch(f"--chdir={REPO}", "-o", str(tmp_path / "pool.log"), os.path.join(REPO, "examples", "slurm",
                                                                                          "pool.sbatch"),
                        env=_env(tmp_path, UNICRON_ETCD=etcd.endpoint, UNICRON_CLUSTER=cluster,
                                 UNICRON_NODE_FLAGS="--slurm-poll=0.5 --launcher-arg=--monitor-interval=0.05"))
    with StatusStore(config) as store:
        wait_for(lambda: sorted(kv.key.rsplit("/", 1)[-1] for kv in store.get_prefix(store.keys.nodes()))
                 == ["n1", "n2", "n3"], 120, why="the pool's three nodes registered under SLURM's names")
        a_done = tmp_path / "a-done"  # b ends after a, whatever the timing
        a_release = tmp_path / "a-release"  # a holds before its step 6 until its drained node's rank was asked to leave
        store.put(store.keys.task_spec("a"), _spec("a", out_a, 1.0, {"1": 1.0, "2": 1.8}, 2, "--hold-until",
                                                   str(a_release), "--hold-step", str(POOL_STEPS - 2)))
        store.put(store.keys.task_spec("b"), _spec("b", out_b, 2.0, {"1": 1.0}, 1, "--hold-until", str(a_done),
                                                   "--hold-step", "5"))
        plan = wait_for(lambda: (p := read_plan(store)) and len(p.tasks) == 2 and p, 120, why="the first plan")
        assert {n: len(t.nodes) for n, t in plan.tasks.items()} == {"a": 2, "b": 1}
        wait_for(lambda: any(len(times(out_a, r)) >= 2 for r in range(2)), 300, why="task a at step 2")
        victim = plan.tasks["a"].nodes[-1]
        slurm.drain(victim)
        moved = wait_for(lambda: (p := read_plan(store)) and victim not in p.nodes and p, 120,
                         why="the plan without the drained node")
        assert {n: len(t.nodes) for n, t in moved.tasks.items() if n in ("a", "b")} == {"a": 1, "b": 1}
        assert "left" in moved.reason and "lost" not in moved.reason, moved.reason
        wait_for(lambda: "leaving_task" in (tmp_path / "pool.log").read_text(), 120, why="the drained rank leaving")
        a_release.touch()  # (the run could not end before the leave was asked: its leader sees it at a boundary)
        wait_for(lambda: "a" in read_plan(store).finished, 400, why="task a finished")
        a_done.touch()
        wait_for(lambda: "b" in read_plan(store).finished, 400, why="task b finished")
        events = [ErrorEvent.from_json(kv.value) for kv in store.get_prefix(store.keys.events())]
    assert slurm.job(pool)["JobState"] == "RUNNING"  # the pool stays for more tasks (the test's end cancels it)
    assert not [e for e in events if e.severity is Severity.SEV1], events  # a drain is not a failure
    drained = [e for e in json_log_entries(tmp_path / "pool.log") if e["event"] == "node_drained"]
    assert [e["node"] for e in drained] == [victim]
    a = {int(p.stem[4:]): json.loads(p.read_text()) for p in out_a.glob("rank*.json")}
    left = [r for r, s in a.items() if s["retired_at"] is not None]
    assert len(left) == 1 and all(not x["dead"] for s in a.values() for x in s["reports"])  # no failure seen
    for r, summary in a.items():
        if r not in left:
            assert summary["joined_at"] is None and summary["global_step"] == POOL_STEPS
            assert all(torch.equal(x, y) for x, y in zip(torch.load(out_a / f"params{r}.pt"), pool_baseline)), \
                f"task a rank {r} diverged"
    b = json.loads((out_b / "rank0.json").read_text())
    assert b["global_step"] == POOL_STEPS and b["joined_at"] is None
    assert all(torch.equal(x, y) for x, y in zip(torch.load(out_b / "params0.pt"), pool_baseline))
