"""The store on an etcd cluster: endpoint lists, and a client that moves to another member when its own is lost.

A real three-member etcd on loopback (``EmbeddedEtcdCluster``); a member is
lost by SIGKILL.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

import pytest

import unicron_elastic.store.client as client_module
from conftest import events_named
from unicron_elastic.api import ConfigError, EtcdConfig
from unicron_elastic.meeting import decode_meeting, encode_meeting
from unicron_elastic.rendezvous.options import parse_endpoints, parse_options
from unicron_elastic.store.client import StatusStore
from unicron_elastic.store.embedded import EmbeddedEtcdCluster
from unicron_elastic.store.lease import KeptLease


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


@pytest.mark.timeout(60)
@pytest.mark.parametrize("lost", ["the member in use", "another member"])
def test_losing_a_member_costs_a_request_at_most_a_second_and_the_lease_lives_on(etcd_cluster, capture_log,
                                                                                 lost: str) -> None:
    captured = capture_log(client_module)
    store = StatusStore(etcd_cluster.config)
    lapsed: list[bool] = []
    lease = KeptLease(store, 2, on_lost=lambda: lapsed.append(True))
    try:
        store.put("/k", "before")
        in_use = store.member
        victim = next(m for m in etcd_cluster.members if (m.endpoint == in_use) == (lost == "the member in use"))
        victim.proc.kill()
        victim.proc.wait()
        started = time.monotonic()
        store.put("/k", "after")
        assert time.monotonic() - started < 1.0 + 0.5  # a leader election at most (FAILOVER_REQUEST_TIMEOUT_S)
        assert store.get("/k").value == b"after"
        moves = events_named(captured, "etcd_failover")
        if lost == "the member in use":
            assert moves and moves[0]["from_member"] == in_use and store.member != victim.endpoint
        else:
            assert moves == [] and store.member == in_use
        time.sleep(3)  # past the lease's TTL
        assert lapsed == [] and store.call(lambda c: c.get_lease_info(lease.id).TTL, "lease") > 0
        assert events_named(captured, "etcd_unreachable_retrying") == []  # a failover is not an outage
    finally:
        lease.close()
        store.close()


@pytest.mark.timeout(60)
def test_unicron_etcd_runs_a_three_member_cluster_and_stops_it_whole() -> None:
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
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert [pid for pid in tree if pid != proc.pid and os.path.exists(f"/proc/{pid}")] == []
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(60)
def test_a_watch_whose_member_is_lost_resumes_on_another_and_misses_nothing(etcd_cluster) -> None:
    from conftest import wait_for
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
