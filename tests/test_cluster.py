"""A coordinated cluster of real processes: etcd, coordinator, node daemons, unicron-run, workers (issue #11, item 5, 7)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import wait_for
from unicron_elastic.coordinator.service import read_plan
from unicron_elastic.node.local_cluster import LocalCluster
from unicron_elastic.store import EmbeddedEtcd, StatusStore, free_port
from unicron_elastic.testing import kill_node

WORKER = str(Path(__file__).parent / "workers" / "cluster_worker.py")
TABLE_A = {"2": 2.0, "4": 3.6, "6": 5.0}
TABLE_B = {"2": 1.0, "4": 1.5}


def spec(name: str, out: Path, weight: float, table: dict, hi: int = 6, lo: int = 2) -> str:
    return json.dumps(dict(name=name, command=[sys.executable, WORKER, str(out), name], weight=weight, min_workers=lo,
                           max_workers=hi, global_batch=12, model={"calibration": table}))


def started(out: Path, task: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out / task).glob("started-*.json"))]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def running(out: Path, task: str) -> list[dict]:
    return [d for d in started(out, task) if alive(d["pid"])]


def sizes(plan) -> dict[str, int]:
    return {n: len(t.nodes) for n, t in plan.tasks.items()}


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_the_plan_drives_node_daemons_through_loss_return_finish_and_submit(etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    out = tmp_path / "out"
    with LocalCluster(nodes=3, slots=2, cluster="e2e", etcd=etcd, log_dir=tmp_path / "logs",
                      launcher_args=["--node-ttl=1", "--monitor-interval=0.1"],
                      coordinator_args=["--failure-rate=1e-4"]) as cluster, \
            StatusStore(replace(etcd.config, cluster="e2e")) as store:
        store.put(store.keys.task_spec("a"), spec("a", out, 1.0, TABLE_A))
        store.put(store.keys.task_spec("b"), spec("b", out, 2.0, TABLE_B, hi=4))
        plan = wait_for(lambda: (p := read_plan(store)) and len(p.nodes) == 3 and len(p.tasks) == 2 and p,
                        why="a plan for 3 nodes and 2 tasks")
        assert sizes(plan) == {"a": 2, "b": 1}  # the planner's optimum (tests/test_coordinator_policy.py)
        a_workers = wait_for(lambda: len(r := running(out, "a")) == 4 and r, why="a's 4 workers")
        b_workers = wait_for(lambda: len(r := running(out, "b")) == 2 and r, why="b's 2 workers")
        assert {d["world"] for d in a_workers} == {4} and {d["world"] for d in b_workers} == {2}
        assert {d["node"] for d in a_workers} == set(plan.tasks["a"].nodes)

        victim = plan.tasks["a"].nodes[0]
        survivors = [d["pid"] for d in a_workers if d["node"] != victim]
        kill_node(cluster.daemons[victim].pid)  # SEV1: the daemon, its launcher and workers
        lost = wait_for(lambda: (p := read_plan(store)) and victim not in p.nodes and p, why="re-plan after the loss")
        assert sizes(lost) == {"a": 1, "b": 1}
        assert all(alive(pid) for pid in survivors)  # a continues on fewer workers

        cluster.start_node(victim)
        back = wait_for(lambda: (p := read_plan(store)) and victim in p.tasks["a"].nodes and p,
                        why="the returning node in a's plan")
        assert sizes(back) == {"a": 2, "b": 1}
        rejoined = wait_for(lambda: [d for d in running(out, "a") if d["node"] == victim and d["pid"] not in
                                     [w["pid"] for w in a_workers]], why="a's workers on the returning node")
        assert {d["world"] for d in rejoined} == {4}
        assert all(alive(pid) for pid in survivors)  # the healthy workers were not restarted

        (out / "b" / "finish").touch()
        grown = wait_for(lambda: (p := read_plan(store)) and "b" in p.finished and p, why="b finished")
        assert sizes(grown) == {"a": 3}
        wait_for(lambda: {d["world"] for d in running(out, "a")} == {6} and len(running(out, "a")) == 6,
                 why="a on 6 workers")

        store.put(store.keys.task_spec("c"), spec("c", out, 2.0, TABLE_B, hi=4))
        shared = wait_for(lambda: (p := read_plan(store)) and "c" in p.tasks and p, why="a plan with c")
        assert sizes(shared)["c"] >= 1
        wait_for(lambda: len(running(out, "c")) == 2 * sizes(shared)["c"], why="c's workers")
        for task in ("a", "c"):
            (out / task / "finish").touch()
        final = wait_for(lambda: (p := read_plan(store)) and set(p.finished) == {"a", "b", "c"} and p,
                         why="every task finished")
        assert not final.isolated and not final.failed  # a node told to join a finishing task is not failed


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_the_cluster_rides_out_a_5s_etcd_outage(private_etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    out = tmp_path / "out"
    with LocalCluster(nodes=2, slots=1, cluster="outage", etcd=private_etcd, log_dir=tmp_path / "logs",
                      launcher_args=["--monitor-interval=0.1"], coordinator_args=["--failure-rate=1e-4"]) as cluster, \
            StatusStore(replace(private_etcd.config, cluster="outage")) as store:
        store.put(store.keys.task_spec("a"), spec("a", out, 1.0, {"1": 1.0, "2": 1.9}, hi=2, lo=1))
        wait_for(lambda: (p := read_plan(store)) and sizes(p) == {"a": 2}, why="a on both nodes")
        before = wait_for(lambda: len(r := running(out, "a")) == 2 and r, why="a's workers")
        generation = read_plan(store).generation
        private_etcd.kill()
        time.sleep(5.0)  # the fault: etcd is down for 5 s
        private_etcd.start()
        store.put(store.keys.task_spec("b"), spec("b", out, 1.0, {"1": 5.0}, hi=1, lo=1))  # an event after the outage
        after = wait_for(lambda: (p := read_plan(store)) and "b" in p.tasks and p, why="a plan for b")
        assert after.generation == generation + 1  # nothing re-planned in between: no node was taken for lost
        assert cluster.dead() is None and cluster.dead_nodes() == []
        assert all(alive(d["pid"]) for d in before if d["node"] in after.tasks["a"].nodes)
        for task in ("a", "b"):
            (out / task).mkdir(parents=True, exist_ok=True)
            (out / task / "finish").touch()


@pytest.mark.timeout(300)
def test_a_daemon_whose_lease_lapsed_registers_again_and_is_planned_back(etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    """A lease can lapse on an overloaded host while the daemon is alive: the daemon does not stop; it
    registers the node on a new lease, and the coordinator plans it back in (a node lost, then joined)."""
    with LocalCluster(nodes=2, slots=1, cluster="lapse", etcd=etcd, log_dir=tmp_path / "logs",
                      coordinator_args=["--failure-rate=1e-4"]) as cluster, \
            StatusStore(replace(etcd.config, cluster="lapse")) as store:
        before = wait_for(lambda: (p := read_plan(store)) and len(p.nodes) == 2 and p, why="a plan with both nodes")
        victim = sorted(cluster.daemons)[0]
        record = store.get(store.keys.node(victim))
        assert record is not None and record.lease
        store.call(lambda c: c.revoke_lease(record.lease), "revoke")  # what etcd does to a lease not refreshed
        again = wait_for(lambda: (r := store.get(store.keys.node(victim))) and r.lease != record.lease and r,
                         why="the node registered on a new lease")
        assert again.lease
        wait_for(lambda: (p := read_plan(store)) and victim in p.nodes and p.generation >= before.generation + 2,
                 why="planned out (lost), then back in (joined)")
        assert cluster.dead() is None and cluster.dead_nodes() == []
        assert "lease_renewed" in (tmp_path / "logs" / f"{victim}.log").read_text()


@pytest.mark.timeout(300)
def test_a_daemon_stopped_with_sigterm_drains_its_node_without_an_alert(etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    """SIGTERM (what a scheduler sends to take a machine out): the daemon marks its record ``leaving``, the
    coordinator plans the node out as *left* (no SEV1, no alert), the daemon asks its launcher to leave the
    task that goes on elsewhere, and exits 0; the other node's worker is not restarted."""
    out, logs, port = tmp_path / "out", tmp_path / "logs", free_port()
    with LocalCluster(nodes=2, slots=1, cluster="drain", etcd=etcd, log_dir=logs, launcher_args=["--monitor-interval=0.1"],
                      coordinator_args=["--failure-rate=1e-4", f"--metrics-port={port}"]) as cluster, \
            StatusStore(replace(etcd.config, cluster="drain")) as store:
        store.put(store.keys.task_spec("a"), spec("a", out, 1.0, {"1": 1.0, "2": 1.9}, hi=2, lo=1))
        wait_for(lambda: (p := read_plan(store)) and sizes(p) == {"a": 2}, why="a on both nodes")
        before = wait_for(lambda: len(r := running(out, "a")) == 2 and r, why="a's workers")
        victim = sorted(cluster.daemons)[0]
        cluster.daemons[victim].send_signal(signal.SIGTERM)
        assert cluster.daemons[victim].wait(timeout=120) == 0
        plan = wait_for(lambda: (p := read_plan(store)) and victim not in p.nodes and p, why="the plan without it")
        assert plan.reason == f"node {victim} left" and sizes(plan) == {"a": 1}
        assert all(alive(d["pid"]) for d in before if d["node"] != victim)  # never restarted
        assert not any(alive(d["pid"]) for d in before if d["node"] == victim)
        metrics = _metrics(port)  # the coordinator's Prometheus endpoint, over HTTP
        assert metrics["unicron_plan_generation"] >= plan.generation and metrics['unicron_tasks{state="running"}'] == 1
        assert metrics.get('unicron_coordinator_events_total{severity="SEV1"}', 0) == 0
        (out / "a" / "finish").touch()
    daemon_log = (logs / f"{victim}.log").read_text()
    assert "node_draining" in daemon_log and "node_drained" in daemon_log and "launcher_leaving" in daemon_log
    coordinator_log = "".join(p.read_text() for p in logs.glob("coordinator-*.log"))
    assert f"node {victim} left" in coordinator_log and f"node {victim} lost" not in coordinator_log


