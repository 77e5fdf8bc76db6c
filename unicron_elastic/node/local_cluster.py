"""A whole coordinated cluster on one machine: etcd, coordinators and node daemons on loopback.

What ``unicron cluster up`` runs, and what the tests and the README's demo use.
Every part is its own process (a node daemon with its launcher and workers is
one process tree, so losing a node is killing that tree); leaving the ``with``
block stops them all (SIGTERM, then SIGKILL) and removes etcd's data.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import structlog

from unicron_elastic.processes import signal_tree
from unicron_elastic.store.embedded import EmbeddedEtcd, EmbeddedEtcdCluster

log = structlog.get_logger(__name__)


class LocalCluster:
    """etcd, ``coordinators`` coordinators and ``nodes`` daemons named ``node0``, ``node1``...

    Args:
        nodes: Node daemons to start.
        slots: Slots of each.
        cluster: Cluster name.
        coordinators: Coordinator processes (one leads, the others stand by).
        node_ttl: Lease TTL of each node daemon.
        coordinator_ttl: Lease TTL of the leader key.
        launcher_args: Extra ``unicron-run`` flags for every task.
        coordinator_args: Extra ``unicron-coordinator`` flags.
        env: Extra environment of every process.
        etcd: An etcd to use, one server or a cluster (started if it is not; never stopped); default: a
            private one of ``etcd_members`` members.
        log_dir: Folder for each part's output (``coordinator-<i>.log``, ``<node>.log``); default: inherited.
        node_args: Extra ``unicron node`` flags (e.g. ``--leave-timeout=300``).
        etcd_members: Members of the private etcd (1; 3 or 5 to survive losing 1 or 2).
    """

    def __init__(self, nodes: int = 3, slots: int = 2, cluster: str = "local", coordinators: int = 1,
                 node_ttl: int = 2, coordinator_ttl: int = 2, launcher_args: Sequence[str] = (),
                 coordinator_args: Sequence[str] = (), env: dict[str, str] | None = None,
                 etcd: EmbeddedEtcd | EmbeddedEtcdCluster | None = None,
                 log_dir: str | os.PathLike[str] | None = None, node_args: Sequence[str] = (),
                 etcd_members: int = 1) -> None:
        self._own_etcd = etcd is None
        self.etcd = etcd or (EmbeddedEtcd(cluster=cluster) if etcd_members == 1
                             else EmbeddedEtcdCluster(etcd_members, cluster=cluster))
        self.log_dir = None if log_dir is None else Path(log_dir)
        self._logs: list = []
        self.cluster = cluster
        self.slots = slots
        self.node_ttl = node_ttl
        self.coordinator_ttl = coordinator_ttl
        self.launcher_args = list(launcher_args)
        self.coordinator_args = list(coordinator_args)
        self.node_args = list(node_args)
        self.env = {**os.environ, **(env or {})}
        self.daemons: dict[str, subprocess.Popen] = {}
        self.coordinators: list[subprocess.Popen] = []
        self._want_nodes = nodes
        self._want_coordinators = coordinators

    @property
    def endpoint(self) -> str:
        """etcd's ``host:port`` (every member's, comma-separated)."""
        return self.etcd.endpoint

    def _etcd_members(self) -> list[EmbeddedEtcd]:
        return list(getattr(self.etcd, "members", [self.etcd]))

    def _etcd_flags(self) -> list[str]:
        return [f"--endpoint={self.endpoint}", f"--cluster={self.cluster}"]

    def start_node(self, name: str) -> subprocess.Popen:
        """Start (or start again) the daemon of node ``name``."""
        argv = [sys.executable, "-m", "unicron_elastic.cli", "node", *self._etcd_flags(), f"--name={name}",
                f"--slots={self.slots}", f"--ttl={self.node_ttl}",
                *[f"--launcher-arg={a}" for a in self.launcher_args], *self.node_args]
        self.daemons[name] = self._spawn(argv, name)
        return self.daemons[name]

    def _spawn(self, argv: list[str], name: str) -> subprocess.Popen:
        if self.log_dir is None:
            return subprocess.Popen(argv, env=self.env)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        out = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop()
        self._logs.append(out)
        return subprocess.Popen(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT)

    def start_coordinator(self) -> subprocess.Popen:
        """Start one more coordinator (a standby if one leads)."""
        argv = [sys.executable, "-m", "unicron_elastic.cluster_cli", *self._etcd_flags(),
                f"--ttl={self.coordinator_ttl}", *self.coordinator_args]
        proc = self._spawn(argv, f"coordinator-{len(self.coordinators)}")
        self.coordinators.append(proc)
        return proc

    def start(self) -> LocalCluster:
        """Start etcd, the coordinators and the node daemons."""
        if any(member.proc is None for member in self._etcd_members()):
            self.etcd.start()
        for _ in range(self._want_coordinators):
            self.start_coordinator()
        for i in range(self._want_nodes):
            self.start_node(f"node{i}")
        return self

    def dead(self) -> str | None:
        """The part without which the cluster cannot go on, if it exited: etcd, or every coordinator.

        A node daemon that exits is a lost node: the cluster carries on (see :meth:`dead_nodes`); so
        does etcd while most of its members run.
        """
        members = self._etcd_members()
        exited = [m for m in members if m.proc is not None and m.proc.poll() is not None]
        if len(exited) > (len(members) - 1) // 2:
            return "etcd" if len(members) == 1 else "etcd's quorum"
        if self.coordinators and all(p.poll() is not None for p in self.coordinators):
            return "every coordinator"
        return None

    def dead_nodes(self) -> list[str]:
        """Nodes whose daemon exited (killed, or it lost its lease)."""
        return [name for name, proc in self.daemons.items() if proc.poll() is not None]

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the daemons (they stop their workers), the coordinators, then etcd."""
        procs = list(self.daemons.values()) + self.coordinators
        for proc in procs:
            if proc.poll() is None:  # (daemons: SIGINT stops at once; SIGTERM would drain each node)
                proc.send_signal(signal.SIGINT if proc in self.daemons.values() else signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("cluster_part_killed", pids=signal_tree(proc.pid))
                proc.wait()
        if self._own_etcd:
            self.etcd.stop()
        for out in self._logs:
            out.close()

    def __enter__(self) -> LocalCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
