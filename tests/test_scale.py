"""The control plane's etcd load stays flat in the cluster's size (issue #47; figures: benchmarks/RESULTS.md).

32 emulated nodes (``benchmarks/_scale_emu.py``: the real daemons, rendezvous, meeting points, node detectors
and coordinator, many nodes in this process) run two tasks of 16 nodes on the session's etcd. In the steady
state no daemon or agent writes to etcd and each node costs a fixed number of requests (its two leases'
keep-alives, two slow polls); a node lost is seen by the 15 other nodes of its run only, within its TTL, and
sends about one watch event to each of them. ``benchmarks/scale.py`` measured those per-node figures at 16 and
64 nodes (steady state and one loss; the 2,048-node figures in benchmarks/RESULTS.md are a linear model of them,
not a measurement); a change that makes any of them grow with the cluster fails here.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import REPO, wait_for

sys.path.insert(0, str(Path(REPO) / "benchmarks"))

import _scale_emu as emu  # noqa: E402

NODES, RUNS, TTL = 32, 2, 3
#: Per node and second in the steady state (the benchmark's figures, with room for a loaded machine):
KEEPALIVES_MAX = 2 * 4 / TTL * 1.25  # two leases (the daemon's, the agent's meeting point), each every TTL/4
WRITES_MAX = 0.02  # none: no daemon, agent or worker writes while nothing changes (measured: 0)
READS_MAX = 0.6  # the daemon's command re-check and the agent's look at announcements, each every 5 s
BYTES_MAX = 600  # payload bytes, whatever the run's size (torch's state is not read: measured ~200)


@pytest.mark.timeout(90)
def test_steady_state_costs_each_node_the_same_and_a_loss_is_told_to_its_run_only(etcd) -> None:
    daemon_env = os.environ.get("UNICRON_NODE_DAEMON")
    config = replace(etcd.config, cluster="scale-test", reconnect_timeout=30.0)
    cluster = emu.EmuCluster(config, emu.Settings(ttl=TTL, monitor_interval=0.5), coordinators=1)
    per_run = NODES // RUNS
    try:
        cluster.start_coordinators(ttl=5)
        names = cluster.start_daemons(NODES)
        cluster.wait_registered(NODES, timeout=30)
        for r in range(RUNS):
            cluster.submit(f"run{r}", per_run)
        cluster.wait_joined(names, timeout=60)
        runs = {name: agent.task for name, agent in cluster.agents().items()}
        assert sorted(runs.values()).count("run0") == per_run

        time.sleep(1.0)  # (the last nodes' start-up writes are done)
        emu.METER.reset()
        time.sleep(4.0)  # a measurement window, not a wait for a condition
        snap = emu.METER.snapshot()
        nodes = {role: emu.totals(snap, role) for role in ("daemon", "agent", "worker")}
        seconds = snap["seconds"]
        keepalives = sum(t.get("keepalive", 0) for t in nodes.values()) / NODES / seconds
        writes = sum(t.get(k, 0) for t in nodes.values()
                     for k in ("put", "txn", "deleterange", "leasegrant", "leaserevoke")) / NODES / seconds
        reads = sum(t.get("range", 0) + t.get("txn_read", 0) for t in nodes.values()) / NODES / seconds
        size = sum(v for (role, _, _), v in snap["bytes"].items() if role in nodes) / NODES / seconds
        assert keepalives <= KEEPALIVES_MAX, keepalives
        assert writes <= WRITES_MAX, writes
        assert reads <= READS_MAX, reads
        assert size <= BYTES_MAX, size
        assert sum(a.waiting_seen for a in cluster.agents().values()) == 0  # nobody asked for a restart-all

        victim = next(n for n, task in runs.items() if task == "run1")
        survivors = [n for n, task in runs.items() if task == "run1" and n != victim]
        emu.METER.reset()
        killed = time.monotonic()
        cluster.kill(victim)
        wait_for(lambda: len(cluster.losses.get(victim, {})) >= len(survivors), deadline_s=30,
                 why=lambda: f"told: {sorted(cluster.losses.get(victim, {}))}")
        told = cluster.losses[victim]
        assert set(told) == set(survivors)  # the other run's nodes are not told (they do not watch it)
        assert max(told.values()) - killed <= TTL + 3.0  # its lease's TTL, and the watch (loaded machine: slack)
        time.sleep(1.0)  # what the loss sets off (an event, a re-plan) lands
        events = emu.totals(emu.METER.snapshot()).get("watch_event", 0)
        assert events <= len(survivors) + 10, events  # one per survivor, a few for the coordinator: not per node
    finally:
        cluster.close()
    assert os.environ.get("UNICRON_NODE_DAEMON") == daemon_env  # (later launchers would wait for a plan to admit them)
