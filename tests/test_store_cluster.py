"""The store on an etcd cluster: endpoint lists, and a client that moves to another member when its own is lost.

A real three-member etcd on loopback (``EmbeddedEtcdCluster``); a member is
lost by SIGKILL. The default tier loses the leader in use, the coordinator's
member, a watch's member and the quorum; the other member losses, the CLI,
authentication and the multi-process jobs run with ``-m e2e``.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

import pytest

import unicron_elastic.store.client as client_module
from conftest import BIN, EXAMPLES, events_named, wait_for
from unicron_elastic.api import ConfigError, EtcdConfig
from unicron_elastic.meeting import decode_meeting, encode_meeting
from unicron_elastic.rendezvous.options import parse_endpoints, parse_options
from unicron_elastic.store.client import FAILOVER_REQUEST_TIMEOUT_S, StatusStore
from unicron_elastic.store.embedded import EmbeddedEtcdCluster
from unicron_elastic.store.lease import KeptLease
from unicron_elastic.testing import kill_node, run_workers


@pytest.mark.parametrize(("text", "members"), [
    ("127.0.0.1:2379", (("127.0.0.1", 2379),)),
    ("a:1,b:2, c:3", (("a", 1), ("b", 2), ("c", 3))),
    ("etcd-0,[::1]:2381", (("etcd-0", 2379), ("::1", 2381))),
])
def test_an_endpoint_list_names_every_member_in_order(text: str, members: tuple) -> None:
    assert parse_endpoints(text) == members
    config = parse_options(text, "run", {}).etcd
    assert config.members == members and (config.host, config.port) == members[0]


@pytest.mark.parametrize(("text", "named"), [
    ("", "must name the etcd members"), ("a:1,,b:2", "an empty entry"), ("a:1,b:x", "'b:x': port 'x'"),
    ("a:1,a:1", "a member is named twice"), ("a:1,http://b:2", "'http://b:2': not HOST[:PORT]"),
])
def test_a_malformed_endpoint_list_is_one_error_naming_the_entry(text: str, named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace("[", r"\[")):
        parse_endpoints(text, flag="--endpoint")


def test_the_members_travel_to_the_workers_and_a_host_beside_them_is_refused() -> None:
    config = EtcdConfig(members=(("10.0.0.1", 2379), ("::1", 2381)), cluster="c")
    assert config.endpoint == "10.0.0.1:2379,[::1]:2381"
    assert decode_meeting(encode_meeting(config, "/p/"))[0] == config
    with pytest.raises(ConfigError, match="give the members alone"):
        replace(config, host="10.0.0.9")


@pytest.fixture()
def etcd_cluster():
    with EmbeddedEtcdCluster(3, cluster="failover") as cluster:
        yield cluster


def _leader(cluster: EmbeddedEtcdCluster, store: StatusStore) -> str:
    """The endpoint of the cluster's leader."""
    leader = store.call(lambda c: c.status().leader, "status")
    return next(m.endpoint for m in cluster.members if any(m.endpoint in url for url in leader.client_urls))


