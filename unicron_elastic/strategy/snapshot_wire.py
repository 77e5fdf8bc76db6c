"""One in-memory snapshot in a c10d store: its pieces, its head, its step as the fencing token, and reading it back.

The format is :mod:`~unicron_elastic.strategy.safe_state`'s (never pickle).
A document goes in pieces of at most :data:`PIECE_BYTES` under a head that
names them; a writer whose step is older than the one held is refused
(``snapshot_stale_refused``); with shards, each shard keeps its newest
:data:`SLOTS` steps.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import structlog
import torch.distributed as dist

from unicron_elastic.api import StateDecodingError, StoreError
from unicron_elastic.store.keys import MeetingKeys
from unicron_elastic.strategy.safe_state import load_json, loads, looks_like

log = structlog.get_logger(__name__)


class Targets(Protocol):
    """Where a snapshot goes (:mod:`~unicron_elastic.strategy.snapshot_places`)."""

    def targets(self) -> list[tuple[str, dist.Store]]:
        """``(where, store)`` of each store the snapshot is written to."""

SNAPSHOT_KEY = MeetingKeys.SNAPSHOT
#: Per shard, the newest two snapshots are kept (two slots that alternate).
SLOTS = 2
#: What a store whose host is gone raises.
UNREACHABLE = (RuntimeError, OSError, LookupError, ValueError, StoreError)
#: Largest piece of a snapshot written to a store in one message. torch's TCPStore server (libuv)
#: refuses a message over 8 MiB by closing the client's connection: a whole snapshot in one value
#: was lost for any state over 8 MiB and, under plain torchrun, broke the worker's own store.
PIECE_BYTES = 4 << 20
_MAX_PIECES = 1 << 20  # a head naming more is malformed (4 TiB)



def newest_common_step(steps: Mapping[str, Iterable[int]], shards: Sequence[str]) -> int | None:
    """The newest step every one of ``shards`` has (``steps``: shard -> its available steps), or None."""
    common: set[int] | None = None
    for shard in shards:
        have = set(steps.get(shard, ()))
        common = have if common is None else common & have
    return max(common) if common else None


def upload(places: Targets, document: bytes | memoryview, step: int, shard: str | None,
           slot: int) -> None:
    """Write one snapshot document to each of its places' targets (a target that fails is a warning).

    Raises:
        StoreError: etcd is unreachable (the targets cannot be found).
        RuntimeError: (and the other ``UNREACHABLE`` errors) likewise.
    """
    targets = places.targets()
    key = MeetingKeys.snapshot(shard, slot)
    for where, store in targets:
        try:
            previous = _old_head(store, key)
            held = _head_step(previous)  # the step is the fencing token: a writer frozen, then resumed
            if held is not None and held > step:
                log.warning("snapshot_stale_refused", where=where, step=step, held=held, shard=shard)
                continue
            if shard is not None:  # the slot's step goes first and comes back last: a step listed is there
                store.delete_key(MeetingKeys.snapshot_step(shard, slot))
            _put(store, key, document, f"{step}-{uuid.uuid4().hex[:12]}", previous)
            if shard is not None:
                store.set(MeetingKeys.snapshot_step(shard, slot), str(step))
        except UNREACHABLE as exc:  # its host is gone: a later save may succeed
            log.warning("snapshot_upload_failed", where=where, error=str(exc)[:200])
        else:
            log.info("snapshot_saved", where=where, bytes=len(document), shard=shard, step=step)


def read_step(where: str, store: dist.Store, shard: str, slot: int) -> int | None:
    """The step of one shard's snapshot in one slot of one store, or None (none, unreachable, malformed: a warning)."""
    key = MeetingKeys.snapshot_step(shard, slot)
    try:
        if not store.check([key]):
            return None
        raw = store.get(key)
    except UNREACHABLE as exc:
        log.warning("snapshot_unreachable", where=where, error=str(exc)[:200])
        return None
    try:
        return int(raw)
    except ValueError:
        log.warning("snapshot_step_malformed", where=where, shard=shard, value=raw[:40])
        return None