def _metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {name: float(value) for name, value in
            (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("members", [1, pytest.param(3, marks=pytest.mark.e2e)])
def test_cluster_up_starts_everything_and_ctrl_c_leaves_nothing(tmp_path: Path, members: int) -> None:
    import signal
    import subprocess

    from conftest import BIN
    from unicron_elastic.testing import process_tree

    proc = subprocess.Popen([os.path.join(BIN, "unicron"), "cluster", "up", "--nodes", "2", "--slots", "1",
                             "--cluster", "demo", f"--etcd-members={members}"], stdout=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()
        assert "etcd at " in first, first
        endpoint = first.split("etcd at ")[1].split(", coordinator")[0]
        assert len(endpoint.split(",")) == members, first
        status = wait_for(lambda: (r := subprocess.run([os.path.join(BIN, "unicron"), "status", "--json",
                                                        f"--endpoint={endpoint}", "--cluster=demo"],
                                                       capture_output=True, text=True)).returncode == 0
                          and len(json.loads(r.stdout)["nodes"]) == 2 and json.loads(r.stdout)["leader"]
                          and json.loads(r.stdout), why="2 nodes and a leader in unicron status")
        assert {n["name"] for n in status["nodes"]} == {"node0", "node1"}
        tree = process_tree(proc.pid)
        assert len(tree) >= 3 + members  # etcd's members (+ their guards), a coordinator, two daemons
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    wait_for(lambda: not any(alive(pid) for pid in tree), 30, why="every process of the cluster gone")
