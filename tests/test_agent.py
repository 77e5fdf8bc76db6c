"""The unicron agent under unicron-run: every detector and every edge of the ladder.

Real ``unicron-run`` subprocesses with a private etcd, real worker processes,
faults injected as data (``fail_at``); each test asserts that the fault fired,
the event (severity, kind) and the action taken.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from conftest import BIN, EXAMPLES
from unicron_elastic.agent.ladder import EXIT_GIVE_UP
from unicron_elastic.store import EmbeddedEtcd, StatusStore
from unicron_elastic.testing import Fault, fail_at, faults_env, kill_node

WORKER = os.path.join(EXAMPLES, "resilient_worker.py")


class Run:
    def __init__(self, tmp: Path, proc: subprocess.CompletedProcess) -> None:
        self.tmp, self.proc = tmp, proc
        self.logs = []
        for line in proc.stderr.splitlines():
            if line.startswith("{"):
                try:
                    self.logs.append(json.loads(line))
                except ValueError:
                    pass

    def of(self, event: str) -> list[dict]:
        return [entry for entry in self.logs if entry.get("event") == event]

    def starts(self, rank: int) -> list[dict]:
        path = self.tmp / "out" / f"rank{rank}.jsonl"
        return [r for r in map(json.loads, path.read_text().splitlines()) if r["event"] == "start"]

    def done(self, rank: int) -> bool:
        path = self.tmp / "out" / f"rank{rank}.jsonl"
        return any(json.loads(line)["event"] == "done" for line in path.read_text().splitlines())

    def fired(self) -> list[dict]:
        path = self.tmp / "faults.log"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []




def run(tmp: Path, faults: list[Fault], *flags: str, steps: int = 30, step_time: float = 0.05,
        worker_args: tuple[str, ...] = (), worker: str = WORKER) -> Run:
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=BIN + os.pathsep + os.environ["PATH"])
    env.update(faults_env(faults, str(tmp / "faults.log")))
    cmd = [os.path.join(BIN, "unicron-run"), "--standalone", "--nproc-per-node=2", "--monitor-interval=0.05",
           "--log-format=json", *flags, worker, "--steps", str(steps), "--step-time", str(step_time),
           "--out", str(tmp / "out"), *worker_args]
    return Run(tmp, subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=100))


def events(r: Run) -> list[tuple[str, str, int]]:
    return [(e["severity"], e["kind"], e["rank"]) for e in r.of("error_event")]


def actions(r: Run) -> list[tuple[str, int]]:
    return [(a["action"], a["rank"]) for a in r.of("agent_action")]


@pytest.mark.compat
@pytest.mark.timeout(120)
def test_sev2_process_exit_restarts_only_the_failed_rank(tmp_path: Path) -> None:
    r = run(tmp_path, [fail_at(rank=1, step=8, kind="kill")])
    assert r.proc.returncode == 0, r.proc.stderr[-3000:]
    assert [f["rank"] for f in r.fired()] == [1]
    assert events(r) == [("SEV2", "exited_abnormally", 1)]
    assert actions(r) == [("restart_worker", 1)]
    survivor, failed = r.starts(0), r.starts(1)
    assert len(survivor) == 1  # rank 0: never restarted, same PID throughout
    assert len(failed) == 2 and failed[0]["pid"] != failed[1]["pid"] and failed[1]["step"] == 8
    assert r.fired()[0]["pid"] == failed[0]["pid"]
    assert r.done(0) and r.done(1)
    latency = r.of("error_event")[0]["detected_at"] - r.fired()[0]["time"]
    assert latency <= 0.3, latency


#: Rank 1's first incarnation is left out (an exception with ``rejoin = True``, as the engine's ``Excluded``).
LEFT_OUT_WORKER = """
import argparse, json, os, time
from pathlib import Path
from unicron_elastic.worker import get_worker

class LeftOut(Exception):
    rejoin = True

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path)
out = parser.parse_known_args()[0].out
rank, restarts = int(os.environ["RANK"]), int(os.environ.get("UNICRON_WORKER_RESTARTS", "0"))
out.mkdir(parents=True, exist_ok=True)
with (out / f"rank{rank}.jsonl").open("a") as f:
    f.write(json.dumps({"event": "start", "pid": os.getpid(), "restarts": restarts,
                        "incarnation": os.environ["UNICRON_INCARNATION"]}) + "\\n")
get_worker().hello(resumable=True)
if rank == 1 and restarts == 0:
    time.sleep(0.5)
    raise LeftOut("replica 1 lost a peer")
other = out / "rank1.jsonl"
deadline = time.monotonic() + 30
while rank == 0 and time.monotonic() < deadline and (not other.exists() or len(other.read_text().splitlines()) < 2):
    time.sleep(0.05)