def _put(store: dist.Store, key: str, payload: bytes | memoryview, tag: str,
         previous: dict[str, Any] | None) -> None:
    """Write ``payload`` under ``key`` in pieces of at most :data:`PIECE_BYTES` bytes.

    The pieces go first (under ``tag``, unique to this upload), then the head
    ``key`` naming them, which replaces the ``previous`` head (:func:`_old_head`)
    in one write; the previous upload's pieces are deleted last. A reader sees
    the old snapshot or the new one, never a mix. It returns once the store
    has the new head (another client reads it from then on).

    Raises:
        RuntimeError: The store failed (its host is gone): the caller warns.
    """
    count = max(1, -(-len(payload) // PIECE_BYTES))
    for index in range(count):
        piece = payload[index * PIECE_BYTES:(index + 1) * PIECE_BYTES]
        store.set(MeetingKeys.snapshot_piece(key, tag, index), bytes(piece))  # (a view of the writer's buffer: copied)
    store.set(key, json.dumps({"pieces": count, "bytes": len(payload), "tag": tag}))
    if not store.check([key]):  # (a set is not answered: this round trip is; the server has it all once it answers)
        raise RuntimeError(f"the snapshot head {key!r} was not stored")
    if previous is not None and previous["tag"] != tag:
        for index in range(previous["pieces"]):
            store.delete_key(MeetingKeys.snapshot_piece(key, previous["tag"], index))


def _head_step(head: dict[str, Any] | None) -> int | None:
    """The step of the snapshot a head names (from its tag), or None (no head, or a tag without one).

    A writer never replaces a newer snapshot with an older one: a writer that
    was frozen (its node stopped, then resumed after the group moved on) may
    still hold an upload of an old step.
    """
    step = head["tag"].split("-", 1)[0] if head is not None else ""
    return int(step) if step.isdigit() else None


def _old_head(store: dist.Store, key: str) -> dict[str, Any] | None:
    """The head under ``key`` before an upload (whose pieces that upload deletes), or None (none, or malformed).

    Raises:
        RuntimeError: The store failed (its host is gone).
    """
    if not store.check([key]):
        return None
    try:
        return _head(store.get(key))
    except StateDecodingError:
        return None


def _head(value: bytes) -> dict[str, Any]:
    """A snapshot's head: ``{"pieces": n, "bytes": total, "tag": upload}``.

    Raises:
        StateDecodingError: ``value`` is not such a head (e.g. a pickle planted under the key).
    """
    if not value.startswith(b"{"):
        raise StateDecodingError(f"not a unicron snapshot head ({looks_like(memoryview(value))}); refused")
    head = load_json(value)
    if (not isinstance(head, dict) or set(head) != {"pieces", "bytes", "tag"} or type(head["pieces"]) is not int
            or not 1 <= head["pieces"] <= _MAX_PIECES or type(head["bytes"]) is not int
            or not 0 <= head["bytes"] <= head["pieces"] * PIECE_BYTES or not isinstance(head["tag"], str)
            or not re.fullmatch(r"[0-9a-z-]{1,64}", head["tag"])):
        raise StateDecodingError(f"malformed unicron snapshot head {bytes(value[:200])!r}; refused")
    return head


def read_snapshot(where: str, store: dist.Store, key: str = SNAPSHOT_KEY) -> dict[str, Any] | None:
    """The snapshot under ``key`` in one store, or None (none there, replaced while read, or the store is
    unreachable: a warning).

    Raises:
        StateDecodingError: The head or the document it names is not a safe
            state document (nothing in it ran).
    """
    try:
        if not store.check([key]):
            return None
        head = _head(store.get(key))
        pieces = [MeetingKeys.snapshot_piece(key, head["tag"], index) for index in range(head["pieces"])]
        if not store.check(pieces):  # a newer upload replaced it (and deleted its pieces) meanwhile
            log.warning("snapshot_changed_while_read", where=where, key=key)
            return None
        payload = b"".join(store.get(piece) for piece in pieces)
    except StateDecodingError as exc:  # (a ValueError: before the unreachable store's)
        raise StateDecodingError(f"in-memory snapshot ({key!r} in {where}): {exc}") from None
    except UNREACHABLE as exc:  # the node holding it was lost
        log.warning("snapshot_unreachable", where=where, error=str(exc)[:200])
        return None
    if len(payload) != head["bytes"]:
        raise StateDecodingError(f"in-memory snapshot ({key!r} in {where}): {len(payload)} bytes in its pieces, "
                                 f"its head says {head['bytes']}; refused")
    try:
        return loads(payload)
    except StateDecodingError as exc:
        raise StateDecodingError(f"in-memory snapshot ({key!r} in {where}): {exc}") from None


def state_step(state: dict[str, Any]) -> int:
    step = state.get("step") if isinstance(state, dict) else None
    return step if type(step) is int else -1
