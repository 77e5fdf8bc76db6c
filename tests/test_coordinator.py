"""The coordinator on a real etcd: fenced plans, take-over, task commands, status (issue #11, items 1, 3, 6)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import BIN, json_log_entries, leader_of, unicron, wait_for
from unicron_elastic.api import EtcdConfig, NotLeaderError
from unicron_elastic.coordinator.api import ClusterPlan, NodeRecord
from unicron_elastic.coordinator.metrics import CoordinatorMetrics
from unicron_elastic.coordinator.vocabulary import PolicyConfig
from unicron_elastic.coordinator.service import Coordinator, read_plan
from unicron_elastic.events import ErrorEvent, Severity
from unicron_elastic.node.local_cluster import LocalCluster
from unicron_elastic.store import EmbeddedEtcd, StatusStore
from unicron_elastic.store.lease import KeptLease

CONFIG = PolicyConfig(failure_rate=1e-4)
TABLE_A = {"2": 2.0, "4": 3.6, "6": 5.0}
TABLE_B = {"2": 1.0, "4": 1.5}


def spec_doc(name: str, weight: float, table: dict, hi: int = 6) -> dict:
    return dict(name=name, command=[sys.executable, "-c", "pass"], weight=weight, min_workers=2, max_workers=hi,
                global_batch=12, model={"calibration": table})


def register(store: StatusStore, name: str, slots: int = 2) -> KeptLease:
    lease = KeptLease(store, 2)
    store.put(store.keys.node(name), NodeRecord(name, slots).to_json(), lease=lease.id)
    return lease


@pytest.fixture()
def leader(store: StatusStore):
    alerts = []
    metrics = CoordinatorMetrics.create()
    c = Coordinator(store, CONFIG, ttl=2, candidate="first", alert=alerts.append, metrics=metrics)
    c.election.campaign(10)
    c.load()
    c.alerts = alerts
    yield c
    c.election.resign()


def test_plan_commands_statuses_and_state_are_written_together(store: StatusStore, leader: Coordinator) -> None:
    leases = [register(store, f"n{i}") for i in range(3)]
    store.put(store.keys.task_spec("a"), json.dumps(spec_doc("a", 1.0, TABLE_A)))
    store.put(store.keys.task_spec("b"), json.dumps(spec_doc("b", 2.0, TABLE_B, hi=4)))
    leader.step()
    plan = read_plan(store)
    assert {n: len(t.nodes) for n, t in plan.tasks.items()} == {"a": 2, "b": 1}
    commands = {kv.key.split("/")[-2]: json.loads(kv.value)["task"] for kv in store.get_prefix(store.keys.prefix + "commands/")}
    assert commands == {"n0": "a", "n1": "a", "n2": "b"}
    assert store.get_json(store.keys.task_status("b"))["state"] == "running"
    assert store.get_json(store.keys.coordinator_state())["generation"] == plan.generation
    leases[2].close(revoke=True)  # n2 lost: SEV1, b re-planned
    leader.step()
    after = read_plan(store)
    assert after.generation == plan.generation + 1 and "n2" not in after.nodes
    assert [a.severity for a in leader.alerts] == [Severity.SEV1]
    assert store.get_prefix(store.keys.commands("n2")) == []
    text = leader.metrics.registry.get_sample_value("unicron_plan_generation")
    assert text == after.generation
    for lease in leases[:2]:
        lease.close()


def test_a_decision_larger_than_etcds_transaction_limit_is_written_in_several(store: StatusStore,
                                                                             leader: Coordinator) -> None:
    """etcd refuses a transaction of more than 128 operations: 300 nodes placed, then all lost at once (300
    nodes' commands to delete), each decision written whole in transactions of at most MAX_TXN_OPS."""
    nodes = 300
    lease = store.grant_lease(30)
    for i in range(nodes):
        store.put(store.keys.node(f"n{i:03d}"), NodeRecord(f"n{i:03d}", 2).to_json(), lease=lease)
    table = {str(2 * k): float(k) for k in (1, nodes // 2, nodes)}
    doc = dict(spec_doc("big", 1.0, table), max_workers=2 * nodes, global_batch=2 * nodes)
    store.put(store.keys.task_spec("big"), json.dumps(doc))
    leader.step()
    assert len(read_plan(store).tasks["big"].nodes) == nodes
    assert len(store.get_prefix(store.keys.prefix + "commands/")) == nodes
    store.call(lambda c: c.revoke_lease(lease), "revoke")  # every node lost at once
    leader.step()
    plan = read_plan(store)
    share = plan.tasks.get("big")
    assert not plan.nodes and (share is None or not share.nodes)
    assert store.get_prefix(store.keys.prefix + "commands/") == []


def test_a_deposed_leader_cannot_write_and_a_standby_loses_nothing(store: StatusStore, leader: Coordinator) -> None:
    lease = register(store, "n0")
    store.put(store.keys.task_spec("a"), json.dumps(spec_doc("a", 1.0, TABLE_A)))
    decision = leader.step()
    # leader pauses past its TTL: its lease lapses (simulated by stopping the keep-alive without revoking)
    leader.election._lease.close(revoke=False)
    wait_for(lambda: store.get(store.keys.leader()) is None, 10)
    standby = Coordinator(store, CONFIG, ttl=2, candidate="second", alert=lambda a: None)
    standby.election.campaign(10)
    standby.load()
    assert standby.state == leader.state and standby.cursor == leader.cursor  # nothing lost
    register(store, "n1")
    store.append_event(ErrorEvent(Severity.SEV2, "exited_abnormally", "process", "n0", 0, "a").to_json())
    assert standby.step() is not None
    with pytest.raises(NotLeaderError):
        leader.execute(decision, 0)  # the old leader's plan is refused
    assert json.loads(store.get(store.keys.coordinator_state()).value)["leader"] == "second"
    assert standby.state.failures["n0"]  # the event was decided by the new leader
    standby.election.resign()
    lease.close()


def test_task_submit_list_cancel(etcd: EmbeddedEtcd, etcd_config: EtcdConfig, tmp_path: Path) -> None:
    flags = [f"--endpoint={etcd.endpoint}", f"--cluster={etcd_config.cluster}"]
    good = tmp_path / "a.json"
    good.write_text(json.dumps(spec_doc("a", 1.0, TABLE_A)))
    ok = unicron("task", "submit", str(good), *flags)
    assert ok.returncode == 0 and "submitted task a" in ok.stdout, ok.stderr
    assert "task_weight_outside_recommended" not in ok.stderr
    heavy = tmp_path / "h.json"
    heavy.write_text(json.dumps(spec_doc("h", 5.0, TABLE_A)))
    warned = unicron("task", "submit", str(heavy), *flags)  # valid, outside the paper's 0.5-2: accepted, warned
    assert warned.returncode == 0 and "submitted task h" in warned.stdout, warned.stderr
    assert "task_weight_outside_recommended" in warned.stderr and "0.5-2" in warned.stderr, warned.stderr
    again = unicron("task", "submit", str(good), *flags)
    assert again.returncode == 2 and "'name'" in again.stderr and "exists" in again.stderr
    for name, doc, field in [
        ("unknown", {**spec_doc("u", 1.0, TABLE_A), "gpus": 2}, "'gpus'"),
        ("weight", spec_doc("w", 0.0, TABLE_A), "'weight'"),
        ("minmax", {**spec_doc("m", 1.0, TABLE_A), "min_workers": 9}, "'min_workers'"),
        ("command", {**spec_doc("c", 1.0, TABLE_A), "command": ["/no/such/binary"]}, "'command'"),
    ]:
        path = tmp_path / f"{name}.yaml"
        path.write_text(json.dumps(doc))  # JSON is YAML
        bad = unicron("task", "submit", str(path), *flags)
        assert bad.returncode == 2 and field in bad.stderr and bad.stderr.count("\n") == 1, bad.stderr
    listing = unicron("task", "list", "--json", *flags)
    assert [t["name"] for t in json.loads(listing.stdout)] == ["a", "h"]  # nothing else disturbed
    assert unicron("task", "cancel", "zz", *flags).returncode == 2
    cancel = unicron("task", "cancel", "a", *flags)
    assert cancel.returncode == 0
    table = unicron("task", "list", *flags).stdout
    assert "cancelling" in table


def test_status_shows_plan_tasks_and_json(store: StatusStore, leader: Coordinator, etcd: EmbeddedEtcd) -> None:
    lease = register(store, "n0")
    store.put(store.keys.task_spec("a"), json.dumps(spec_doc("a", 1.0, TABLE_A)))
    leader.step()
    flags = [f"--endpoint={etcd.endpoint}", f"--cluster={store.config.cluster}"]
    text = unicron("status", *flags)
    assert text.returncode == 0, text.stderr
    assert "coordinator: first" in text.stdout and "plan: generation" in text.stdout
    assert "dp=2" in text.stdout and "n0" in text.stdout
    doc = json.loads(unicron("status", "--json", *flags).stdout)
    assert doc["plan"]["tasks"]["a"]["nodes"] == ["n0"] and doc["tasks"][0]["state"] == "running"
    watch = subprocess.Popen([os.path.join(BIN, "unicron"), "status", "--json", "--watch", "0.2", *flags],
                             stdout=subprocess.PIPE, text=True)
    try:
        lines = [watch.stdout.readline() for _ in range(2)]
    finally:
        watch.send_signal(signal.SIGINT)
        assert watch.wait(20) == 130
    assert all(json.loads(line)["cluster"] == store.config.cluster for line in lines)
    lease.close()


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_kill_and_pause_the_leader_process(private_etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    """Two coordinator processes: SIGKILL the leader, then SIGSTOP the new one past its TTL and resume it."""
    ttl = 2
    with LocalCluster(nodes=0, cluster="ha", coordinators=2, coordinator_ttl=ttl, etcd=private_etcd,
                      log_dir=tmp_path, coordinator_args=["--failure-rate=1e-4", "--log-format=json"]) as cluster, \
            StatusStore(replace(private_etcd.config, cluster="ha")) as store:
        leases = [register(store, f"n{i}") for i in range(2)]
        store.put(store.keys.task_spec("a"), json.dumps(spec_doc("a", 1.0, TABLE_A)))
        first = wait_for(lambda: leader_of(store), 30)
        plan = wait_for(lambda: read_plan(store), 30)
        procs = {str(p.pid): p for p in cluster.coordinators}
        victim = procs[first.rsplit(":", 1)[-1]]
        victim.kill()
        killed_at = time.monotonic()
        second = wait_for(lambda: (leader_of(store) or first) != first and leader_of(store), 30)
        took_over = time.monotonic() - killed_at
        assert took_over <= ttl + 3.0, took_over  # one lease TTL, plus the watch and a busy host's scheduling
        leases.append(register(store, "n2"))
        after = wait_for(lambda: (p := read_plan(store)) and "n2" in p.nodes and p, 30)
        assert after.generation == plan.generation + 1 and set(after.tasks) == {"a"}  # nothing lost
        # pause the new leader past its TTL; a restarted first coordinator takes over; resume the paused one
        paused = procs[second.rsplit(":", 1)[-1]]
        cluster.start_coordinator()
        paused.send_signal(signal.SIGSTOP)
        try:
            third = wait_for(lambda: (leader_of(store) or second) != second and leader_of(store), 30)
            leases.append(register(store, "n3"))
            wait_for(lambda: "n3" in read_plan(store).nodes, 30)
        finally:
            paused.send_signal(signal.SIGCONT)
        leases[0].close(revoke=True)  # an event for the resumed process to react to
        wait_for(lambda: "n0" not in read_plan(store).nodes, 30)
        time.sleep(1.0)  # let the resumed process run its loop once
        assert leader_of(store) == third
        assert json.loads(store.get(store.keys.coordinator_state()).value)["leader"] == third
        assert paused.poll() is None  # it stands by again
    logs = json_log_entries(tmp_path / f"coordinator-{cluster.coordinators.index(paused)}.log")
    assert any(e.get("event") in ("deposed", "lease_lost") for e in logs), [e.get("event") for e in logs][-20:]
    for lease in leases[1:]:
        lease.close()


def test_malformed_and_clock_skewed_events(store: StatusStore, leader: Coordinator) -> None:
    leases = [register(store, "n0"), register(store, "n1")]
    store.put(store.keys.task_spec("a"), json.dumps(spec_doc("a", 1.0, TABLE_A)))
    leader.step()
    store.put(store.keys.events() + "not-a-number", "{}")  # a stray key
    store.put(store.keys.event(5), json.dumps({"severity": "SEV2", "kind": ["x"], "detector": "d", "node": "n0"}))
    for seq in (1, 2, 3):  # a writer whose clock is far behind: keys sort before everything, revisions are new
        event = ErrorEvent(Severity.SEV2, "exited_abnormally", "process", "n0", 0, "a", detected_at=100.0 + seq)
        store.put(store.keys.event(seq), event.to_json())
    decision = leader.step()  # nothing raises; the three good events are decided: n0 isolated
    assert decision is not None and "n0" in leader.state.isolated
    for lease in leases:
        lease.close()


def test_a_restarted_daemon_ends_an_isolation_and_a_lost_state_keeps_the_generation(
        store: StatusStore, leader: Coordinator) -> None:
    leases = [register(store, "n0"), register(store, "n1")]
    store.put(store.keys.task_spec("a"), json.dumps(spec_doc("a", 1.0, TABLE_A)))
    leader.step()
    store.append_event(ErrorEvent(Severity.SEV1, "ecc", "nvml", "n0", -1, "a").to_json())
    leader.step()
    assert leader.state.isolated == {"n0"}
    leases[0].close(revoke=False)  # the daemon restarts: same name, a new lease, before the old one expired
    leases[0] = register(store, "n0")
    leader.step()
    assert leader.state.isolated == frozenset() and "n0" in read_plan(store).nodes
    generation = read_plan(store).generation
    store.delete(store.keys.coordinator_state())  # the state is lost: the plan's generation goes on
    leader.load()
    leases.append(register(store, "n2"))
    leader.step()
    assert read_plan(store).generation == generation + 1
    for lease in leases:
        lease.close()


def test_plan_gate_waits_instead_of_refusing(store: StatusStore, leader: Coordinator) -> None:
    import threading

    from unicron_elastic.rendezvous.gate import JoinRequest, PlanGate

    leases = [register(store, "n0")]
    store.put(store.keys.task_spec("a"), json.dumps(spec_doc("a", 1.0, TABLE_A)))
    store.put(store.keys.task_spec("b"), json.dumps(spec_doc("b", 2.0, TABLE_B, hi=4)))
    leader.step()
    assert read_plan(store).task_of("n0") == "a"
    admitted = threading.Event()
    gate = PlanGate(store, "n0", poll=0.05)
    thread = threading.Thread(target=lambda: (gate.admit(JoinRequest("b", "b", "n0", 0)), admitted.set()), daemon=True)
    thread.start()
    assert not admitted.wait(0.5)  # the plan gives n0 task a: b's launcher waits (raising would close b's rendezvous)
    store.put(store.keys.task_cancel("a"), "cancel")
    leader.step()
    assert admitted.wait(10) and gate.grow(JoinRequest("b", "b", "n0", 0), 0)
    for lease in leases:
        lease.close()
