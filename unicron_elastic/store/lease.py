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
    watchers learn that the process keeping it is gone within about one TTL.

    A lease can lapse while the process keeping it is alive: a host so loaded that the
    keep-alive thread or etcd itself did not run for a TTL. With
    ``on_renewed``, a lapse that etcd *answers* (the lease is gone, etcd is
    reachable) is not the end: a new lease is granted, :attr:`id` changes and
    ``on_renewed(new_id)`` puts that process's keys back. Watchers have seen the
    keys vanish (the process counted as lost, then back). Only etcd staying
    unreachable, or the renewal failing, calls ``on_lost``.

    Args:
        store: The status store.
        ttl: Lease time-to-live in whole seconds (etcd's minimum is 1 with
            fast election settings, 2 with defaults).
        on_lost: Called once, from the keep-alive thread, when the lease was
            found expired (and not renewed) or could not be refreshed before
            its TTL ran out.
        on_renewed: Called from the keep-alive thread with the new lease id
            after an expired lease was replaced; it re-puts the process's keys
            (an exception from it counts as the lease lost). None: an expired
            lease is lost.

    Raises:
        ConfigError: ``ttl`` is below 1.
        StoreUnavailableError: etcd could not be reached to grant the lease.
    """

    def __init__(self, store: StatusStore, ttl: int, on_lost: Callable[[], None] | None = None,
                 on_renewed: Callable[[int], None] | None = None) -> None:
        if int(ttl) < 1:
            raise ConfigError(f"lease ttl={ttl!r} must be >= 1 second")
        self._store = store
        self.ttl = int(ttl)
        self._on_lost = on_lost
        self._on_renewed = on_renewed
        self.id: int = self._grant()
        self.renewals = 0
        self._stop = threading.Event()
        self.lost = threading.Event()
        self._last_ok = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"unicron-lease-{self.id}", daemon=True)
        self._thread.start()

    def _grant(self) -> int:
        return int(self._store.call(lambda c: c.lease(self.ttl), "lease grant").id)

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
                self._lose()
                return
            if remaining > 0:
                self._last_ok = time.monotonic()
            elif not self._renew():
                self._lose()
                return

    def _renew(self) -> bool:
        """Replace an expired lease (etcd answered) and let its process re-put its keys; False: could not."""
        if self._on_renewed is None or self._stop.is_set():
            return False
        old = self.id
        try:
            self.id = self._grant()
            self._on_renewed(self.id)
        except Exception as exc:  # noqa: BLE001 - a failed renewal is a lost lease, said so
            log.error("lease_renewal_failed", lease=old, error=str(exc)[:200])
            return False
        self.renewals += 1
        self._last_ok = time.monotonic()
        log.warning("lease_renewed", old_lease=old, lease=self.id, ttl=self.ttl,
                    note="the lease lapsed while its process was alive (an overloaded host?); watchers saw it go")
        return True

    def _lose(self) -> None:
        log.error("lease_lost", lease=self.id, ttl=self.ttl)
        self.lost.set()
        if self._on_lost is not None:
            try:
                self._on_lost()
            except Exception:  # noqa: BLE001 - a callback must not kill the thread silently
                log.exception("lease_on_lost_callback_failed", lease=self.id)

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