CASES = {  # what is lost: (the member in use leads, the victim: "in use", "leader" or "follower")
    "the member in use, a follower": (False, "in use"),
    "the member in use, the leader": (True, "in use"),
    "a follower not in use": (False, "follower"),
    "the leader, not in use": (False, "leader"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("lost", [pytest.param(case, marks=() if case == "the member in use, the leader"
                                               else pytest.mark.e2e) for case in CASES])
def test_losing_a_member_costs_a_request_a_leader_election_at_most_and_the_lease_lives_on(
        etcd_cluster, capture_log, lost: str) -> None:
    """Losing the leader through a follower in use costs a write etcd's request timeout (a known limit)."""
    captured = capture_log(client_module)
    with StatusStore(etcd_cluster.config) as probe:
        leader = _leader(etcd_cluster, probe)
    in_use_leads, role = CASES[lost]
    followers = [m.endpoint for m in etcd_cluster.members if m.endpoint != leader]
    order = [leader, *followers] if in_use_leads else [followers[0], leader, followers[1]]
    config = replace(etcd_cluster.config, members=tuple(("127.0.0.1", int(e.rsplit(":", 1)[1])) for e in order),
                     host="127.0.0.1", port=int(order[0].rsplit(":", 1)[1]))
    store = StatusStore(config)
    lapsed: list[bool] = []
    lease = KeptLease(store, 2, on_lost=lambda: lapsed.append(True))
    try:
        store.put("/k", "before")
        in_use = store.member
        victim = {"in use": in_use, "leader": leader, "follower": order[-1]}[role]
        member = next(m for m in etcd_cluster.members if m.endpoint == victim)
        member.proc.kill()
        member.proc.wait()
        started = time.monotonic()
        store.put("/k", "after")
        took = time.monotonic() - started
        assert store.get("/k").value == b"after"
        moves = events_named(captured, "etcd_failover")
        if role == "in use":
            assert took < FAILOVER_REQUEST_TIMEOUT_S + 0.5  # a leader election at most
            assert moves and moves[0]["from_member"] == in_use and store.member != victim
        elif role == "follower":
            assert took < 0.5 and moves == [] and store.member == in_use  # nothing
        else:  # the write was forwarded to the lost leader: it waits out the request timeout, once
            assert took < config.request_timeout + FAILOVER_REQUEST_TIMEOUT_S + 0.5
        time.sleep(3)  # past the lease's TTL: etcd forwards keep-alives to the new leader itself
        assert lapsed == [] and store.call(lambda c: c.get_lease_info(lease.id).TTL, "lease") > 0
        assert events_named(captured, "etcd_unreachable_retrying") == []  # a failover is not an outage
    finally:
        lease.close()
        store.close()


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_unicron_etcd_runs_a_three_member_cluster_and_stops_it_whole() -> None:
    import json
    import signal
    import subprocess
    import sys

    from unicron_elastic.testing import process_tree

    proc = subprocess.Popen([sys.executable, "-m", "unicron_elastic.cli", "etcd", "--members", "3", "--cluster", "c3"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("etcd ready: --rdzv-endpoint="), proc.stderr.read()[-2000:]
        config = parse_options(line.split("=", 1)[1].strip(), "run", {"cluster": "c3"}).etcd
        assert len(config.members) == 3
        tree = process_tree(proc.pid)
        with StatusStore(config) as store:
            store.put("/k", "v")
            for index in range(3):  # every member answers for the cluster
                alone = replace(config, members=(config.members[index],), host="127.0.0.1", port=config.members[index][1])
                with StatusStore(alone) as one:
                    assert one.get("/k").value == b"v"
        status = subprocess.run([sys.executable, "-m", "unicron_elastic.cli", "status", "--json",
                                 f"--endpoint={config.endpoint}", "--cluster=c3"], capture_output=True, text=True)
        assert status.returncode == 0, status.stderr[-2000:]
        assert json.loads(status.stdout)["endpoint"] == config.endpoint
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert [pid for pid in tree if pid != proc.pid and os.path.exists(f"/proc/{pid}")] == []
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(60)
def test_a_watch_whose_member_is_lost_resumes_on_another_and_misses_nothing(etcd_cluster) -> None:
    from unicron_elastic.store.watch import PrefixWatch

    store = StatusStore(etcd_cluster.config)
    seen: list[str] = []
    watch = PrefixWatch(store, "/w/", lambda event: seen.append(event.value.decode()))
    try:
        store.put("/w/a", "1")
        wait_for(lambda: seen == ["1"], deadline_s=10, why="the watch saw nothing")
        victim = next(m for m in etcd_cluster.members if m.endpoint == store.member)
        victim.proc.kill()
        victim.proc.wait()
        for value in "234":
            store.put("/w/a", value)
        wait_for(lambda: seen == ["1", "2", "3", "4"], deadline_s=10, why=f"the watch saw {seen}")
        assert watch.reconnects >= 1
    finally:
        watch.cancel()
        store.close()


# -- a training job on the cluster ---------------------------------------------------------------------------
WORKER = os.path.join(EXAMPLES, "elastic_dp_worker.py")
STEPS, PER_NODE = 24, 2
COMMON = ["--steps", str(STEPS), "--grad-dtype", "float64", "--bucket-numel", "64"]


@pytest.fixture(scope="module")
def baseline(failure_free) -> list:
    import torch

    def reference_run(out):
        results = run_workers(WORKER, 2 * PER_NODE, [*COMMON, "--out", str(out)], timeout=120)
        assert [r.returncode for r in results] == [0] * 4, results[0].stderr[-2000:]
        return torch.load(out / "params0.pt")

    return failure_free("test_store_cluster.baseline", reference_run)


def _progress(out, ranks: int) -> list[int]:
    return [int((out / f"progress{r}").read_text()) if (out / f"progress{r}").exists() else -1 for r in range(ranks)]


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_job_trains_on_while_the_member_its_launchers_use_is_lost(etcd_cluster, tmp_path, baseline) -> None:
    import json
    import subprocess

    import torch

    out = tmp_path / "out"
    out.mkdir()
    cmd = [os.path.join(BIN, "unicron-run"), f"--rdzv-endpoint={etcd_cluster.endpoint}", "--rdzv-id=on-a-cluster",
           "--nnodes=2", f"--nproc-per-node={PER_NODE}", "--monitor-interval=0.05", "--log-format=json",
           "--rdzv-conf=cluster=failover,keep_alive_interval=1,keep_alive_max_attempt=2",
           WORKER, *COMMON, "--step-time", "0.25", "--progress", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=BIN + os.pathsep + os.environ["PATH"])
    launchers = [subprocess.Popen(cmd, stdout=(out / f"node{i}.log").open("w"), stderr=subprocess.STDOUT, env=env)
                 for i in range(2)]
    try:
        wait_for(lambda: min(_progress(out, 4)) >= 2 or any(p.poll() is not None for p in launchers),
                 deadline_s=120, why="training never started")
        assert all(p.poll() is None for p in launchers), (out / "node0.log").read_text()[-3000:]
        first = etcd_cluster.members[0]  # the member every launcher and worker starts on
        first.proc.kill()
        first.proc.wait()
        at_loss = max(_progress(out, 4))
        codes = [p.wait(timeout=200) for p in launchers]
    finally:
        for p in launchers:
            if p.poll() is None:
                kill_node(p.pid)
    logs = "\n".join((out / f"node{i}.log").read_text() for i in range(2))
    assert codes == [0, 0], logs[-4000:]
    assert at_loss < STEPS - 1, "the member was lost after training ended"
    assert "etcd_failover" in logs
    for absent in ("worker_restarted", '"severity": "SEV1"', "node_lost", "lease_lost"):
        assert absent not in logs, (absent, logs[-4000:])
    for r in range(4):
        steps = json.loads((out / f"rank{r}.json").read_text())
        assert [s["step"] for s in steps] == list(range(STEPS)) and all(not s["dead"] for s in steps)
        assert all(torch.equal(a, b) for a, b in zip(torch.load(out / f"params{r}.pt"), baseline)), f"rank {r}"


@pytest.mark.timeout(120)
def test_the_coordinator_leader_keeps_deciding_and_stays_fenced_across_the_loss_of_a_member(etcd_cluster) -> None:
    import json

    from test_coordinator import CONFIG, TABLE_A, register, spec_doc
    from unicron_elastic.api import NotLeaderError
    from unicron_elastic.coordinator.service import Coordinator, read_plan

    stores = [StatusStore(etcd_cluster.config) for _ in range(3)]  # the leader's, the standby's, the operator's
    store = stores[2]
    leader = Coordinator(stores[0], CONFIG, ttl=2, candidate="first", alert=lambda a: None)
    standby = Coordinator(stores[1], CONFIG, ttl=2, candidate="second", alert=lambda a: None)
    leases = [register(store, "n0"), register(store, "n1")]
    try:
        token = leader.election.campaign(10)
        leader.load()
        store.put(store.keys.task_spec("a"), json.dumps(spec_doc("a", 1.0, TABLE_A)))
        assert leader.step() is not None and set(read_plan(store).tasks) == {"a"}
        lost = etcd_cluster.members[0]  # every store starts on it
        lost.proc.kill()
        lost.proc.wait()
        store.put(store.keys.task_spec("b"), json.dumps(spec_doc("b", 1.0, TABLE_A)))  # submitted after the loss
        decision = leader.step()
        assert decision is not None and set(read_plan(store).tasks) == {"a", "b"}
        with pytest.raises(TimeoutError):  # the leader's lease lives on: nobody else is elected ...
            standby.election.campaign(3)
        standby.load()
        with pytest.raises(NotLeaderError):  # ... and a standby's write is refused by the fence
            standby.execute(decision, 0)
        assert leader.election.token == token and json.loads(store.get(store.keys.coordinator_state()).value)[
            "leader"] == "first"
    finally:
        for lease in leases:
            lease.close()
        leader.election.resign()
        for s in stores:
            s.close()


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_a_node_lost_during_the_failover_is_detected_within_its_ttl_plus_the_failover(etcd_cluster,
                                                                                      tmp_path) -> None:
    import json
    import subprocess

    from unicron_elastic.store.client import FAILOVER_REQUEST_TIMEOUT_S

    ttl = 1
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=BIN + os.pathsep + os.environ["PATH"])
    conf = "--rdzv-conf=cluster=failover,keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=1"
    cmd = [os.path.join(BIN, "unicron-run"), f"--rdzv-endpoint={etcd_cluster.endpoint}", "--rdzv-id=lost-during",
           "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=2", f"--node-ttl={ttl}", conf, "--log-format=json",
           os.path.join(EXAMPLES, "resilient_worker.py"), "--steps", "400", "--step-time", "0.05",
           "--out", str(tmp_path / "out")]
    nodes = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env) for _ in range(2)]
    with StatusStore(replace(etcd_cluster.config, cluster="failover")) as store:
        try:
            wait_for(lambda: len(store.get_prefix(store.keys.nodes())) == 2
                     and len(list((tmp_path / "out").glob("*.step"))) == 2, deadline_s=60, why="no training")
            victim = next(iter(store.get_json_prefix(store.keys.nodes())))
            member = etcd_cluster.members[0]  # the member every launcher started on
            member.proc.kill()
            kill_node(int(victim.rsplit("-", 1)[-1]))
            killed_at = time.time()
            member.proc.wait()
            found = wait_for(lambda: [e for e in map(json.loads, (kv.value for kv in store.get_prefix(
                store.keys.events()))) if e["kind"] == "lost_connection"], deadline_s=30, why="no SEV1 event")
        finally:
            for p in nodes:
                kill_node(p.pid)
    event = found[0]
    assert event["severity"] == "SEV1" and event["node"] == victim.rsplit("/", 1)[-1]
    assert event["detected_at"] - killed_at <= 2 * ttl + FAILOVER_REQUEST_TIMEOUT_S + 0.5  # as without a failover


def _lose(members: list) -> None:
    for member in members:
        member.proc.kill()
        member.proc.wait()
        member.kill()  # (its guard and log; the data stays for the restart)


@pytest.mark.e2e
@pytest.mark.timeout(150)
def test_a_job_rides_out_a_lost_quorum_shorter_than_the_reconnect_timeout(etcd_cluster, tmp_path) -> None:
    from test_store_outage import ride_out_outage

    down = etcd_cluster.members[:2]  # the member in use and another: no quorum
    ride_out_outage(etcd_cluster.endpoint, "failover", tmp_path, lambda: _lose(down),
                    lambda: [member.start() for member in down])


@pytest.mark.timeout(60)
def test_a_lost_quorum_longer_than_the_reconnect_timeout_is_one_clear_error(etcd_cluster) -> None:
    from unicron_elastic.api import StoreUnavailableError

    store = StatusStore(replace(etcd_cluster.config, reconnect_timeout=2.0))
    try:
        store.put("/k", "v")
        _lose(etcd_cluster.members[:2])
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError, match=f"etcd at {etcd_cluster.endpoint} unreachable for 2.0s"):
            store.put("/k", "w")
        assert time.monotonic() - started < 2.0 + 1.0 + 1.0  # the timeout, one last request, slack
    finally:
        store.close()


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_a_store_with_a_password_authenticates_on_the_member_it_moves_to(etcd_cluster) -> None:
    from test_status_cli import enable_auth

    enable_auth(etcd_cluster.members[0])  # (authentication belongs to the cluster)
    store = StatusStore(replace(etcd_cluster.config, user="unicron", password="s3cret"))
    try:
        store.put("/k", "before")
        in_use = store.member
        victim = next(m for m in etcd_cluster.members if m.endpoint == in_use)
        victim.proc.kill()
        victim.proc.wait()
        store.put("/k", "after")
        assert store.member != in_use and store.get("/k").value == b"after"
    finally:
        store.close()
