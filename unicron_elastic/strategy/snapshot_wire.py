"""One in-memory snapshot in a c10d store: its pieces, its head, its step as the fencing token, and reading it back.

The format is :mod:`~unicron_elastic.strategy.safe_state`'s (never pickle).
A document goes in pieces of at most :data:`PIECE_BYTES` under a head that
names its step and its pieces; one ``compare_set`` of the head commits an
upload, only over a head of an older step (:func:`commit`), so a writer whose
step is not newer than the one held is refused (``snapshot_stale_refused``)
however long it was frozen in its upload; with shards, each shard keeps its
newest :data:`SLOTS` steps.
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
#: Commits of one upload tried over heads that changed meanwhile (each: another writer of an older step won).
_MAX_ATTEMPTS = 64



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

    Each target commits it with one compare-and-set of its head
    (:func:`commit`): a target that holds a newer step keeps it
    (``snapshot_stale_refused``), one that holds this step already keeps its
    copy (``snapshot_already_held``).

    Raises:
        StoreError: etcd is unreachable (the targets cannot be found).
        RuntimeError: (and the other ``UNREACHABLE`` errors) likewise.
    """
    targets = places.targets()
    key = MeetingKeys.snapshot(shard, slot)
    for where, store in targets:
        try:
            held = commit(store, key, document, step)
        except UNREACHABLE as exc:  # its host is gone: a later save may succeed
            log.warning("snapshot_upload_failed", where=where, error=str(exc)[:200])
            continue
        if held is None:
            log.info("snapshot_saved", where=where, bytes=len(document), shard=shard, step=step)
        elif held == step:
            log.info("snapshot_already_held", where=where, step=step, shard=shard)
        else:  # a writer frozen, then resumed after the group moved on: the step is the fencing token
            log.warning("snapshot_stale_refused", where=where, step=step, held=held, shard=shard)


