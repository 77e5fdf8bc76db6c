"""A ``torch.distributed.Store`` over etcd v3, for the rendezvous handler.

torchrun's agents use this store for their own bootstrap (rank assignment,
barriers, the address of the shared TCPStore that workers use), so it sees a
handful of keys per rendezvous round and never per-iteration traffic. c10d
values are opaque bytes from torch and are stored as such, under
``/unicron/<cluster>/c10d/<run_id>/``.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist
from typing_extensions import override

from unicron_elastic.store.client import StatusStore

_DEFAULT_TIMEOUT = timedelta(seconds=300)


def _b(value: str | bytes | bytearray) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class EtcdC10dStore(dist.Store):
    """c10d store semantics (set/get/add/wait/check/compare_set) on etcd.

    Args:
        store: The status store.
        prefix: Key prefix of this store, ending in ``/``.
        timeout: Default timeout of blocking reads.
    """

    def __init__(self, store: StatusStore, prefix: str, timeout: timedelta | None = None) -> None:
        super().__init__()  # required by the pybind trampoline
        self._store = store
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        self.set_timeout(timeout or _DEFAULT_TIMEOUT)

    def _key(self, key: str | bytes) -> str:
        return self.prefix + (key.decode() if isinstance(key, bytes) else key)

    @override
    def set(self, key: str, value: str | bytes) -> None:  # noqa: D102 - c10d semantics
        self._store.put(self._key(key), _b(value))

    @override
    def get(self, key: str) -> bytes:
        """Return the value of ``key``, waiting for it up to the store timeout.

        Raises:
            LookupError: The key did not appear in time.
        """
        return self._wait_get([key], None)[0]

    @override
    def add(self, key: str, num: int) -> int:
        """Atomically add ``num`` to the integer at ``key`` (0 if absent)."""
        full = self._key(key)
        while True:
            kv = self._store.get(full)
            current = int(kv.value) if kv is not None else 0
            result = self._store.cas(full, str(current + num), kv.mod_revision if kv else None)
            if result.succeeded:
                return current + num

    def read_int(self, key: str, patience: float | None = None) -> int:
        """The integer at ``key`` (0 if absent), giving up after ``patience`` s of an unreachable etcd.

        Raises:
            StoreUnavailableError: etcd was unreachable for ``patience`` seconds.
        """
        kv = self._store.get(self._key(key), patience)
        return int(kv.value) if kv is not None else 0

    @override
    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        """c10d compare-and-set: returns the value now stored."""
        full = self._key(key)
        expected, desired = _b(expected_value), _b(desired_value)
        while True:
            kv = self._store.get(full)
            if kv is None and expected:
                return expected
            if kv is not None and kv.value != expected:
                return kv.value
            result = self._store.cas(full, desired, kv.mod_revision if kv else None)
            if result.succeeded:
                return desired

    @override
    def wait(self, keys: list[str], override_timeout: timedelta | None = None) -> None:
        """Wait until every key exists.

        Raises:
            LookupError: Not all keys appeared within the timeout.
        """
        self._wait_get(keys, override_timeout)

    @override
    def check(self, keys: list[str]) -> bool:
        """True if every key exists now."""
        return all(self._store.get(self._key(k)) is not None for k in keys)

    @override
    def delete_key(self, key: str) -> bool:
        """Delete ``key``; True if it existed."""
        return self._store.delete(self._key(key))

    @override
    def num_keys(self) -> int:
        """Number of keys under this store's prefix."""
        return len(self._store.get_prefix(self.prefix))

    def _wait_get(self, keys: list[str], override_timeout: timedelta | None) -> list[bytes]:
        timeout = override_timeout or self.timeout
        deadline = time.monotonic() + timeout.total_seconds()
        delay = 0.005
        while True:
            values = [self._store.get(self._key(k)) for k in keys]
            if all(v is not None for v in values):
                return [v.value for v in values]  # type: ignore[union-attr]
            if time.monotonic() >= deadline:
                missing = [k for k, v in zip(keys, values) if v is None]
                raise LookupError(f"timeout after {timeout} waiting for keys {missing} in {self.prefix}")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