"""


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_a_left_out_worker_rejoins_without_an_event_or_a_restart_counted(tmp_path: Path) -> None:
    script = tmp_path / "left_out_worker.py"
    script.write_text(LEFT_OUT_WORKER)
    r = run(tmp_path, [], "--max-worker-restarts=0", worker=str(script))  # a counted restart would be a give-up
    assert r.proc.returncode == 0, r.proc.stderr[-3000:]
    assert events(r) == []  # no exited_abnormally, no event for the exception either
    assert actions(r) == [("restart_worker", 1)]
    rejoining = r.of("worker_rejoining")
    assert [e["rank"] for e in rejoining] == [1] and rejoining[0]["exitcode"] == 1
    assert rejoining[0]["reason"] == "LeftOut: replica 1 lost a peer"
    first, second = r.starts(1)
    assert (first["restarts"], second["restarts"]) == (0, 1) and first["pid"] != second["pid"]
    assert second["incarnation"].endswith(".1")  # a new incarnation: it joins as a joiner
    assert len(r.starts(0)) == 1
    assert not r.of("malformed_worker_message") and not r.of("rejoin_request_dropped")


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_sev3_exception_is_reattempted_in_place(tmp_path: Path) -> None:
    r = run(tmp_path, [fail_at(rank=0, step=4, kind="raise", message="Connection reset by peer")])
    assert r.proc.returncode == 0, r.proc.stderr[-3000:]
    assert len(r.fired()) == 1
    assert events(r) == [("SEV3", "connection_reset", 0)]
    assert actions(r) == [("reattempt", 0)]
    assert len(r.starts(0)) == 1 and len(r.starts(1)) == 1  # nobody restarted
    latency = r.of("error_event")[0]["detected_at"] - r.fired()[0]["time"]
    assert latency <= 0.1, latency


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_sev3_that_keeps_failing_escalates_to_a_sev2_restart(tmp_path: Path) -> None:
    fault = fail_at(rank=1, step=4, kind="raise", message="Connection reset by peer", times=3)
    r = run(tmp_path, [fault], "--max-reattempts=2")
    assert r.proc.returncode == 0, r.proc.stderr[-3000:]
    assert len(r.fired()) == 3  # first try + 2 reattempts, all in the first incarnation
    assert actions(r)[:3] == [("reattempt", 1), ("reattempt", 1), ("restart_worker", 1)]
    assert len(r.starts(1)) == 2 and len(r.starts(0)) == 1


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_hang_is_detected_and_the_worker_restarted(tmp_path: Path) -> None:
    r = run(tmp_path, [fail_at(rank=1, step=12, kind="hang")], "--hang-factor=5", step_time=0.1)
    assert r.proc.returncode == 0, r.proc.stderr[-3000:]
    assert len(r.fired()) == 1
    assert events(r)[0] == ("SEV2", "task_hang", 1)
    assert ("restart_worker", 1) in actions(r)
    assert len(r.starts(1)) == 2 and len(r.starts(0)) == 1
    latency = r.of("error_event")[0]["detected_at"] - r.fired()[0]["time"]
    assert latency <= 3.0 + 0.5, latency  # the floor (5 x the 0.1 s gaps is less) + 0.5 s


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_repeated_sev2_escalates_to_sev1_and_the_node_gives_up(tmp_path: Path) -> None:
    r = run(tmp_path, [fail_at(rank=1, step=5, kind="exit", times=None)], "--max-worker-restarts=1")
    assert r.proc.returncode == EXIT_GIVE_UP, r.proc.stderr[-3000:]
    assert len(r.fired()) == 2
    assert actions(r) == [("restart_worker", 1), ("give_up", 1)]
    assert r.of("node_gave_up")


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_sev1_exception_gives_up_the_node(tmp_path: Path) -> None:
    r = run(tmp_path, [fail_at(rank=0, step=3, kind="raise", message="CUDA error: uncorrectable ECC error encountered")])
    assert r.proc.returncode == EXIT_GIVE_UP, r.proc.stderr[-3000:]
    assert events(r)[0] == ("SEV1", "ecc", 0)
    assert actions(r) == [("give_up", 0)]


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_plain_script_keeps_torchrun_restart_all(tmp_path: Path) -> None:
    r = run(tmp_path, [fail_at(rank=1, step=5, kind="kill")], "--max-restarts=1", worker_args=("--plain",))
    assert r.proc.returncode == 0, r.proc.stderr[-3000:]
    assert actions(r) == [("restart_all", 1)]
    assert len(r.starts(0)) == 2 and len(r.starts(1)) == 2  # everybody restarted


@pytest.mark.e2e
@pytest.mark.timeout(180)  # three launchers that each start, import torch and refuse: ~10 s, a minute loaded
def test_bad_agent_flags_are_clear_errors(tmp_path: Path) -> None:
    r = run(tmp_path, [], "--hang-factor=1.0", steps=1)
    assert r.proc.returncode == 2 and "hang_factor" in r.proc.stderr
    for bad in ("--hang-factor=inf", "--hang-factor=nan"):  # inf would turn hang detection off silently
        r = run(tmp_path, [], bad, steps=1)
        assert r.proc.returncode == 2 and "hang_factor" in r.proc.stderr, bad


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_node_loss_is_published_as_sev1_by_a_peer(etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=BIN + os.pathsep + os.environ["PATH"])
    conf = "--rdzv-conf=cluster=nodeloss,keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=1"
    cmd = [os.path.join(BIN, "unicron-run"), f"--rdzv-endpoint={etcd.endpoint}", "--rdzv-id=nodeloss",
           "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=2", "--node-ttl=1", conf, "--log-format=json",
           WORKER, "--steps", "200", "--step-time", "0.05", "--out", str(tmp_path / "out")]
    nodes = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    store = StatusStore(etcd.config.__class__(port=etcd.client_port, cluster="nodeloss"))
    deadline = time.monotonic() + 60
    while len(store.get_prefix(store.keys.nodes())) < 2 or len(list((tmp_path / "out").glob("*.step"))) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    victim = next(iter(store.get_json_prefix(store.keys.nodes())))
    victim_pid = int(victim.rsplit("-", 1)[-1])
    killed_at = time.time()
    kill_node(victim_pid)
    deadline = time.monotonic() + 30
    found = []
    while not found and time.monotonic() < deadline:
        found = [json.loads(kv.value) for kv in store.get_prefix(store.keys.events())
                 if json.loads(kv.value)["kind"] == "lost_connection"]
        time.sleep(0.05)
    for p in nodes:
        p.kill()
        p.wait()
    assert found, "no SEV1 event for the lost node"
    event = found[0]
    assert event["severity"] == "SEV1" and event["node"] == victim.rsplit("/", 1)[-1]
    assert event["detected_at"] - killed_at <= 2 * 1 + 0.5  # <= 2 x lease TTL (+ watch slack)


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_metrics_and_status_show_what_happened(tmp_path: Path) -> None:
    import socket
    import threading
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    scraped: list[str] = []

    def scrape() -> None:  # while the run goes on (the agent exits with it)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1).read().decode()
                if "unicron_actions_total{action=\"restart_worker\"}" in text:
                    scraped.append(text)
                    return
            except OSError:
                pass
            time.sleep(0.1)

    thread = threading.Thread(target=scrape)
    thread.start()
    r = run(tmp_path, [fail_at(rank=1, step=8, kind="kill")], f"--metrics-port={port}", steps=80)
    thread.join()
    assert r.proc.returncode == 0, r.proc.stderr[-3000:]
    assert scraped, "no metrics with the restart were served"
    assert 'unicron_events_total{detector="process",kind="exited_abnormally",severity="SEV2"} 1.0' in scraped[0]
    assert "unicron_detection_latency_seconds_bucket" in scraped[0]


def test_status_renders_nodes_and_events(store: StatusStore) -> None:
    from unicron_elastic.cli import render_status
    from unicron_elastic.events import ErrorEvent, Severity

    store.put_json(store.keys.node("n1"), {"state": "running"})
    store.put(store.keys.event(1), ErrorEvent(Severity.SEV2, "task_hang", "hang", "n1", rank=3).to_json())
    store.put(store.keys.event(2), b"garbage")
    text = render_status(store)
    assert "n1" in text and "running" in text
    assert "SEV2 task_hang" in text and "rank=3" in text
    assert "malformed value" in text


class _Proc:
    def __init__(self, pid: int, code: int | None) -> None:
        self.pid, self.code = pid, code

    def poll(self) -> int | None:
        return self.code


def _local_workers():
    """The agent's view of its worker processes, torch's process context and workers stubbed."""
    from types import SimpleNamespace

    from unicron_elastic.agent.local_workers import LocalWorkers

    return LocalWorkers(SimpleNamespace(workers=[]), lambda: object())


def test_a_worker_that_dies_after_the_monitor_polled_it_is_not_handed_to_torch(monkeypatch) -> None:
    """Seen under load with every rank killed in one step: rank 0 died between the monitor's loop
    over the workers and its final check, torch's monitor saw the unhandled exit and stopped the
    healthy, just-restarted ranks (exit 1). Until the agent handled that exit, torch must not look."""
    from unicron_elastic.agent import _torch_compat

    procs = {0: _Proc(10, -9), 1: _Proc(11, None)}
    monkeypatch.setattr(_torch_compat, "worker_processes", lambda pcontext: procs)
    workers, handled = _local_workers(), set()
    assert workers.healthy_for_now(handled)  # rank 0's exit is not handled yet
    handled.add(10)  # handled and not respawned (restart-all, or stopping)
    assert not workers.healthy_for_now(handled)  # now torch's monitor reports the failure
    procs[0] = _Proc(12, 0)
    assert workers.healthy_for_now(handled)  # one finished with 0, one running
    procs[1] = _Proc(13, 0)
    assert not workers.healthy_for_now(handled)  # all finished: torch reports success


def test_own_lease_lost_after_a_worker_finished_is_not_a_give_up(monkeypatch) -> None:
    """Seen under the CPU hog: the node's lease lapsed while its last workers were on their way out
    after training; the give-up turned a finished run into exit 75. Mid-run it is still a SEV1."""
    import threading

    from unicron_elastic.agent import _torch_compat
    from unicron_elastic.agent.agent import UnicronAgent
    from unicron_elastic.agent.lifecycle import AgentState, Lifecycle

    procs = {0: _Proc(10, 0), 1: _Proc(11, None)}
    agent = UnicronAgent.__new__(UnicronAgent)  # only the lease-loss bookkeeping is used
    agent._lock, agent._lifecycle, agent._local_workers = threading.RLock(), Lifecycle(), _local_workers()
    agent._lifecycle.state = AgentState.RUNNING
    agent.node = "n0"
    reported = []
    monkeypatch.setattr(agent, "report", reported.append, raising=False)
    monkeypatch.setattr(_torch_compat, "worker_processes", lambda pcontext: procs)
    agent.lost_own_lease()
    assert reported == []  # rank 0 finished training: nothing to give up
    procs[0] = _Proc(12, None)
    agent.lost_own_lease()
    assert [(e.severity.name, e.kind, e.node) for e in reported] == [("SEV1", "lost_connection", "n0")]
    reported.clear()
    agent._lifecycle.state = AgentState.STOPPING
    agent.lost_own_lease()
    assert reported == []


def test_a_rejoin_request_past_max_rejoins_or_followed_by_exit_0_is_not_a_rejoin(capsys) -> None:
    """Past ``max_rejoins`` the exit is left to the ordinary SEV2 path (its event published); exit 0 is finished."""
    from types import SimpleNamespace

    from unicron_elastic.agent.ladder import LadderPolicy, RankHistory
    from unicron_elastic.agent.lifecycle import Lifecycle
    from unicron_elastic.agent.publisher import EventPublisher
    from unicron_elastic.agent.rank_state import RankState, RankTable
    from unicron_elastic.agent.remedies import Remedies
    from unicron_elastic.plugins.manager import plugin_manager

    ranks = RankTable({1: RankState(RankHistory(resumable=True, rejoins=1), rejoining="left out"),
                       2: RankState(rejoining="left out")})
    pm = plugin_manager(load_entry_points=False)
    remedies = Remedies(policy=LadderPolicy(max_rejoins=1), ranks=ranks, workers=_local_workers(),
                        channel=None, lifecycle=Lifecycle(), pm=pm, respawn=lambda local_rank: None,
                        publisher=EventPublisher("n0", pm, SimpleNamespace(get_run_id=lambda: "t")))
    assert remedies.rejoin(1, pid=10, exitcode=1, detected_at=0.0) is False  # the caller publishes a SEV2
    assert remedies.rejoin(2, pid=11, exitcode=0, detected_at=0.0) is True  # finished: nothing to do
    assert all(ranks.peek(rank).rejoining is None for rank in (1, 2))
    assert ranks.peek(1).history.rejoins == 1 and ranks.peek(2).history == RankHistory()
    out = capsys.readouterr().out
    assert "rejoin_refused" in out and "max_rejoins=1" in out and "worker_finished_after_rejoin_request" in out


def test_the_lifecycle_is_one_state_a_restart_stops_for_a_while_and_closing_is_final() -> None:
    """The agent's checks read one value: a restart's stop is not final, a close is, a leave outlives restarts."""
    from unicron_elastic.agent.lifecycle import AgentState, Departure, Lifecycle

    life = Lifecycle()
    assert life.state is AgentState.STARTING and not life.state.stopping
    assert life.first_rendezvous() and not life.first_rendezvous()  # the detectors start once
    life.workers_started()
    life.leave()
    life.restart_begins()
    assert life.state is AgentState.RESTARTING and life.state.stopping
    life.restart_stopped()
    assert life.state is AgentState.STOPPING
    life.workers_started()
    assert life.state is AgentState.RUNNING and life.departure is Departure.LEAVING
    life.exit_barrier_reached()
    assert life.departure is Departure.LEAVING  # a node that left does not count as finished
    assert life.close() and not life.close()
    for transition in (life.workers_started, life.restart_begins, life.restart_stopped, life.group_stopping):
        transition()
        assert life.state is AgentState.CLOSED
    stayed = Lifecycle()
    stayed.exit_barrier_reached()
    assert stayed.departure is Departure.FINISHED