def commit(store: dist.Store, key: str, payload: bytes | memoryview, step: int) -> int | None:
    """Write ``payload`` (the snapshot of ``step``) under the head ``key`` of one store, fenced by its step.

    The head names the step and the pieces (:func:`_head`). The pieces go
    first, under a tag unique to this upload; then one ``compare_set`` of the
    head commits them, only over the head this writer read, which held an
    older step (or none). A writer that finds a head of this step or a newer
    one, before it writes or in its ``compare_set`` (another writer committed
    meanwhile), deletes the pieces it wrote and commits nothing. So a writer
    frozen at any point of its upload and resumed after a newer snapshot was
    committed cannot put its old step over it. A reader sees the old snapshot
    or the new one, never a mix. The winner then deletes the pieces of the
    head it replaced and those of uploads of older steps that never committed
    (each upload is announced under :meth:`MeetingKeys.snapshot_pending` first:
    a writer that lost and died before cleaning up leaves nothing behind).

    Returns:
        None once committed (the store answered: other clients read it from
        then on); else the step of the head the store keeps (``>= step``).

    Raises:
        RuntimeError: The store failed (its host is gone), or the head kept
            changing under this writer (:data:`_MAX_ATTEMPTS` times).
    """
    current = _raw_head(store, key)
    held = _head_step(current)
    if held is not None and held >= step:
        return held  # (nothing written)
    count = max(1, -(-len(payload) // PIECE_BYTES))
    tag = f"{step}-{uuid.uuid4().hex[:12]}"
    pending = MeetingKeys.snapshot_pending(key)
    store.append(pending, f"{tag}:{count};")
    for index in range(count):
        piece = payload[index * PIECE_BYTES:(index + 1) * PIECE_BYTES]
        store.set(MeetingKeys.snapshot_piece(key, tag, index), bytes(piece))  # (a view of the writer's buffer: copied)
    head = json.dumps({"step": step, "pieces": count, "bytes": len(payload), "tag": tag}).encode()
    for _ in range(_MAX_ATTEMPTS):
        now = store.compare_set(key, current, head)
        if now == head:
            break
        if now == current:  # torch's answer when the key is absent and ``current`` was not empty
            current = b""
            continue
        held = _head_step(now)
        if held is not None and held >= step:  # another writer committed this step or a newer one meanwhile
            _delete_pieces(store, key, tag, count)
            _clean_pending(store, key, step, tag)
            return held
        current = now  # an older head: commit over that one
    else:
        _delete_pieces(store, key, tag, count)
        raise RuntimeError(f"the snapshot head {key!r} changed {_MAX_ATTEMPTS} times while step {step} was committed")
    replaced = _parse_head(current)
    if replaced is not None and replaced["tag"] != tag:
        _delete_pieces(store, key, replaced["tag"], replaced["pieces"])
    _clean_pending(store, key, step, tag)
    return None


def read_step(where: str, store: dist.Store, shard: str, slot: int) -> int | None:
    """The step of one shard's snapshot in one slot of one store (what its head names), or None (none,
    unreachable, malformed: a warning)."""
    key = MeetingKeys.snapshot(shard, slot)
    try:
        value = _raw_head(store, key)
    except UNREACHABLE as exc:
        log.warning("snapshot_unreachable", where=where, error=str(exc)[:200])
        return None
    if not value:
        return None
    step = _head_step(value)
    if step is None:
        log.warning("snapshot_head_malformed", where=where, shard=shard, value=value[:40])
    return step


def _delete_pieces(store: dist.Store, key: str, tag: str, count: int) -> None:
    for index in range(count):
        store.delete_key(MeetingKeys.snapshot_piece(key, tag, index))


def _clean_pending(store: dist.Store, key: str, step: int, own: str) -> None:
    """Delete the pieces of announced uploads of steps older than ``step`` (never committed, or replaced), and
    take them and ``own`` off the list; a newer upload in flight stays announced.

    The list is rewritten with one ``compare_set``: when another writer
    announced an upload meanwhile, it is left as it is (the next commit cleans it).
    """
    pending = MeetingKeys.snapshot_pending(key)
    raw = store.get(pending) if store.check([pending]) else b""
    kept = []
    for entry in raw.decode(errors="replace").split(";"):
        tag, _, count = entry.partition(":")
        entry_step = _tag_step(tag)
        if not tag or not count.isdigit() or not 1 <= int(count) <= _MAX_PIECES or entry_step is None:
            continue  # (malformed: dropped)
        if tag == own:
            continue
        if entry_step < step:
            _delete_pieces(store, key, tag, int(count))  # (its writer lost, or died before it could clean up)
        else:
            kept.append(f"{tag}:{count};")
    store.compare_set(pending, raw, "".join(kept).encode())


def _tag_step(tag: str) -> int | None:
    step = tag.split("-", 1)[0]
    return int(step) if step.isdigit() else None


def _raw_head(store: dist.Store, key: str) -> bytes:
    """The head under ``key`` as stored (``b""``: none), what a commit compares against.

    Raises:
        RuntimeError: The store failed (its host is gone).
    """
    return store.get(key) if store.check([key]) else b""


def _head_step(value: bytes) -> int | None:
    """The step a stored head names, or None (no head, or not a head: a commit replaces it)."""
    head = _parse_head(value)
    return None if head is None else head["step"]


def _parse_head(value: bytes) -> dict[str, Any] | None:
    if not value:
        return None
    try:
        return _head(value)
    except StateDecodingError:
        return None


def _head(value: bytes) -> dict[str, Any]:
    """A snapshot's head: ``{"step": s, "pieces": n, "bytes": total, "tag": upload}``.

    Raises:
        StateDecodingError: ``value`` is not such a head (e.g. a pickle planted under the key).
    """
    if not value.startswith(b"{"):
        raise StateDecodingError(f"not a unicron snapshot head ({looks_like(memoryview(value))}); refused")
    head = load_json(value)
    if (not isinstance(head, dict) or set(head) != {"step", "pieces", "bytes", "tag"} or type(head["step"]) is not int
            or type(head["pieces"]) is not int
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
