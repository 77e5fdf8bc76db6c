"""Prefix watches that survive etcd restarts."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import etcd3.events
from etcd3 import etcdrpc
import structlog

from unicron_elastic.store.client import StatusStore

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class WatchEvent:
    """One change seen by a watch.

    Attributes:
        kind: ``"put"`` or ``"delete"``.
        key: The key that changed.
        value: The new value (empty for a delete).
        revision: The revision of the change.
        previous: The value before a delete, for a watch of deletes only (None otherwise).
    """

    kind: str
    key: str
    value: bytes
    revision: int
    previous: bytes | None = None


class PrefixWatch:
    """Calls ``callback`` for every change under ``prefix``, across reconnects.

    The watch owns its own client. When its stream ends (etcd restarted or
    unreachable) it builds a new client, for the next member of the cluster,
    and resumes from the revision after the last event it delivered, so no
    change is lost or delivered twice (unless etcd compacted those revisions
    meanwhile, which is logged).

    Args:
        store: The status store (for configuration and fresh clients).
        prefix: The key prefix to watch.
        callback: Called with each :class:`WatchEvent`, from the watch thread.
        start_revision: First revision to deliver; default: changes after now.
        deletes_only: Deliver deletes only, each with the value it deleted (:attr:`WatchEvent.previous`):
            etcd filters the puts out, so many writers under ``prefix`` cost this watch nothing.
    """

    def __init__(
        self,
        store: StatusStore,
        prefix: str,
        callback: Callable[[WatchEvent], None],
        start_revision: int | None = None,
        deletes_only: bool = False,
    ) -> None:
        self._store = store
        self._deletes_only = deletes_only
        self.prefix = prefix
        self._callback = callback
        self._next_revision = start_revision if start_revision else store.revision() + 1
        self._lock = threading.Lock()
        self._cancelled = False
        self._client = None
        self._watch_id = None
        self._member = store.member_index
        self.reconnects = 0
        self._subscribe()

    def _next_member(self) -> None:
        """Move to the next member of the cluster (a watch is a stream: it stays on one member while it lasts)."""
        self._member = (self._member + 1) % len(self._store.config.members)

    def _subscribe(self) -> None:
        delay = 0.05
        while True:
            with self._lock:
                if self._cancelled:
                    return
                start = self._next_revision
            client = self._store.new_client(self._member)
            try:
                extra = {"filters": [etcdrpc.WatchCreateRequest.NOPUT], "prev_kv": True} if self._deletes_only else {}
                watch_id = client.add_watch_prefix_callback(self.prefix, self._on_response, start_revision=start,
                                                            **extra)
            except Exception as exc:  # noqa: BLE001 - etcd down: retry below
                client.close()
                log.debug("watch_subscribe_retry", prefix=self.prefix, error=type(exc).__name__)
                self._next_member()
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            with self._lock:
                self._client, self._watch_id = client, watch_id
                if not self._cancelled:
                    return
            client.close()
            return

    def _on_response(self, response: object) -> None:
        if response is None or isinstance(response, Exception):
            self._resubscribe(response)
            return
        for event in response.events:
            kind = "delete" if isinstance(event, etcd3.events.DeleteEvent) else "put"
            key = event.key.decode()
            previous = bytes(event._event.prev_kv.value) if self._deletes_only else None  # noqa: SLF001
            item = WatchEvent(kind, key, bytes(event.value), int(event.mod_revision), previous)
            with self._lock:
                if self._cancelled:
                    return
                self._next_revision = max(self._next_revision, item.revision + 1)
            try:
                self._callback(item)
            except Exception:  # noqa: BLE001 - a bad callback must not end the watch
                log.exception("watch_callback_failed", prefix=self.prefix, key=key)

    def _resubscribe(self, error: object) -> None:
        with self._lock:
            if self._cancelled:
                return
            old, self._client = self._client, None
        self.reconnects += 1
        self._next_member()
        log.warning("watch_stream_ended", prefix=self.prefix, error=repr(error), resume_at=self._next_revision)
        # The old client's watch thread is the caller; close it from elsewhere.
        if old is not None:
            threading.Thread(target=old.close, daemon=True).start()
        threading.Thread(target=self._subscribe, name="unicron-watch-resubscribe", daemon=True).start()

    def cancel(self) -> None:
        """Stop the watch; no callback runs after this returns (bar one in flight)."""
        with self._lock:
            self._cancelled = True
            client, self._client = self._client, None
            watch_id = self._watch_id
        if client is not None:
            try:
                client.cancel_watch(watch_id)
            except Exception:  # noqa: BLE001 - etcd may be gone
                pass
            client.close()

    def __enter__(self) -> PrefixWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()
