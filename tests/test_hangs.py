"""Ranks and nodes that stop answering without dying: real ``unicron-run`` launchers, real etcd, default detectors.

A hung worker is SIGSTOPped in-band (fault kind ``stop``: silent, its
connections open); a frozen node is its launcher's whole process tree
SIGSTOPped (``stop_node``: no reset reaches the peers), resumed later with
SIGCONT. Each test trains ``examples/lightning_gpt.py`` and asserts that the
fault fired, that survivors kept their processes (their PIDs are the ones
running when the fault fired), never went back a step, and end with the
parameters of a failure-free run; that only the hung worker was restarted
(it rejoins from a replica); and that a frozen node costs the survivors at
most the node TTL plus one second.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conftest import BIN, EXAMPLES
from unicron_elastic.store import EmbeddedEtcd
from unicron_elastic.testing import Fault, fail_at, faults_env, kill_node, process_tree, signal_tree

GPT = os.path.join(EXAMPLES, "lightning_gpt.py")
STEPS, FAULT_STEP, STEP_TIME, TTL = 20, 7, 0.3, 2  # the fault after the hang detector's warmup (5 steps)
ARGS = ["--steps", str(STEPS), "--step-time", str(STEP_TIME), "--record-times"]
HOLD = ["--hold-for-joiner", "15"]  # a restarted worker rejoins before the end, however slowly it starts


@pytest.fixture(scope="session")
def baseline(failure_free) -> list[torch.Tensor]:
    """The failure-free parameters (they do not depend on the number of ranks: the global batch is fixed)."""
    def reference_run(out: Path) -> list[torch.Tensor]:
        cmd = [os.path.join(BIN, "unicron-run"), "--standalone", "--nproc-per-node=2", GPT, *ARGS[:2], "--out", str(out)]
        proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                              timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return torch.load(out / "params0.pt")

    return failure_free("test_hangs.baseline", reference_run)


def _env(out: Path, faults: list[Fault]) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PATH=BIN + os.pathsep + os.environ["PATH"],
                **faults_env(faults, str(out / "faults.log")))


def _start(out: Path, faults: list[Fault], nodes: int, per_node: int, etcd: EmbeddedEtcd | None,
           run_id: str, *extra: str, launcher_args: tuple[str, ...] | list[str] = ()) -> list[subprocess.Popen]:
    out.mkdir(parents=True, exist_ok=True)
    where = (["--standalone"] if etcd is None else
             [f"--rdzv-endpoint={etcd.endpoint}", f"--rdzv-id={run_id}", f"--nnodes={nodes}",
              f"--rdzv-conf=cluster={run_id},keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=1"])
    cmd = [os.path.join(BIN, "unicron-run"), *where, f"--nproc-per-node={per_node}", "--monitor-interval=0.05",
           "--log-format=json", f"--node-ttl={TTL}", *launcher_args, GPT, *ARGS, "--out", str(out), *extra]
    return [subprocess.Popen(cmd, stdout=(out / f"node{i}.log").open("w"), stderr=subprocess.STDOUT,
                             env=_env(out, faults)) for i in range(nodes)]


def _wait(condition: Callable[[], object], launchers: list[subprocess.Popen], what: str, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not in {seconds} s"
        time.sleep(0.02)


def _fired(out: Path) -> list[dict]:
    log = out / "faults.log"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _workers(launchers: list[subprocess.Popen]) -> set[int]:
    return set().union(*(_rank_processes(p) for p in launchers))


def _rank_processes(launcher: subprocess.Popen) -> set[int]:
    """The processes below ``launcher`` that hold a rank (``RANK`` in their environment): not a spare of the warm
    pool, which is forked ahead of need and holds none until it becomes a restarted rank."""
    return {pid for pid in process_tree(launcher.pid)[1:] if _ranks_in(pid)}


def _ranks_in(pid: int) -> set[int]:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return set()
    return {int(v[5:]) for v in env if v.startswith(b"RANK=")}


def _node_of(pid: int, launchers: list[subprocess.Popen]) -> int:
    return next(i for i, p in enumerate(launchers) if pid in process_tree(p.pid))


def _ranks_of(launcher: subprocess.Popen) -> set[int]:
    """The ranks of the workers below ``launcher`` (their ``RANK``)."""
    return set().union(*(_ranks_in(pid) for pid in process_tree(launcher.pid)[1:]))


def _steps_done(out: Path, rank: int) -> int:
    path = out / f"times{rank}.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _finish(launchers: list[subprocess.Popen], timeout: float = 180) -> list[int | None]:
    """Every launcher's exit code (none left running: a launcher still running is killed, code None)."""
    codes: list[int | None] = []
    try:
        for p in launchers:
            try:
                codes.append(p.wait(timeout=timeout))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for p in launchers:
            if p.poll() is None:
                signal_tree(p.pid, signal.SIGCONT)
                kill_node(p.pid)
    return codes


