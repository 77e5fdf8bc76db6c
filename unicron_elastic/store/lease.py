"""Leases with a keep-alive thread (a node's liveness in etcd)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import structlog

from unicron_elastic.api import ConfigError, StoreError
from unicron_elastic.store.client import StatusStore

log = structlog.get_logger(__name__)


class KeptLease:
    """An etcd lease refreshed by a daemon thread until closed or lost.

    Keys written with ``lease=kept.id`` vanish when the lease expires, so
    watchers learn that the holder is gone within about one TTL.

    Args:
        store: The status store.
        ttl: Lease time-to-live in whole seconds (etcd's minimum is 1 with
            fast election settings, 2 with defaults).
        on_lost: Called once, from the keep-alive thread, when the lease was
            found expired or could not be refreshed before its TTL ran out.

    Raises:
        ConfigError: ``ttl`` is below 1.
        StoreUnavailableError: etcd could not be reached to grant the lease.
    """

    def __init__(self, store: StatusStore, ttl: int, on_lost: Callable[[], None] | None = None) -> None:
        if int(ttl) < 1:
            raise ConfigError(f"lease ttl={ttl!r} must be >= 1 second")
        self._store = store
        self.ttl = int(ttl)
        self._on_lost = on_lost
        lease = store.call(lambda c: c.lease(self.ttl), "lease grant")
        self.id: int = int(lease.id)
        self._stop = threading.Event()
        self.lost = threading.Event()
        self._last_ok = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"unicron-lease-{self.id}", daemon=True)
        self._thread.start()

    def _refresh_once(self) -> int:
        def op(c) -> int:
            responses = list(c.refresh_lease(self.id))
            return int(responses[0].TTL) if responses else -1

        return self._store.call(op, "lease keep-alive")

    def _run(self) -> None:
        interval = max(0.2, self.ttl / 4.0)
        wait = interval
        while not self._stop.wait(wait):
            wait = interval
            try:
                remaining = self._refresh_once()
            except StoreError as exc:
                if time.monotonic() - self._last_ok < self.ttl:
                    wait = 0.1  # a slow or loaded etcd: try again soon, not one interval later
                    continue
                log.error("lease_refresh_failed", lease=self.id, error=str(exc))
                remaining = -1
            if remaining > 0:
                self._last_ok = time.monotonic()
                continue
            log.error("lease_lost", lease=self.id, ttl=self.ttl)
            self.lost.set()
            if self._on_lost is not None:
                try:
                    self._on_lost()
                except Exception:  # noqa: BLE001 - a callback must not kill the thread silently
                    log.exception("lease_on_lost_callback_failed", lease=self.id)
            return

    def close(self, revoke: bool = True) -> None:
        """Stop refreshing; with ``revoke`` delete the lease (and its keys) now."""
        self._stop.set()
        self._thread.join(timeout=self.ttl + 1)
        if revoke and not self.lost.is_set():
            try:
                self._store.call(lambda c: c.revoke_lease(self.id), "lease revoke")
            except StoreError as exc:
                log.warning("lease_revoke_failed", lease=self.id, error=str(exc))

    def __enter__(self) -> KeptLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
