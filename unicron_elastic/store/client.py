"""A thin typed layer over the etcd v3 client: JSON values, CAS, reconnect.

Every request goes through :meth:`StatusStore.call`, which retries a request that
failed for connection reasons on a *fresh* client (python3-etcd3 refuses to
reuse a client after one failure) with exponential back-off, until
``EtcdConfig.reconnect_timeout`` has passed; then it raises
:class:`~unicron_elastic.api.StoreUnavailableError`. A short etcd outage is thus
invisible to callers, a long one is a clear error.

Many threads share one store and one client. When a request fails for connection
reasons, the first thread to notice drops (and closes) the shared client; a
request that another thread's drop cut short (``ValueError: Cannot invoke RPC
on closed channel!``, ``CANCELLED``) is *stale*, not an etcd failure, and is
retried at once on the current client. The start of an outage is logged once
(``etcd_unreachable_retrying``) and so is its end (``etcd_reconnected``, with
``outage_s``), however many threads wait through it.

Retried writes: a request whose reply was lost may have been applied. ``put``
and ``delete`` are idempotent; a retried :meth:`StatusStore.cas` may report a
conflict for a write of its own, which CAS callers handle anyway (they re-read).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import etcd3
import etcd3.exceptions
import grpc
import structlog

from unicron_elastic.api import (
    ConfigError,
    EtcdConfig,
    MalformedValueError,
    StoreError,
    StoreUnavailableError,
    member_endpoint,
)
from unicron_elastic.store import _etcd3_compat
from unicron_elastic.store.keys import Keys

log = structlog.get_logger(__name__)

#: Seconds a request may take on a member the store just moved to, until one succeeds there. A
#: request that reached a member while the cluster elects a new leader (the old one was lost) is
#: dropped by etcd and answered only at etcd's request timeout: it is tried again instead.
FAILOVER_REQUEST_TIMEOUT_S = 1.0

T = TypeVar("T")

#: Events kept under ``events/`` by :meth:`StatusStore.append_event` (env ``UNICRON_EVENT_RETENTION``).
DEFAULT_EVENT_RETENTION = 1000
EVENT_RETENTION_ENV = "UNICRON_EVENT_RETENTION"


def _event_retention_from_env() -> int:
    raw = os.environ.get(EVENT_RETENTION_ENV, "").strip()
    if not raw:
        return DEFAULT_EVENT_RETENTION
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"{EVENT_RETENTION_ENV}={raw!r} must be a whole number >= 1")
    return value


_CONNECTION_ERRORS = (
    etcd3.exceptions.ConnectionFailedError,
    etcd3.exceptions.ConnectionTimeoutError,
    etcd3.exceptions.NoServerAvailableError,
    etcd3.exceptions.InternalServerError,
)


#: etcd's answers while its cluster has no leader or just lost it (gRPC code UNKNOWN, or a server-side
#: deadline): the member is up, the request may succeed on another member or a moment later.
_LEADER_TROUBLE = ("context deadline exceeded", "etcdserver: request timed out", "etcdserver: leader changed",
                   "etcdserver: no leader")


def _is_connection_error(exc: BaseException) -> bool:
    if isinstance(exc, _CONNECTION_ERRORS):
        return True
    # python3-etcd3 raises this ValueError for an endpoint it marked failed.
    if isinstance(exc, ValueError) and "failed node" in str(exc):
        return True
    if isinstance(exc, grpc.RpcError):
        code = exc.code() if callable(getattr(exc, "code", None)) else None
        if code == grpc.StatusCode.UNAUTHENTICATED:
            # etcd's simple auth tokens expire: a fresh client authenticates again
            details = exc.details() if callable(getattr(exc, "details", None)) else ""
            return "invalid auth token" in (details or "")
        if code == grpc.StatusCode.UNKNOWN:
            details = exc.details() if callable(getattr(exc, "details", None)) else ""
            return any(text in (details or "") for text in _LEADER_TROUBLE)
        return code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    return False


def _describe(exc: BaseException) -> str:
    details = getattr(exc, "details", None)
    if callable(details) and details():
        code = exc.code().name if callable(getattr(exc, "code", None)) else ""
        return f"{code}: {details()}"
    return repr(exc)


@dataclass(frozen=True)
class KeyValue:
    """One key read from the store.

    Attributes:
        key: The key.
        value: The raw value.
        mod_revision: Revision of the last write of the key (the CAS token).
        create_revision: Revision that created the key.
        lease: ID of the lease the key is attached to, 0 if none.
    """

    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int


@dataclass(frozen=True)
class CasResult:
    """Outcome of a compare-and-set.

    Attributes:
        succeeded: True if the write was applied.
        current: The key as it is after the transaction (None if absent).
    """

    succeeded: bool
    current: KeyValue | None


def _kv(value: bytes, meta: Any) -> KeyValue:
    key = meta.key.decode() if isinstance(meta.key, bytes) else str(meta.key)
    return KeyValue(key, value, meta.mod_revision, meta.create_revision, meta.lease_id)


class StatusStore:
    """unicron's view of etcd: typed reads and writes under one cluster's prefix.

    Args:
        config: How to reach etcd.
        event_retention: Events :meth:`append_event` keeps; default
            ``$UNICRON_EVENT_RETENTION`` or 1000.

    Raises:
        ConfigError: ``event_retention`` (or its variable) is not a whole number >= 1.
        StoreUnavailableError: From any method, when etcd stays unreachable
            longer than ``config.reconnect_timeout``.
    """

    def __init__(self, config: EtcdConfig, event_retention: int | None = None) -> None:
        self.config = config
        self.event_retention = _event_retention_from_env() if event_retention is None else int(event_retention)
        if self.event_retention < 1:
            raise ConfigError(f"event_retention={event_retention!r} must be >= 1")
        self.keys = Keys(config.cluster)
        self._lock = threading.Lock()
        self._client: etcd3.Etcd3Client | None = None
        self._member = 0  # the index in config.members of the member clients are built for
        self._moved = False  # moved to another member and no request succeeded there yet
        self._closed = False
        self._outage_since: float | None = None  # monotonic time of the first failure

    # -- connection management -------------------------------------------------
    def _current_client(self) -> etcd3.Etcd3Client:
        with self._lock:
            if self._closed:
                raise StoreError("the status store is closed")
            if self._client is None:
                self._client = _etcd3_compat.new_client(self.config, self._member)
                if self._moved:
                    self._client.timeout = min(self.config.request_timeout, FAILOVER_REQUEST_TIMEOUT_S)
            return self._client

    def _is_current(self, client: etcd3.Etcd3Client) -> bool:
        with self._lock:
            return self._client is client

    def _drop_client(self, client: etcd3.Etcd3Client) -> None:
        """Forget and close ``client`` if it is still the shared one; the next one is for the next member.

        A client another thread already dropped was closed by that thread; the
        current client (maybe a fresh one other threads use) is left alone.
        With several members, the next client is built for the next one in
        ``config.members`` (``etcd_failover``, logged once per move).
        """
        with self._lock:
            if self._client is not client:
                return
            self._client = None
            moved = self._move_on()
        if moved is not None:
            log.warning("etcd_failover", **moved)
        try:
            client.close()
        except Exception:  # noqa: BLE001 - closing a broken channel may fail too
            pass

    def _move_on(self) -> dict[str, str] | None:
        """Under the lock: the next member (None with one member); the move, for the log."""
        members = self.config.members
        if len(members) == 1:
            return None
        before, self._member = self._member, (self._member + 1) % len(members)
        self._moved = True
        return {"from_member": member_endpoint(*members[before]), "to_member": member_endpoint(*members[self._member])}

    def _settled(self, client: etcd3.Etcd3Client) -> None:
        """A request succeeded on the member moved to: its requests get the full timeout again."""
        with self._lock:
            if self._client is client and self._moved:
                self._moved = False
                client.timeout = self.config.request_timeout

    @property
    def member(self) -> str:
        """The member this store's requests go to now (``host:port``)."""
        return member_endpoint(*self.config.members[self._member])

    def _note_failure(self, what: str) -> None:
        with self._lock:
            first = self._outage_since is None
            if first:
                self._outage_since = time.monotonic()
        if first:
            log.warning("etcd_unreachable_retrying", endpoint=self.config.endpoint, what=what)

    def _note_success(self, started: float) -> None:
        """A request sent at ``started`` succeeded; it ends an outage that began before it was sent."""
        if self._outage_since is None:  # the common case, without the lock
            return
        with self._lock:
            since = self._outage_since
            if since is None or started < since:
                return  # sent before the first failure: says nothing about now
            self._outage_since = None
        log.info("etcd_reconnected", endpoint=self.config.endpoint, outage_s=round(time.monotonic() - since, 3))

    def new_client(self, member: int | None = None) -> etcd3.Etcd3Client:
        """Return a new client of the caller's own (for long-lived watches).

        Args:
            member: The index in ``config.members`` of the member to connect
                to (default: the one this store's requests go to now).
        """
        return _etcd3_compat.new_client(self.config, self._member if member is None else member)

    @property
    def member_index(self) -> int:
        """The index in ``config.members`` of the member this store's requests go to now."""
        return self._member

    def call(self, op: Callable[[etcd3.Etcd3Client], T], what: str = "request", patience: float | None = None) -> T:
        """Run ``op(client)``, reconnecting on connection errors.

        Args:
            op: The request, given a client.
            what: Short description for logs and errors.
            patience: Seconds to keep reconnecting (default ``reconnect_timeout``):
                a caller that can do without the answer gives up sooner.

        Returns:
            What ``op`` returned.

        Raises:
            StoreUnavailableError: etcd was unreachable for longer than
                ``patience`` (``reconnect_timeout``).
            StoreError: etcd answered with an error that is not a connection
                problem.
        """
        patience = self.config.reconnect_timeout if patience is None else patience
        deadline = time.monotonic() + patience
        delay = 0.05
        attempt = 0
        while True:
            client = None
            started = time.monotonic()
            try:
                client = self._current_client()  # authenticates when user/password are set
                result = op(client)
            except Exception as exc:  # noqa: BLE001 - classified below
                # another thread dropped (closed) this client while we used it
                stale = client is not None and not self._is_current(client)
                connection = _is_connection_error(exc)
                if not (stale or connection):
                    if isinstance(exc, (etcd3.exceptions.Etcd3Exception, grpc.RpcError)):
                        raise StoreError(f"etcd {what} failed: {_describe(exc)}") from exc
                    raise
                attempt += 1
                now = time.monotonic()
                if now >= deadline:
                    raise StoreUnavailableError(
                        f"etcd at {self.config.endpoint} unreachable for "
                        f"{patience:.1f}s during {what} "
                        f"({attempt} attempts, last error: {type(exc).__name__})"
                    ) from exc
                if not connection:
                    continue  # stale client: retry at once on the current one
                if client is not None:
                    self._drop_client(client)  # (the next client is for the next member)
                if attempt < len(self.config.members):
                    continue  # another member may answer: at once, and no outage yet
                self._note_failure(what)
                time.sleep(min(delay, max(0.0, deadline - now)))
                delay = min(delay * 2, 1.0)
            else:
                if self._moved:
                    self._settled(client)
                self._note_success(started)
                return result

    def close(self) -> None:
        """Close the connection; later calls raise :class:`StoreError`."""
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def __enter__(self) -> StatusStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- raw bytes -------------------------------------------------------------
    def get(self, key: str, patience: float | None = None) -> KeyValue | None:
        """Read one key; None if absent (``patience``: see :meth:`call`)."""
        value, meta = self.call(lambda c: c.get(key), f"get {key}", patience)
        if meta is None:
            return None
        return _kv(value, meta)

    def get_prefix(self, prefix: str, limit: int | None = None, descending: bool = False) -> list[KeyValue]:
        """Read the keys under ``prefix``, sorted by key.

        Args:
            prefix: The key prefix.
            limit: Read at most this many keys, the first in the sort order
                (etcd applies it: a large prefix is not transferred).
            descending: Sort from the last key to the first.

        Raises:
            ConfigError: ``limit`` is below 1.
        """
        if limit is not None and limit < 1:
            raise ConfigError(f"limit={limit!r} must be >= 1")
        order = "descend" if descending else "ascend"
        items = self.call(lambda c: list(c.get_prefix(prefix, sort_order=order, limit=limit)), f"get {prefix}*")
        return [_kv(v, m) for v, m in items]

    def revision_and_count(self, key: str, prefix: str) -> tuple[int | None, int]:
        """In one request: the revision of ``key``'s last write (None if absent) and how many keys are under
        ``prefix``; no value is transferred."""
        from etcd3 import utils
        from etcd3.etcdrpc import RangeRequest, RequestOp, TxnRequest

        request = TxnRequest(success=[
            RequestOp(request_range=RangeRequest(key=key.encode(), keys_only=True)),
            RequestOp(request_range=RangeRequest(key=prefix.encode(), range_end=utils.prefix_range_end(
                prefix.encode()), count_only=True))])
        resp = self.call(lambda c: c.kvstub.Txn(request, c.timeout, credentials=c.call_credentials,
                                                metadata=c.metadata), f"revision of {key}, count {prefix}*")
        found, counted = resp.responses[0].response_range, resp.responses[1].response_range
        return (int(found.kvs[0].mod_revision) if found.kvs else None), int(counted.count)

    def count_prefix(self, prefix: str) -> int:
        """How many keys there are under ``prefix`` (counted by etcd, nothing transferred)."""
        resp = self.call(lambda c: c.get_prefix_response(prefix, count_only=True), f"count {prefix}*")
        return int(resp.count)

    def grant_lease(self, ttl: int) -> int:
        """Grant a lease of ``ttl`` seconds that nobody keeps alive; returns its ID."""
        return int(self.call(lambda c: c.lease(int(ttl)), "lease grant").id)

    def put(self, key: str, value: bytes | str, lease: int | None = None) -> int:
        """Write a key; returns the revision of the write."""
        resp = self.call(lambda c: c.put(key, value, lease=lease), f"put {key}")
        return int(resp.header.revision)

    def delete(self, key: str) -> bool:
        """Delete a key; True if it existed."""
        return bool(self.call(lambda c: c.delete(key), f"delete {key}"))

    def delete_prefix(self, prefix: str) -> None:
        """Delete every key under ``prefix``."""
        self.call(lambda c: c.delete_prefix(prefix), f"delete {prefix}*")

    def cas(
        self,
        key: str,
        value: bytes | str,
        expected_mod_revision: int | None,
        lease: int | None = None,
    ) -> CasResult:
        """Compare-and-set: write ``value`` only if the key is as expected.

        Args:
            key: The key.
            value: The new value.
            expected_mod_revision: The key's ``mod_revision`` the caller last
                saw; None (or 0) means "only if the key does not exist".
            lease: Lease to attach the key to.

        Returns:
            The outcome, with the key as it is now (read in the same
            transaction when the comparison failed).
        """

        def op(c: etcd3.Etcd3Client) -> tuple[bool, list]:
            if expected_mod_revision:
                compare = [c.transactions.mod(key) == expected_mod_revision]
            else:
                compare = [c.transactions.version(key) == 0]
            return c.transaction(
                compare=compare,
                success=[c.transactions.put(key, value, lease=lease), c.transactions.get(key)],
                failure=[c.transactions.get(key)],
            )

        succeeded, responses = self.call(op, f"cas {key}")
        rng = responses[-1]
        current = _kv(*rng[0]) if rng else None
        return CasResult(bool(succeeded), current)

    # -- events ----------------------------------------------------------------
    def append_event(self, value: bytes | str, keep: int | None = None) -> str:
        """Store one event under a new sequence key, then trim the oldest.

        Sequence numbers are wall-clock nanoseconds (made unique by
        create-only writes), so "oldest" is by the writer's clock. A failed
        trim is logged (``event_trim_failed``): the event is stored, the next
        append trims again.

        Args:
            value: The event document.
            keep: Events to keep under ``events/``; default :attr:`event_retention`.

        Returns:
            The key written.

        Raises:
            ConfigError: ``keep`` is below 1.
            StoreError: The event could not be written.
        """
        keep = self.event_retention if keep is None else keep
        if keep < 1:
            raise ConfigError(f"keep={keep!r} must be >= 1")
        seq = time.time_ns()
        while not self.cas(self.keys.event(seq), value, None).succeeded:
            seq += 1
        try:
            self.trim_prefix(self.keys.events(), keep)
        except StoreError as exc:
            log.warning("event_trim_failed", error=str(exc))
        return self.keys.event(seq)

    def trim_prefix(self, prefix: str, keep: int) -> int:
        """Delete all but the last ``keep`` keys (in key order) under ``prefix``.

        Costs one counting request when nothing is to be deleted; otherwise one
        keys-only read of ``keep + 1`` keys and one range delete, however long
        the backlog.

        Returns:
            How many keys were deleted.

        Raises:
            StoreError: A request failed.
        """
        count = self.count_prefix(prefix)
        if count <= keep:
            return 0
        newest = self.call(lambda c: list(c.get_prefix(prefix, sort_order="descend", limit=keep + 1, keys_only=True)),
                           f"get {prefix}* keys")
        if len(newest) <= keep:
            return 0  # someone else trimmed meanwhile
        last_doomed = newest[-1][1].key  # bytes: the newest key to delete

        def op(c: etcd3.Etcd3Client) -> Any:
            return c.transaction(compare=[], failure=[],
                                 success=[c.transactions.delete(prefix, range_end=last_doomed + b"\0")])

        _, responses = self.call(op, f"trim {prefix}*")
        deleted = int(responses[0].response_delete_range.deleted) if responses else 0
        log.debug("prefix_trimmed", prefix=prefix, deleted=deleted, kept=keep)
        return deleted

    # -- JSON ------------------------------------------------------------------
    def get_json(self, key: str) -> Any | None:
        """Read a JSON value; None if absent.

        Raises:
            MalformedValueError: The value is not valid JSON.
        """
        kv = self.get(key)
        if kv is None:
            return None
        try:
            return json.loads(kv.value)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise MalformedValueError(f"value of {key} is not JSON: {kv.value[:80]!r}") from exc

    def put_json(self, key: str, value: Any, lease: int | None = None) -> int:
        """Write a JSON value; returns the revision of the write."""
        return self.put(key, json.dumps(value, sort_keys=True), lease=lease)

    def get_json_prefix(self, prefix: str) -> dict[str, Any]:
        """Read every JSON value under ``prefix``; malformed ones are logged and skipped."""
        out: dict[str, Any] = {}
        for kv in self.get_prefix(prefix):
            try:
                out[kv.key] = json.loads(kv.value)
            except (ValueError, UnicodeDecodeError, RecursionError):
                log.warning("malformed_value_skipped", key=kv.key, value=kv.value[:80])
        return out

    # -- misc ------------------------------------------------------------------
    def revision(self) -> int:
        """The store's current revision."""
        resp = self.call(lambda c: c.kvstub.Range(
            etcd3.etcdrpc.RangeRequest(key=b"\0", limit=1), c.timeout,
            credentials=c.call_credentials, metadata=c.metadata,
        ), "revision")
        return int(resp.header.revision)

    def healthy(self) -> bool:
        """One quick status request without retries."""
        client = _etcd3_compat.new_client(self.config)
        try:
            client.status()
            return True
        except Exception:  # noqa: BLE001 - any failure means "not healthy"
            return False
        finally:
            client.close()