def _through_the_fault(out: Path, launchers: list[subprocess.Popen]) -> tuple[set[int], list[int | None]]:
    """The processes running when the fault fired, and every launcher's exit code once the run ended."""
    try:
        _wait(lambda: _fired(out), launchers, "the fault")
        before = _workers(launchers)
    finally:
        codes = _finish(launchers)
    return before, codes


def _log(out: Path) -> str:
    return "".join(path.read_text() for path in sorted(out.glob("node*.log")))


def _events(out: Path, name: str) -> list[dict]:
    found = []
    for line in _log(out).splitlines():
        if line.startswith("{") and f'"{name}"' in line:
            entry = json.loads(line)
            if entry.get("event") == name:
                found.append(entry)
    return found


def _summary(out: Path, rank: int) -> dict:
    return json.loads((out / f"rank{rank}.json").read_text())


def assert_survivors(out: Path, survivors: list[int], before: set[int], baseline: list[torch.Tensor]) -> None:
    """Same processes as when the fault fired, every step once and in order, the failure-free parameters."""
    for rank in survivors:
        done = _summary(out, rank)
        assert done["pid"] in before, f"rank {rank} was restarted"
        assert done["joined_at"] is None and done["state_from"] is None
        assert [rep["step"] for rep in done["reports"]] == list(range(STEPS))  # never back a step
        for ours, ref in zip(torch.load(out / f"params{rank}.pt"), baseline):
            torch.testing.assert_close(ours, ref)


def stall(out: Path, rank: int) -> float:
    """Seconds the longest step of ``rank`` took beyond its median step."""
    times = [json.loads(line)["t"] for line in (out / f"times{rank}.jsonl").read_text().splitlines()]
    gaps = [b - a for a, b in zip(times, times[1:])]
    return max(gaps) - statistics.median(gaps)


@pytest.mark.compat  # (in CI by the compat selection only; the e2e tier hangs a worker of a two-node job)
@pytest.mark.matrix
@pytest.mark.timeout(300)
def test_a_hung_worker_alone_is_restarted_and_rejoins_from_a_replica(tmp_path: Path, baseline) -> None:
    """One node, 3 ranks; rank 2 SIGSTOPped in its micro-batch: its agent restarts it, the others wait, saying so."""
    launchers = _start(tmp_path, [fail_at(rank=2, step=FAULT_STEP, micro_batch=5, kind="stop")], 1, 3, None, "h",
                       *HOLD)
    before, codes = _through_the_fault(tmp_path, launchers)
    assert codes == [0], _log(tmp_path)[-4000:]
    assert_survivors(tmp_path, [0, 1], before, baseline)
    assert [e["rank"] for e in _events(tmp_path, "error_event") if e["kind"] == "task_hang"] == [2]
    assert [e["rank"] for e in _events(tmp_path, "worker_restarted")] == [2]
    joiner = _summary(tmp_path, 2)
    assert joiner["state_from"] == "replica" and FAULT_STEP < joiner["joined_at"] < STEPS
    assert joiner["pid"] != _fired(tmp_path)[0]["pid"]


@pytest.mark.matrix  # (the e2e tier's hangs: tests/test_progress_hangs.py)
@pytest.mark.timeout(300)
def test_a_hung_worker_of_a_two_node_job_alone_is_restarted(etcd: EmbeddedEtcd, tmp_path: Path, baseline) -> None:
    launchers = _start(tmp_path, [fail_at(rank=3, step=FAULT_STEP, bucket=0, kind="stop")], 2, 2, etcd, "h2",
                       *HOLD)
    before, codes = _through_the_fault(tmp_path, launchers)
    assert codes == [0, 0], _log(tmp_path)[-4000:]
    assert_survivors(tmp_path, [0, 1, 2], before, baseline)
    assert [e["rank"] for e in _events(tmp_path, "worker_restarted")] == [3]
    assert _summary(tmp_path, 3)["state_from"] == "replica"


