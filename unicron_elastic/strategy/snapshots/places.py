"""Where in-memory snapshots go and come from: GEMINI's placement over the agents' snapshot servers.

Under ``unicron-run`` each agent hosts a snapshot server (a TCPStore in its
memory) and publishes its address in the run's meeting space on its node's
lease; a snapshot goes to the next two live nodes in ring order
(:func:`snapshot_targets`), so losing any one node loses a copy, never the
only one. Under plain ``torchrun`` it is torch's agent TCPStore
(:class:`_OneStore`).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import structlog
import torch.distributed as dist

from unicron_elastic.api import ConfigError
from unicron_elastic.meeting import decode_meeting
from unicron_elastic.store.keys import MeetingKeys
from unicron_elastic.strategy.snapshots.wire import UNREACHABLE

log = structlog.get_logger(__name__)


def snapshot_targets(own_node: int, live_nodes: Sequence[int], copies: int = 2) -> list[int]:
    """The nodes whose agents hold the snapshot written on ``own_node`` (GEMINI's ring).

    With three or more live nodes the snapshot has two targets, so it
    survives the loss of any one node, the writer's or a target's, even
    while another target is unreachable (frozen). With two nodes the other
    one holds it: losing it leaves the writer, whose state is live; losing
    the writer leaves the target.

    Args:
        own_node: The writer's node (group rank).
        live_nodes: The nodes whose agents are alive (any order; may include ``own_node``).
        copies: Targets wanted (at most the other live nodes).

    Returns:
        The next ``copies`` live nodes after ``own_node`` in ring order
        (wrapping to the lowest); ``[own_node]`` only when no other node is
        alive (then the snapshot does not survive losing that node).
    """
    others = sorted(set(live_nodes) - {own_node})
    if not others:
        return [own_node]
    ring = [node for node in others if node > own_node] + [node for node in others if node < own_node]
    return ring[:max(1, copies)]


class _OneStore:
    """The snapshot's place under plain ``torchrun``: one store, written and read."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store

    def targets(self) -> list[tuple[str, dist.Store]]:
        return [("the agent's store", self.store)]

    sources = targets

    def spec(self) -> dict[str, Any] | None:
        """How another process reaches the store (a TCPStore), or None (an in-process store)."""
        if isinstance(self.store, dist.TCPStore):
            return {"kind": "tcp", "host": self.store.host, "port": self.store.port}
        return None


def places_from(spec: dict[str, Any]) -> _OneStore | PeerServers:
    """The places a description names (:meth:`_OneStore.spec`, :meth:`PeerServers.spec`): in the snapshot writer.

    Raises:
        ConfigError: An unknown kind, or a malformed meeting description.
        RuntimeError: The TCPStore cannot be reached.
    """
    if spec.get("kind") == "tcp":
        return _OneStore(dist.TCPStore(spec["host"], int(spec["port"]), is_master=False,
                                       timeout=timedelta(seconds=30)))
    if spec.get("kind") == "peers":
        return PeerServers.from_meeting(spec["meeting"], int(spec["node"]))
    raise ConfigError(f"unknown snapshot place {spec!r}")


class PeerServers:
    """The agents' snapshot servers of one run, as published in its meeting store (GEMINI placement).

    Each agent of ``unicron-run`` hosts a TCPStore in its own memory and puts
    its ``host:port`` under :meth:`MeetingKeys.snapshot_host` on its node's
    lease, so a lost node's server vanishes from the list within one TTL.

    Args:
        meeting: The workers' meeting store (etcd).
        node: This worker's node (its group rank, ``GROUP_RANK``).
        connect_timeout: Bound of each connection to a server.
    """

    def __init__(self, meeting: dist.Store, node: int, connect_timeout: timedelta = timedelta(seconds=5),
                 meeting_spec: str | None = None) -> None:
        self.meeting, self.node, self.connect_timeout = meeting, int(node), connect_timeout
        self.meeting_spec = meeting_spec
        self._alone = False

    @classmethod
    def from_meeting(cls, meeting_spec: str, node: int) -> PeerServers:
        """The servers of the run whose meeting store ``meeting_spec`` (``$UNICRON_MEETING``'s value) names.

        Raises:
            ConfigError: ``meeting_spec`` is malformed.
        """
        from unicron_elastic.store.c10d import EtcdC10dStore
        from unicron_elastic.store.client import StatusStore

        config, prefix = decode_meeting(meeting_spec)
        meeting = EtcdC10dStore(StatusStore(config), prefix, timeout=timedelta(seconds=5))
        return cls(meeting, node, meeting_spec=meeting_spec)

    def spec(self) -> dict[str, Any] | None:
        """How another process finds the same servers (built :meth:`from_meeting`), or None."""
        return None if self.meeting_spec is None else {"kind": "peers", "node": self.node,
                                                       "meeting": self.meeting_spec}

    def hosts(self) -> dict[int, str]:
        """``{node: "host:port"}`` of the live servers (a node of the round without one is gone).

        Raises:
            StoreError: etcd is unreachable.
        """
        found = {}
        for node in range(self._world()):
            key = MeetingKeys.snapshot_host(node)
            try:
                if self.meeting.check([key]):
                    found[node] = self.meeting.get(key).decode()
            except LookupError:  # its lease lapsed between the two reads
                pass
        return found

    def targets(self) -> list[tuple[str, dist.Store]]:
        """The servers the snapshot written on this node goes to: the next two live nodes' (:func:`snapshot_targets`).

        Raises:
            StoreError: etcd is unreachable.
        """
        hosts = self.hosts()
        nodes = snapshot_targets(self.node, sorted(hosts))
        alone = nodes == [self.node]
        if alone and not self._alone:
            log.warning("snapshot_not_replicated", node=self.node,
                        reason="no other node is alive: the snapshot does not survive losing this node")
        self._alone = alone
        return self._connect({node: hosts.get(node) for node in nodes})

    def sources(self) -> list[tuple[str, dist.Store]]:
        """Every live server this process can reach (a warning for each node of the round it cannot).

        Raises:
            StoreError: etcd is unreachable.
        """
        hosts = self.hosts()
        return self._connect({node: hosts.get(node) for node in range(self._world())})

    def _world(self) -> int:
        """Nodes in the round (0 before any agent published it)."""
        if not self.meeting.check([MeetingKeys.AGENTS_WORLD]):
            return 0
        return int(self.meeting.get(MeetingKeys.AGENTS_WORLD))

    def _connect(self, hosts: dict[int, str | None]) -> list[tuple[str, dist.Store]]:
        stores = []
        for node, address in hosts.items():
            where = f"node {node}'s agent ({address})"
            if address is None:
                log.warning("snapshot_unreachable", node=node, error="its agent is gone (no snapshot server)")
                continue
            host, _, port = address.rpartition(":")
            try:
                stores.append((where, dist.TCPStore(host, int(port), is_master=False, timeout=self.connect_timeout)))
            except UNREACHABLE as exc:
                log.warning("snapshot_unreachable", node=node, address=address, error=str(exc)[:200])
        return stores
