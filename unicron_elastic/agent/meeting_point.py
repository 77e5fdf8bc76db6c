"""The agent's side of the workers' meeting store in etcd (see :mod:`unicron_elastic.meeting`).

The agent tells its workers where the store is and keeps one liveness key per
worker there: put when the worker starts, deleted within milliseconds of its
exit, and attached to a lease of this node so that all of the node's keys
vanish within one TTL when the node is lost.

The agent also hosts a snapshot server in its own memory (a TCPStore, port
chosen by the OS) and publishes its ``host:port`` there on the same lease:
the shards of the primary replica write the in-memory snapshot to the *next*
live node's server (GEMINI's placement, :mod:`unicron_elastic.strategy.snapshots`),
so losing a node loses its replicas, not the snapshot.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, replace

import structlog
import torch.distributed as dist

from unicron_elastic.api import PlaceTakenError, StoreError
from unicron_elastic.env import clear_meeting, set_meeting
from unicron_elastic.meeting import encode_meeting
from unicron_elastic.rendezvous.api import PlaceOwner, RoundStart
from unicron_elastic.rendezvous.rounds import initial_round, raise_places
from unicron_elastic.store.c10d import EtcdC10dStore
from unicron_elastic.store.client import StatusStore
from unicron_elastic.store.keys import MeetingKeys
from unicron_elastic.store.lease import KeptLease

log = structlog.get_logger(__name__)


class MeetingPoint:
    """One run's meeting store as the agent of one node keeps it.

    Args:
        store: The etcd status store of the ``unicron`` rendezvous.
        run_id: The run.
        round_: The rendezvous round the workers were started in (each round
            of a restart-all meets in a fresh space).
        ttl: Lease TTL of this node (seconds).
        group_rank: This node's rank in the round.
        nodes: Nodes in the round (places: a node that grew the run counts itself).
        host: The address this node's snapshot server is reached at (the
            node's rendezvous address: ``--local-addr``, else its FQDN).
        start: The round as torch formed it, as this agent sees it: the
            round's first agent records it (create-only); every agent then
            reads the record back (:attr:`start`), as does a node that grows the run.
        on_place_lost: Called once (from the lease's keep-alive thread) when
            this node lost its place: its lease lapsed and another node
            claimed the place before the renewal could put the node's keys
            back (see :meth:`_rekey`).
        node: This node's name (``--node-name``), in its agent key (default: the host name).
        on_peer_lost: Called ``(node, revision)`` from a watch thread when the
            place of another node of the round vanished without its owner
            marking it left (its lease expired: the node is lost); ``revision``
            is the deletion's. None: the round's places are not watched.
        on_lease_lost: Called once when this node's lease could not be kept
            (etcd unreachable past the store's patience; see :class:`KeptLease`).

    Raises:
        StoreError: etcd refused or could not be reached.
    """

    def __init__(self, store: StatusStore, run_id: str, round_: int, ttl: int, group_rank: int, nodes: int,
                 *, host: str, start: RoundStart | None = None,
                 on_place_lost: Callable[[], None] | None = None, node: str | None = None,
                 on_peer_lost: Callable[[str, int], None] | None = None,
                 on_lease_lost: Callable[[], None] | None = None) -> None:
        self.store = store
        self.prefix = f"{store.keys.meeting(run_id)}{int(round_)}/"
        self.group_rank = group_rank
        self.place = PlaceOwner(node or socket.gethostname(), socket.gethostname(), os.getpid(), int(round_),
                                 int(group_rank))
        #: The value of this node's agent key: who holds the place (a renewal puts it back only if nobody took it).
        self.owner = self.place.encode()
        self._lock = threading.Lock()
        self._live: dict[int, str] = {}  # rank -> incarnation, the keys on this node's lease
        self._snapshot_address: str | None = None
        self._on_place_lost = on_place_lost
        self._places: PlacesWatch | None = None
        self.lease = KeptLease(store, ttl, on_lost=on_lease_lost, on_renewed=self._rekey)
        store.put(self.prefix + MeetingKeys.LIVENESS, b"1")
        if start is not None:  # create-only: the round's first agent records it (before anyone can rejoin)
            store.cas(self.prefix + MeetingKeys.AGENTS_INITIAL, json.dumps(asdict(start)).encode(), None)
        #: The round as its first agent recorded it (None: nobody did).
        self.start = initial_round(store, self.prefix)
        raise_places(store, self.prefix, nodes)
        store.put(self.prefix + MeetingKeys.agent(group_rank), self.owner.encode(), lease=self.lease.id)
        store.put(self.prefix + MeetingKeys.agent_seen(group_rank), b"1")
        self.snapshots = self._serve_snapshots(host)
        if on_peer_lost is not None:
            self._places = PlacesWatch(store, self.prefix, group_rank, on_peer_lost)

    def _rekey(self, lease: int) -> None:
        """Put this node's keys back on ``lease``: its lease lapsed while the node was alive (an overloaded host).

        Peers regrouping while the keys were gone counted these workers dead
        and left them out; they come back as joiners (see
        :func:`unicron_elastic.strategy.engine.membership.role`). The place itself
        is put back create-only: a node that arrived meanwhile may have found
        it free and claimed it (its workers take these ranks), and then this
        node has lost it (the fencing of :meth:`RunRounds.claim
        <unicron_elastic.rendezvous.rounds.RunRounds.claim>`).

        Raises:
            PlaceTakenError: Another node holds this node's place now
                (``on_place_lost`` ran; the lease counts as lost).
            StoreError: etcd refused or could not be reached.
        """
        key = self.prefix + MeetingKeys.agent(self.group_rank)
        mine = self.owner.encode()
        # The lock is held across the writes: a worker exiting meanwhile must not be put back.
        with self._lock:
            owner = None if self.store.cas(key, mine, None, lease=lease).succeeded else self.store.get(key)
            if owner is not None and owner.value == mine:
                # The key is still there, and it is ours: etcd had not dropped the old lease yet.
                self.store.put(key, mine, lease=lease)
                owner = None
            if owner is None:
                self._put_keys_back(lease)
            ranks = sorted(self._live)
        if owner is not None:
            log.error("place_taken", group_rank=self.group_rank, owner=owner.value.decode(errors="replace"))
            if self._on_place_lost is not None:
                self._on_place_lost()
            raise PlaceTakenError(f"place {self.group_rank} of {self.prefix} was taken while this node's lease had lapsed")
        log.warning("meeting_keys_renewed", group_rank=self.group_rank, ranks=ranks)

    def _put_keys_back(self, lease: int) -> None:
        """Re-put the snapshot address and the workers' liveness keys on ``lease`` (caller holds the lock)."""
        if self._snapshot_address is not None:
            self.store.put(self.prefix + MeetingKeys.snapshot_host(self.group_rank),
                           self._snapshot_address.encode(), lease=lease)
        for rank, incarnation in self._live.items():
            self.store.put(self.prefix + MeetingKeys.live(rank), incarnation.encode(), lease=lease)

    def _serve_snapshots(self, host: str) -> dist.TCPStore | None:
        """Start this node's snapshot server and publish ``host:port`` on the node's lease (None: it failed)."""
        try:
            server = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        except (RuntimeError, OSError) as exc:  # the node trains on; peers' snapshots go elsewhere
            log.warning("snapshot_server_failed", host=host, error=str(exc)[:200])
            return None
        address = f"{host}:{server.port}"
        self._snapshot_address = address
        self.store.put(self.prefix + MeetingKeys.snapshot_host(self.group_rank), address.encode(), lease=self.lease.id)
        log.info("snapshot_server_started", address=address)
        return server

    def export(self) -> None:
        """Set :data:`~unicron_elastic.env.MEETING` (and the password variable) for the workers started next."""
        set_meeting(encode_meeting(self.store.config, self.prefix), self.store.config.password)

    def worker_started(self, rank: int, incarnation: str, leaving: bool = False) -> None:
        """Worker ``rank`` runs as ``incarnation`` (its liveness key lives with this node's lease).

        Peers compare the value with the one their group was formed with: a
        restarted worker is a new incarnation, a joiner, not the member they
        wait for. ``leaving``: this node is leaving the task, so the new worker
        is asked to leave too (it then does not join); otherwise an old leave
        request for the rank is dropped.
        """
        with self._lock:
            self._live[rank] = incarnation
            try:
                self.store.put(self.prefix + MeetingKeys.live(rank), incarnation.encode(), lease=self.lease.id)
            except StoreError as exc:
                if "lease not found" not in str(exc):
                    raise
                log.warning("liveness_put_deferred", rank=rank, reason="the node's lease lapsed: its renewal puts it")
        if leaving:
            self.ask_to_leave([rank])
        else:
            self.withdraw_leave(rank)

    def mark_growable(self) -> None:
        """A worker said it can join a running group with a rank past the round's world: a node may grow the run.

        Raises:
            StoreError: etcd refused or could not be reached.
        """
        self.store.put(self.prefix + MeetingKeys.GROWABLE, b"1")

    def ask_to_leave(self, ranks: list[int]) -> None:
        """Ask workers ``ranks`` to leave the data-parallel group at the next step boundary.

        The requests are counted on :attr:`MeetingKeys.JOIN_REQUESTS` (the
        counter the group's primary reads between steps), then written in one
        transaction (the primary sees all of them or none, so a node's ranks
        leave at the same step).

        Raises:
            StoreError: etcd refused or could not be reached.
        """
        keys = [self.prefix + MeetingKeys.leave(r) for r in ranks]
        fresh = [k for k in keys if self.store.get(k) is None]
        if not fresh:
            return
        EtcdC10dStore(self.store, self.prefix).add(MeetingKeys.JOIN_REQUESTS, len(fresh))  # first: see _request_join
        self.store.call(lambda c: c.transaction(compare=[], success=[c.transactions.put(k, b"1") for k in fresh],
                                                failure=[]), "leave requests")

    def withdraw_leave(self, rank: int) -> None:
        """Drop ``rank``'s leave request, if any (it exited, or a worker not leaving started for it)."""
        try:
            if self.store.delete(self.prefix + MeetingKeys.leave(rank)):
                EtcdC10dStore(self.store, self.prefix).add(MeetingKeys.JOIN_REQUESTS, -1)
        except StoreError as exc:
            log.warning("leave_request_not_withdrawn", rank=rank, error=str(exc)[:200])

    def worker_exited(self, rank: int) -> None:
        """Worker ``rank`` exited: peers regrouping stop waiting for it; its leave request (if any) goes."""
        with self._lock:
            self._live.pop(rank, None)
            try:
                self.store.delete(self.prefix + MeetingKeys.live(rank))
            except StoreError as exc:  # the lease removes it within one TTL
                log.warning("liveness_delete_failed", rank=rank, error=str(exc)[:200])
        self.withdraw_leave(rank)

    def exit_barrier(self, nodes: int, timeout: float) -> list[int]:
        """Wait until the agent of every node finished its workers or is gone (its lease lapsed).

        torch's exit barrier waits for every node of the round: a node that
        was lost would hold the survivors for the whole timeout.

        Args:
            nodes: Nodes in the round when this node joined it (places added
                since, by nodes that grew the run, are waited for too).
            timeout: Seconds to wait at most.

        Returns:
            The nodes (group ranks) still running when the wait ended (empty: all done or gone).
        """
        self.store.put(self.prefix + MeetingKeys.agent_done(self.group_rank), b"1")
        deadline = time.monotonic() + timeout
        while True:
            places = self.store.get(self.prefix + MeetingKeys.AGENTS_WORLD)
            running = [g for g in range(max(nodes, int(places.value) if places is not None else 0))
                       if self.store.get(self.prefix + MeetingKeys.agent_done(g)) is None
                       and self.store.get(self.prefix + MeetingKeys.agent(g)) is not None]
            if not running or time.monotonic() >= deadline:
                return running
            time.sleep(0.05)

    def close(self) -> None:
        """Mark the place left, revoke the lease (every liveness key of this node goes with it), then stop the
        snapshot server.

        The server (and the snapshot in it) is dropped even when revoking fails.
        """
        clear_meeting()
        if self._places is not None:
            self._places.cancel()
        try:
            self._mark_left()
            self.lease.close(revoke=True)
        finally:
            self.snapshots = None  # the last reference: the TCPStore server stops (no blocking call)

    def _mark_left(self) -> None:
        """Tell the round's watchers this place goes on purpose (no lost node); a failure is logged."""
        if self.lease.lost.is_set():
            return
        key, left = self.prefix + MeetingKeys.agent(self.group_rank), replace(self.place, left=True).encode()
        # The place is marked only while this node still holds it.
        try:
            self.store.call(lambda c: c.transaction(compare=[c.transactions.value(key) == self.owner],
                                                    success=[c.transactions.put(key, left, lease=self.lease.id)],
                                                    failure=[]), f"mark {key} left", patience=2.0)
        except StoreError as exc:
            log.warning("place_not_marked_left", group_rank=self.group_rank, error=str(exc)[:200])


class PlacesWatch:
    """The places of one round, as their owners' agent keys say: a node lost is told within its lease TTL.

    One watch per node on the round's place keys (:attr:`MeetingKeys.PLACES`): a lost node's place vanishes
    with its lease, seen by the run's other nodes only (not by every node of the cluster). The watch gets
    deletes only, each with the owner it deleted: the places taken while a round forms (N nodes, each seen
    by the others) cost it nothing, so a round of N nodes sends N events per loss, not N² while it forms.

    Args:
        store: The status store.
        prefix: The round's meeting space.
        own: This node's place (its own changes are not reported).
        on_peer_lost: Called ``(node, revision)`` when another owner's place vanished without being marked left.

    Raises:
        StoreError: etcd refused or could not be reached.
    """

    def __init__(self, store: StatusStore, prefix: str, own: int, on_peer_lost: Callable[[str, int], None]) -> None:
        from unicron_elastic.store.watch import PrefixWatch

        self._base = prefix + MeetingKeys.PLACES
        self._own, self._on_peer_lost = own, on_peer_lost
        self._watch = PrefixWatch(store, self._base, self._on_change, deletes_only=True)

    def _place(self, key: str) -> int | None:
        suffix = key[len(self._base):]
        return int(suffix) if suffix.isdigit() else None

    def _on_change(self, event) -> None:
        place = self._place(event.key)
        owner = PlaceOwner.decode(event.previous) if event.kind == "delete" and event.previous else None
        if place is None or owner is None or owner.left or place == self._own:
            return
        log.warning("peer_place_lost", place=place, node=owner.node, revision=event.revision)
        self._on_peer_lost(owner.node, event.revision)

    def cancel(self) -> None:
        """Stop watching."""
        self._watch.cancel()