@dataclass(frozen=True)
class Freeze:
    """A node frozen, then resumed: which launcher, its ranks and processes then, and where its log was."""

    launcher: int
    ranks: set[int]
    stale: set[int]  # its ranks' processes when it froze: the incarnation the group gave up
    resumed_at: float  # wall time of the SIGCONT
    log_offset: int  # bytes of its launcher's log at the SIGCONT (a frozen process writes nothing)


def _freeze_and_resume(out: Path, launchers: list[subprocess.Popen],
                       kill_rank: int | None = None) -> tuple[int, list[int], set[int], Freeze]:
    """Wait for the node freeze; optionally kill the node of ``kill_rank``; SIGCONT the frozen one 3 steps later.

    By then the frozen node's lease has lapsed (3 steps are longer than the TTL after the survivors' stall).

    Returns:
        The frozen launcher, the surviving ranks, the processes running when the fault fired, and the freeze.
    """
    _wait(lambda: _fired(out), launchers, "the freeze")
    frozen = _node_of(_fired(out)[0]["pid"], launchers)
    before = _workers(launchers)
    stale = _rank_processes(launchers[frozen])
    ranks = [_ranks_of(p) for p in launchers]
    lost = set(ranks[frozen])
    if kill_rank is not None:
        killed = next(i for i, held in enumerate(ranks) if kill_rank in held)
        lost |= ranks[killed]
        kill_node(launchers[killed].pid)
    survivors = sorted(set().union(*ranks) - lost)
    _wait(lambda: _steps_done(out, survivors[0]) >= FAULT_STEP + 3, launchers, "the survivors' progress")
    offset = (out / f"node{frozen}.log").stat().st_size
    resumed_at = time.time()
    signal_tree(launchers[frozen].pid, signal.SIGCONT)  # the partition heals
    return frozen, survivors, before, Freeze(frozen, set(ranks[frozen]), stale, resumed_at, offset)


def _saved_steps(text: str, event: str) -> list[int]:
    """The steps of every ``event`` (``snapshot_saved``, ``checkpoint_saved``) in a log, JSON or console lines."""
    steps = []
    for line in text.splitlines():
        if event not in line:
            continue
        if line.startswith("{"):
            entry = json.loads(line)
            if entry.get("event") == event and isinstance(entry.get("step"), int):
                steps.append(entry["step"])
        elif match := re.search(rf"\b{event}\b.*?\bstep=(\d+)", line):
            steps.append(int(match.group(1)))
    return steps


def assert_fenced(out: Path, freeze: Freeze, code: int | None) -> None:
    """The frozen node's stale incarnation, resumed after its lease lapsed, completed nothing of the group's.

    No step (no collective of the group) completed by a stale process after
    the freeze; no snapshot or checkpoint of the stale state (a step up to the
    one in flight at the freeze) saved after the resume; no result written by
    a stale process: a frozen rank's ``rank<R>.json`` comes from a later
    incarnation that rejoined (after the freeze) or trained nothing, or there
    is none and its launcher did not end as if it had finished (its agent gave
    the node up, exit 75; or it was stopped).
    """
    for rank in freeze.ranks:
        times = out / f"times{rank}.jsonl"
        late = [e for e in map(json.loads, times.read_text().splitlines() if times.exists() else [])
                if e["pid"] in freeze.stale and e["step"] >= FAULT_STEP]
        assert late == [], f"the stale rank {rank} completed steps of the group it was given up by: {late}"
    resumed = (out / f"node{freeze.launcher}.log").read_bytes()[freeze.log_offset:].decode(errors="replace")
    for event in ("snapshot_saved", "checkpoint_saved"):
        stale = [step for step in _saved_steps(resumed, event) if step <= FAULT_STEP]
        assert stale == [], f"{event} of the stale state after the resume: steps {stale}"
    for rank in freeze.ranks:
        result = out / f"rank{rank}.json"
        if not result.exists():  # (the example writes one for every rank that ends: trained or not)
            assert code != 0, f"the frozen rank {rank} wrote no result, yet its launcher exited 0"
            continue
        summary = json.loads(result.read_text())
        assert summary["pid"] not in freeze.stale, f"the stale rank {rank} wrote its result"
        assert (summary["trained"] and summary["state_from"] == "replica" and summary["joined_at"] > FAULT_STEP) \
            or (not summary["trained"] and not (out / f"params{rank}.pt").exists()), summary


