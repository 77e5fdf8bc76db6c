"""An etcd v3 ``RendezvousBackend`` for torch's ``DynamicRendezvousHandler``."""

from __future__ import annotations

import base64
import binascii
import json
import random
import time
from collections.abc import Callable

import structlog
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token
from typing_extensions import override

from unicron_elastic.api import StoreError
from unicron_elastic.store.client import KeyValue, StatusStore

log = structlog.get_logger(__name__)

_FORMAT = "torch-dynamic-rendezvous/v1"

#: Pause after the first lost compare-and-set of the state (seconds), doubled with each further one in a row,
#: at most :data:`CONFLICT_BACKOFF_MAX_S`, of which a uniformly random part is waited; the state is read again
#: after it, so that torch's retry carries a fresh token. Without it, N nodes joining at once retry in lockstep,
#: each retry carrying the whole state: 128 nodes made 19,000 attempts (140 MB) in two minutes without
#: completing the round (``benchmarks/scale.py``).
CONFLICT_BACKOFF_S = 0.01
CONFLICT_BACKOFF_MAX_S = 1.0


def encode_state(state: bytes) -> bytes:
    """Wrap torch's opaque state bytes in the JSON document stored in etcd."""
    return json.dumps({"format": _FORMAT, "state": base64.b64encode(state).decode()}).encode()


def decode_state(raw: bytes) -> bytes:
    """Unwrap the state bytes.

    Raises:
        RendezvousStateError: The stored value is not a state document.
    """
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
            raise ValueError(f"not a {_FORMAT} document")
        return base64.b64decode(doc["state"], validate=True)
    except (ValueError, KeyError, TypeError, binascii.Error) as exc:
        raise RendezvousStateError(f"the rendezvous state in etcd is corrupt: {exc}") from exc


class UnicronRendezvousBackend(RendezvousBackend):
    """Holds the rendezvous state of one run in etcd; the token is the key's mod revision.

    Args:
        store: The status store.
        run_id: The rendezvous run id.

    Raises:
        ValueError: ``run_id`` is empty.
    """

    def __init__(self, store: StatusStore, run_id: str) -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        self._store = store
        self.key = store.keys.rdzv(run_id)
        self.conflicts = 0  # compare-and-sets lost in a row
        #: Applied to the state before each write (the handler's :class:`~unicron_elastic.rendezvous.fold.Folder`:
        #: the nodes announced as joining are folded into a forming round); None: written as torch made it.
        self.fold: Callable[[bytes], bytes] | None = None

    @property
    @override
    def name(self) -> str:
        """The backend name torchrun checks: ``unicron``."""
        return "unicron"

    def _decoded(self, kv: KeyValue | None) -> tuple[bytes, Token] | None:
        if kv is None:
            return None
        return decode_state(kv.value), kv.mod_revision

    @override
    def get_state(self) -> tuple[bytes, Token] | None:
        """See base class."""
        try:
            return self._decoded(self._store.get(self.key))
        except StoreError as exc:
            raise RendezvousConnectionError(f"the connection to etcd has failed: {exc}") from exc

    @override
    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        """See base class."""
        expected: int | None = None
        if token is not None:
            try:
                expected = int(token)
            except (TypeError, ValueError):
                expected = -1
            if expected <= 0:
                # An invalid token never matches: report the current state.
                current = self.get_state()
                return None if current is None else (*current, False)
        try:
            if self.fold is not None:
                state = self.fold(state)
            result = self._store.cas(self.key, encode_state(state), expected)
            current = result.current
            if not self._back_off(result.succeeded):
                current = self._store.get(self.key)  # after the pause: torch retries on the state as it is now
        except StoreError as exc:
            raise RendezvousConnectionError(f"the connection to etcd has failed: {exc}") from exc
        current = self._decoded(current)
        if current is None:
            return None
        return (*current, result.succeeded)

    def _back_off(self, succeeded: bool) -> bool:
        """After a lost compare-and-set, wait a random part of an exponentially growing pause (torch retries at
        once); returns ``succeeded``."""
        if succeeded:
            self.conflicts = 0
            return True
        self.conflicts += 1
        time.sleep(random.uniform(0.0, min(CONFLICT_BACKOFF_MAX_S, CONFLICT_BACKOFF_S * 2 ** min(self.conflicts, 16))))
        return False
