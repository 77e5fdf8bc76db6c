"""Leader election from a lease and a transaction (python3-etcd3 has none).

The leader key is created, attached to the candidate's lease, only if it does
not exist. Its ``create_revision`` is the *fencing token*: writes to shared
state made with :meth:`LeaderElection.fenced_put` carry the comparison
``create_revision(leader key) == token``, so a deposed leader (whose lease
expired while it was paused) can never overwrite its successor's state.
"""

from __future__ import annotations

import threading
import time

import etcd3.utils
import structlog

from unicron_elastic.api import NotLeaderError
from unicron_elastic.store.client import KeyValue, StatusStore
from unicron_elastic.store.lease import KeptLease
from unicron_elastic.store.watch import PrefixWatch, WatchEvent

log = structlog.get_logger(__name__)


class LeaderElection:
    """Campaign for leadership of ``name`` in the store's cluster.

    Args:
        store: The status store.
        candidate: Identity written into the leader key (e.g. host:pid).
        name: Election name.
        ttl: Lease TTL; a dead leader is replaced within about this time.
    """

    def __init__(self, store: StatusStore, candidate: str, name: str = "coordinator", ttl: int = 5) -> None:
        self._store = store
        self.candidate = candidate
        self.key = store.keys.leader(name)
        self.ttl = ttl
        self._lease: KeptLease | None = None
        self.token: int | None = None

    def try_acquire(self) -> int | None:
        """One attempt to become leader.

        Returns:
            The fencing token if this candidate is now the leader, else None.
        """
        if self._lease is None or self._lease.lost.is_set():
            self._lease = KeptLease(self._store, self.ttl)
        result = self._store.cas(self.key, self.candidate, None, lease=self._lease.id)
        current = result.current
        if current is not None and current.lease == self._lease.id:
            self.token = current.create_revision
            log.info("leader_elected", election=self.key, candidate=self.candidate, token=self.token)
            return self.token
        return None

    def campaign(self, timeout: float | None = None) -> int:
        """Block until elected.

        Args:
            timeout: Seconds to wait at most; None waits forever.

        Returns:
            The fencing token.

        Raises:
            TimeoutError: Not elected within ``timeout``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        changed = threading.Event()

        def on_change(event: WatchEvent) -> None:
            if event.kind == "delete":
                changed.set()

        watch = PrefixWatch(self._store, self.key, on_change)
        try:
            while True:
                changed.clear()
                token = self.try_acquire()
                if token is not None:
                    return token
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"not elected leader of {self.key} within {timeout}s")
                changed.wait(timeout=min(1.0, remaining) if remaining is not None else 1.0)
        finally:
            watch.cancel()

    def leader(self) -> KeyValue | None:
        """The current leader key, or None if there is no leader."""
        return self._store.get(self.key)

    def is_leader(self) -> bool:
        """True while this candidate holds the leader key."""
        current = self.leader()
        return bool(
            current is not None and self._lease is not None and current.lease == self._lease.id
        )

    def holds_lease(self) -> bool:
        """False once this candidate's lease was lost (or never granted); no store request."""
        return self._lease is not None and not self._lease.lost.is_set()

    def fenced_put(self, key: str, value: bytes | str) -> int:
        """Write ``key`` only while this candidate is still the leader.

        Returns:
            The revision of the write.

        Raises:
            NotLeaderError: The leader key is gone or belongs to another term.
        """
        responses = self._fenced(lambda t: [t.put(key, value)], f"fenced put {key}")
        return int(responses[0].response_put.header.revision)

    def fenced_txn(self, puts: dict[str, str], deletes: tuple[str, ...] = (), delete_prefixes: tuple[str, ...] = ()) -> None:
        """Apply ``puts`` and deletions in one transaction, only while this candidate is the leader.

        Args:
            puts: Keys and values to write.
            deletes: Keys to delete.
            delete_prefixes: Prefixes to delete (must not overlap ``puts``: etcd refuses that).

        Raises:
            NotLeaderError: The leader key is gone or belongs to another term.
        """

        def ops(t):
            success = [t.put(k, v) for k, v in puts.items()] + [t.delete(k) for k in deletes]
            return success + [t.delete(p, range_end=etcd3.utils.prefix_range_end(etcd3.utils.to_bytes(p)))
                              for p in delete_prefixes]

        self._fenced(ops, "fenced transaction")

    def _fenced(self, ops, what: str) -> list:
        """One transaction of ``ops(transactions)`` guarded by ``create_revision(leader key) == token``.

        Raises:
            NotLeaderError: Never elected, or the leader key is gone or belongs to another term.
        """
        token = self.token
        if token is None:
            raise NotLeaderError(f"{self.candidate} was never elected for {self.key}")

        def op(c):
            return c.transaction(compare=[c.transactions.create(self.key) == token],
                                 success=ops(c.transactions), failure=[])

        ok, responses = self._store.call(op, what)
        if not ok:
            raise NotLeaderError(f"{self.candidate} lost leadership of {self.key} (token {token})")
        return responses

    def resign(self) -> None:
        """Give up leadership (revokes the lease, deleting the leader key)."""
        if self._lease is not None:
            self._lease.close(revoke=True)
            self._lease = None
        self.token = None