@pytest.mark.timeout(300)
# The victim: node A's rank 0, the primary, or node B's rank 2.
@pytest.mark.parametrize("victim", [0, pytest.param(2, marks=pytest.mark.matrix)])
def test_a_frozen_node_costs_the_survivors_one_ttl_and_is_fenced_when_resumed(
        etcd: EmbeddedEtcd, tmp_path: Path, baseline, victim: int) -> None:
    """A snapshot and a checkpoint every step: the frozen primary (victim 0) has uploads and writes in flight."""
    launchers = _start(tmp_path, [fail_at(rank=victim, step=FAULT_STEP, bucket=0, kind="stop_node")], 2, 2, etcd,
                       f"fz{victim}", "--snapshot-every", "1", "--checkpoint-dir", str(tmp_path / "ckpt"),
                       "--checkpoint-every", "1")
    try:
        frozen, survivors, before, freeze = _freeze_and_resume(tmp_path, launchers)
    finally:
        codes = _finish(launchers)
    assert len(survivors) == 2 and victim not in survivors
    assert codes[1 - frozen] == 0, _log(tmp_path)[-4000:]
    assert codes[frozen] in (0, 75)  # rejoined and finished, or gave its node up (EX_TEMPFAIL): never a crash
    assert_fenced(tmp_path, freeze, codes[frozen])
    assert_survivors(tmp_path, survivors, before, baseline)
    assert max(stall(tmp_path, r) for r in survivors) <= TTL + 1
    assert "dp_wait_interrupted" in _log(tmp_path)  # the survivors gave the frozen members up (not a timeout)
    assert not [e for e in _events(tmp_path, "error_event") if e["kind"] == "task_hang" and e["rank"] in survivors]


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_one_frozen_node_of_three(etcd: EmbeddedEtcd, tmp_path: Path, baseline) -> None:
    launchers = _start(tmp_path, [fail_at(rank=1, step=FAULT_STEP, bucket=0, kind="stop_node")], 3, 1, etcd, "fz3")
    try:
        frozen, survivors, before, freeze = _freeze_and_resume(tmp_path, launchers)
    finally:
        codes = _finish(launchers)
    assert len(survivors) == 2 and 1 not in survivors
    assert [code for i, code in enumerate(codes) if i != frozen] == [0, 0], _log(tmp_path)[-4000:]
    assert_fenced(tmp_path, freeze, codes[frozen])
    assert_survivors(tmp_path, survivors, before, baseline)
    assert max(stall(tmp_path, r) for r in survivors) <= TTL + 1


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_frozen_snapshot_holder_and_a_dead_node_leave_the_group_on_its_live_state(
        etcd: EmbeddedEtcd, tmp_path: Path, baseline) -> None:
    """Three nodes, a snapshot every step: node 0's primary writes to nodes 1 and 2. Node 1 freezes, node 2 is
    killed in the same step: node 0 goes on from its own state (no snapshot, no step 0), alone."""
    launchers = _start(tmp_path, [fail_at(rank=1, step=FAULT_STEP, bucket=0, kind="stop_node")], 3, 1, etcd, "fz3k",
                       "--snapshot-every", "1")
    try:
        frozen, survivors, before, freeze = _freeze_and_resume(tmp_path, launchers, kill_rank=2)
    finally:
        codes = _finish(launchers)
    assert_fenced(tmp_path, freeze, codes[frozen])
    assert survivors == [0]
    assert codes[next(i for i in range(3) if i != frozen and codes[i] is not None and codes[i] >= 0)] == 0, \
        _log(tmp_path)[-4000:]
    assert_survivors(tmp_path, [0], before, baseline)
    assert "snapshot_saved" in _log(tmp_path)  # there were snapshots to fall back to: none was needed
