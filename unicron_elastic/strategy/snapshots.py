"""Where a job's state comes from when no data-parallel replica has it (paper section 6, GEMINI).

Two tiers behind the replicas:

* :class:`MemorySnapshot`: every ``every`` steps the group's leader copies the
  state once into a host buffer and its snapshot writer process
  (:mod:`~unicron_elastic.strategy.snapshot_writer`) sends it into the memory
  of an agent, not of any worker, so it survives the loss of every worker of
  the group (a store only this process reaches: a thread of its own).
  Under ``unicron-run`` those agents are the ones of the *next two* live
  nodes in ring order (GEMINI's placement, :func:`snapshot_targets`; the
  other node when there are two): each agent
  hosts a snapshot server and publishes its address in the meeting store
  (:class:`PeerServers`), so losing any one node (dead or frozen) loses a
  replica or a copy, never the only snapshot. Under plain ``torchrun`` it is torch's agent TCPStore (the
  rank-0 node's agent).
* :class:`DiskCheckpoints`: every ``every`` steps the leader writes the state
  in a background thread (the step goes on) to ``<directory>/step-<s>.state``;
  a ``latest`` file names the newest *complete* checkpoint, so a crash while
  writing leaves the previous one.

Both are written by one replica only: every data-parallel replica holds the
same state. With tensor/pipeline parallelism each *shard* of that replica
(``tp<t>-pp<p>``) writes its own part (``shard=``), and a resume takes the
newest step that every shard has (:func:`newest_common_step`): a save that
completed for some shards only is skipped, never mixed with another step. Both hold it in the format of :mod:`~unicron_elastic.strategy.safe_state`
(raw tensor bytes plus JSON), so reading one never unpickles anything: the
agents' stores have no authentication, and a checkpoint directory may be
shared.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import uuid
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import structlog
import torch.distributed as dist

from unicron_elastic.api import ConfigError, StateDecodingError, StoreError
from unicron_elastic.meeting import decode_meeting
from unicron_elastic.store.keys import MeetingKeys
from unicron_elastic.strategy.safe_state import EncodedState, encode, load_json, loads, looks_like, pack, pack_parts
from unicron_elastic.strategy.snapshot_writer import SnapshotWriter

log = structlog.get_logger(__name__)

SNAPSHOT_KEY = MeetingKeys.SNAPSHOT
_SLOTS = 2  # per shard, the newest two snapshots are kept
_UNREACHABLE = (RuntimeError, OSError, LookupError, ValueError, StoreError)  # a store or its host is gone
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


def snapshot_targets(own_node: int, live_nodes: Sequence[int], copies: int = 2) -> list[int]:
    """The nodes whose agents hold the snapshot written on ``own_node`` (GEMINI's ring).

    With three or more live nodes the snapshot has two holders, so it
    survives the loss of any one node, the writer's or a holder's, even
    while another holder is unreachable (frozen). With two nodes the other
    one holds it: losing it leaves the writer, whose state is live; losing
    the writer leaves the holder.

    Args:
        own_node: The writer's node (group rank).
        live_nodes: The nodes whose agents are alive (any order; may include ``own_node``).
        copies: Holders wanted (at most the other live nodes).

    Returns:
        The next ``copies`` live nodes after ``own_node`` in ring order
        (wrapping to the lowest); ``[own_node]`` only when no other node is
        alive (then the snapshot does not survive losing that node).
    """
    others = sorted(set(live_nodes) - {own_node})
    if not others:
        return [own_node]
    ring = [node for node in others if node > own_node] + [node for node in others if node < own_node]
    return ring[:max(1, copies)]


class _OneStore:
    """The snapshot's place under plain ``torchrun``: one store, written and read."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store

    def targets(self) -> list[tuple[str, dist.Store]]:
        return [("the agent's store", self.store)]

    sources = targets

    def spec(self) -> dict[str, Any] | None:
        """How another process reaches the store (a TCPStore), or None (an in-process store)."""
        if isinstance(self.store, dist.TCPStore):
            return {"kind": "tcp", "host": self.store.host, "port": self.store.port}
        return None


def places_from(spec: dict[str, Any]) -> _OneStore | PeerServers:
    """The places a description names (:meth:`_OneStore.spec`, :meth:`PeerServers.spec`): in the snapshot writer.

    Raises:
        ConfigError: An unknown kind, or a malformed meeting description.
        RuntimeError: The TCPStore cannot be reached.
    """
    if spec.get("kind") == "tcp":
        return _OneStore(dist.TCPStore(spec["host"], int(spec["port"]), is_master=False,
                                       timeout=timedelta(seconds=30)))
    if spec.get("kind") == "peers":
        return PeerServers.from_meeting(spec["meeting"], int(spec["node"]))
    raise ConfigError(f"unknown snapshot place {spec!r}")


class PeerServers:
    """The agents' snapshot servers of one run, as published in its meeting store (GEMINI placement).

    Each agent of ``unicron-run`` hosts a TCPStore in its own memory and puts
    its ``host:port`` under :meth:`MeetingKeys.snapshot_host` on its node's
    lease, so a lost node's server vanishes from the list within one TTL.

    Args:
        meeting: The workers' meeting store (etcd).
        node: This worker's node (its group rank, ``GROUP_RANK``).
        connect_timeout: Bound of each connection to a server.
    """

    def __init__(self, meeting: dist.Store, node: int, connect_timeout: timedelta = timedelta(seconds=5),
                 meeting_spec: str | None = None) -> None:
        self.meeting, self.node, self.connect_timeout = meeting, int(node), connect_timeout
        self.meeting_spec = meeting_spec
        self._alone = False

    @classmethod
    def from_meeting(cls, meeting_spec: str, node: int) -> PeerServers:
        """The servers of the run whose meeting store ``meeting_spec`` (``$UNICRON_MEETING``'s value) names.

        Raises:
            ConfigError: ``meeting_spec`` is malformed.
        """
        from unicron_elastic.store.c10d import EtcdC10dStore
        from unicron_elastic.store.client import StatusStore

        config, prefix = decode_meeting(meeting_spec)
        meeting = EtcdC10dStore(StatusStore(config), prefix, timeout=timedelta(seconds=5))
        return cls(meeting, node, meeting_spec=meeting_spec)

    def spec(self) -> dict[str, Any] | None:
        """How another process finds the same servers (built :meth:`from_meeting`), or None."""
        return None if self.meeting_spec is None else {"kind": "peers", "node": self.node,
                                                       "meeting": self.meeting_spec}

    def hosts(self) -> dict[int, str]:
        """``{node: "host:port"}`` of the live servers (a node of the round without one is gone).

        Raises:
            StoreError: etcd is unreachable.
        """
        found = {}
        for node in range(self._world()):
            key = MeetingKeys.snapshot_host(node)
            try:
                if self.meeting.check([key]):
                    found[node] = self.meeting.get(key).decode()
            except LookupError:  # its lease lapsed between the two reads
                pass
        return found

    def targets(self) -> list[tuple[str, dist.Store]]:
        """The servers the snapshot written on this node goes to: the next two live nodes' (:func:`snapshot_targets`).

        Raises:
            StoreError: etcd is unreachable.
        """
        hosts = self.hosts()
        nodes = snapshot_targets(self.node, sorted(hosts))
        alone = nodes == [self.node]
        if alone and not self._alone:
            log.warning("snapshot_not_replicated", node=self.node,
                        reason="no other node is alive: the snapshot does not survive losing this node")
        self._alone = alone
        return self._connect({node: hosts.get(node) for node in nodes})

    def sources(self) -> list[tuple[str, dist.Store]]:
        """Every live server this process can reach (a warning for each node of the round it cannot).

        Raises:
            StoreError: etcd is unreachable.
        """
        hosts = self.hosts()
        return self._connect({node: hosts.get(node) for node in range(self._world())})

    def _world(self) -> int:
        """Nodes in the round (0 before any agent published it)."""
        if not self.meeting.check([MeetingKeys.AGENTS_WORLD]):
            return 0
        return int(self.meeting.get(MeetingKeys.AGENTS_WORLD))

    def _connect(self, hosts: dict[int, str | None]) -> list[tuple[str, dist.Store]]:
        stores = []
        for node, address in hosts.items():
            where = f"node {node}'s agent ({address})"
            if address is None:
                log.warning("snapshot_unreachable", node=node, error="its agent is gone (no snapshot server)")
                continue
            host, _, port = address.rpartition(":")
            try:
                stores.append((where, dist.TCPStore(host, int(port), is_master=False, timeout=self.connect_timeout)))
            except _UNREACHABLE as exc:
                log.warning("snapshot_unreachable", node=node, address=address, error=str(exc)[:200])
        return stores
_CHECKPOINT_NAME = re.compile(r"step-\d{8,}\.state")


class MemorySnapshot:
    """The latest state, serialized in the memory of an agent (not of any worker).

    With shards each shard keeps its two newest snapshots (slots used in
    turn), so a save that landed for some shards only (a writer died) still
    leaves a step every shard has.

    Args:
        store: Where it lives: the agents' snapshot servers (:class:`PeerServers`,
            under ``unicron-run``), or one store that outlives workers (torch's
            agent TCPStore under plain ``torchrun``); None: no snapshots.
        every: Steps between snapshots (0: never).
        shard: This rank's model shard (``tp<t>-pp<p>``) with tensor/pipeline
            parallelism; None: the whole model.
        shards: Every shard of the model (with ``shard``): a load takes the
            newest step all of them have.

    Raises:
        ConfigError: ``every`` < 0, or ``shard`` not among ``shards``.
    """

    def __init__(self, store: dist.Store | PeerServers | None, every: int, shard: str | None = None,
                 shards: Sequence[str] = (), out_of_process: bool = False) -> None:
        if every < 0:
            raise ConfigError(f"snapshot_every={every} must be >= 0")
        if shard is not None and shard not in shards:
            raise ConfigError(f"shard {shard!r} is not one of the model's shards {list(shards)}")
        self.store, self.every = store, every
        self.shard, self.shards = shard, list(shards)
        self._places = store if isinstance(store, PeerServers) or store is None else _OneStore(store)
        self._spec = self._places.spec() if out_of_process and self._places is not None else None
        self._writer = SnapshotWriter() if self._spec is not None else None
        self._thread: threading.Thread | None = None

    @property
    def out_of_process(self) -> bool:
        """Whether the snapshot writer process sends the snapshots (else a thread of this process)."""
        return self._writer is not None

    def due(self, step: int) -> bool:
        """Whether a snapshot is due at the start of ``step`` (never without a store)."""
        return self._places is not None and self.every > 0 and step % self.every == 0

    def save(self, state: dict[str, Any]) -> bool:
        """Copy the tensors of ``state`` now; serialize and upload in the background.

        Out of process (:mod:`~unicron_elastic.strategy.snapshot_writer`): one
        copy of each array into the kept host buffer, the rest in the writer
        process (call :meth:`settle` before the state changes); while the
        writer still sends the previous snapshot this one is skipped with a
        warning. Else a thread of this process packs and uploads a copy, a
        snapshot still being sent waited for first. Training goes on while
        the snapshot is sent (at most one in flight).

        Returns:
            Whether the snapshot was taken (False: skipped).

        Raises:
            StateEncodingError: ``state`` holds a value the safe format cannot
                carry (raised here, not in the background).
        """
        step = _step(state)
        if self._writer is not None:
            return self._writer.write(encode(state), step, self.shard, self._slot(step), self._spec)
        self.wait()
        frozen = encode(state, copy=True)
        self._thread = threading.Thread(target=self._upload, args=(frozen, step), name="unicron-snapshot",
                                        daemon=True)
        self._thread.start()
        return True

    def start(self) -> None:
        """Start the snapshot writer process now, if there is one and snapshots are on (a rank that will save)."""
        if self._writer is not None and self.every > 0:
            try:
                self._writer.start()
            except OSError as exc:  # (the first snapshot tries again)
                log.warning("snapshot_writer_lost", error=str(exc)[:200])

    def settle(self) -> None:
        """Before the saved state changes: a copy from a GPU still running on its side stream is finished."""
        if self._writer is not None:
            self._writer.settle()

    def _slot(self, step: int) -> int:
        """A shard's two slots alternate: a save that lands for some shards only leaves their previous step."""
        return 0 if self.shard is None else (step // self.every) % _SLOTS

    def _upload(self, state: EncodedState, step: int) -> None:
        """In the background thread: the document, then :func:`upload` (failures are warnings: training goes on)."""
        try:
            upload(self._places, pack(state), step, self.shard, self._slot(step))
        except _UNREACHABLE as exc:
            log.warning("snapshot_upload_failed", error=str(exc)[:200])

    def wait(self) -> None:
        """Wait for the snapshot being written, if any."""
        if self._writer is not None:
            self._writer.wait()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """Wait for the snapshot being written; stop the writer process and free its buffer."""
        self.wait()
        if self._writer is not None:
            self._writer.close()

    def load(self, step: int | None = None) -> dict[str, Any] | None:
        """The newest snapshot (highest ``"step"``) of every store that can be reached, or None.

        A store that cannot be reached is skipped with a ``snapshot_unreachable``
        warning. With shards, this shard's snapshot of the newest step that
        every shard has (the shards' snapshots may be on different servers),
        or of ``step`` when given (None when this shard has none of it).

        Raises:
            StateDecodingError: A value in a store is not a safe state document
                (e.g. a pickle someone put there); nothing in it ran.
        """
        if self._places is None:
            return None
        try:
            sources = self._places.sources()
        except _UNREACHABLE as exc:
            log.warning("snapshot_unreachable", error=str(exc)[:200])
            return None
        if self.shard is not None:
            return self._load_shard(sources, step)
        newest = None
        for where, store in sources:
            state = _read(where, store, SNAPSHOT_KEY)
            if state is not None and (newest is None or _step(state) > _step(newest)):
                newest = state
        return newest

    def _load_shard(self, sources: list[tuple[str, dist.Store]], step: int | None) -> dict[str, Any] | None:
        """This shard's snapshot of ``step`` (None: the newest step every shard has), in either slot, on any
        server, or None."""
        steps: dict[str, dict[int, tuple[str, dist.Store, int]]] = {shard: {} for shard in self.shards}
        for where, store in sources:
            for shard in self.shards:
                for slot in range(_SLOTS):
                    found = _read_step(where, store, shard, slot)
                    if found is not None:
                        steps[shard][found] = (where, store, slot)
        common = newest_common_step(steps, self.shards) if step is None else step
        if common is None or common not in steps[self.shard]:
            return None
        where, store, slot = steps[self.shard][common]
        state = _read(where, store, MeetingKeys.snapshot(self.shard, slot))
        if state is None or _step(state) != common:  # overwritten meanwhile: a newer save is on its way
            log.warning("snapshot_changed_while_read", where=where, shard=self.shard, step=common)
            return None
        return state


def upload(places: _OneStore | PeerServers, document: bytes | memoryview, step: int, shard: str | None,
           slot: int) -> None:
    """Write one snapshot document to each of its places' targets (a target that fails is a warning).

    Raises:
        StoreError: etcd is unreachable (the targets cannot be found).
        RuntimeError: (and the other ``_UNREACHABLE`` errors) likewise.
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
        except _UNREACHABLE as exc:  # its host is gone: a later save may succeed
            log.warning("snapshot_upload_failed", where=where, error=str(exc)[:200])
        else:
            log.info("snapshot_saved", where=where, bytes=len(document), shard=shard, step=step)


def _read_step(where: str, store: dist.Store, shard: str, slot: int) -> int | None:
    """The step of one shard's snapshot in one slot of one store, or None (none, unreachable, malformed: a warning)."""
    key = MeetingKeys.snapshot_step(shard, slot)
    try:
        if not store.check([key]):
            return None
        raw = store.get(key)
    except _UNREACHABLE as exc:
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


def _read(where: str, store: dist.Store, key: str = SNAPSHOT_KEY) -> dict[str, Any] | None:
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
    except _UNREACHABLE as exc:  # the node holding it was lost
        log.warning("snapshot_unreachable", where=where, error=str(exc)[:200])
        return None
    if len(payload) != head["bytes"]:
        raise StateDecodingError(f"in-memory snapshot ({key!r} in {where}): {len(payload)} bytes in its pieces, "
                                 f"its head says {head['bytes']}; refused")
    try:
        return loads(payload)
    except StateDecodingError as exc:
        raise StateDecodingError(f"in-memory snapshot ({key!r} in {where}): {exc}") from None


def _step(state: dict[str, Any]) -> int:
    step = state.get("step") if isinstance(state, dict) else None
    return step if type(step) is int else -1


class DiskCheckpoints:
    """Asynchronous saves of the state, newest complete one named by ``latest``.

    With shards (tensor/pipeline parallelism) each shard writes
    ``step-<s>.<shard>.state`` (complete once renamed into place) and a load
    takes this shard's file of the newest step every shard has; no ``latest``
    file is written.

    Args:
        directory: Checkpoint directory (created).
        every: Steps between checkpoints (0: never).
        keep: Complete checkpoints kept (older ones are deleted; per shard).
        shard: This rank's model shard (``tp<t>-pp<p>``); None: the whole model.
        shards: Every shard of the model (with ``shard``).

    Raises:
        ConfigError: ``every`` < 0, ``keep`` < 1, or ``shard`` not among ``shards``.
    """

    def __init__(self, directory: str | os.PathLike[str], every: int, keep: int = 2, shard: str | None = None,
                 shards: Sequence[str] = ()) -> None:
        if every < 0:
            raise ConfigError(f"checkpoint_every={every} must be >= 0")
        if keep < 1:
            raise ConfigError(f"keep={keep} must be >= 1")
        if shard is not None and shard not in shards:
            raise ConfigError(f"shard {shard!r} is not one of the model's shards {list(shards)}")
        self.shard, self.shards = shard, list(shards)
        self.directory, self.every, self.keep = Path(directory), every, keep
        self.directory.mkdir(parents=True, exist_ok=True)
        self._pending: Future | None = None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="unicron-checkpoint")

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Start writing ``state`` (the state at the start of ``step``); returns at once.

        A save still running is waited for first (at most one in flight).

        Raises:
            StateEncodingError: ``state`` holds a value the safe format cannot
                carry (raised here, not in the background).
        """
        self.wait()
        suffix = "" if self.shard is None else f".{self.shard}"
        path = self.directory / f"step-{step:08d}{suffix}.state"
        future = self._writer.submit(self._write_and_mark, step, path, encode(state, copy=True))
        future.add_done_callback(lambda f: self._log_failure(f, step, path))
        self._pending = future

    @staticmethod
    def _log_failure(future: Future, step: int, path: Path) -> None:
        if future.exception() is not None:
            log.error("checkpoint_failed", step=step, path=str(path), error=str(future.exception()))

    def _write_and_mark(self, step: int, path: Path, state: EncodedState) -> None:
        """In the writer thread: the file, then ``latest`` (so :meth:`wait` returns after both)."""
        _write(path, state)
        if self.shard is not None:
            log.info("checkpoint_saved", step=step, path=str(path), shard=self.shard)
            files = self._shard_files(self.shard)
            for step_saved in sorted(files)[: -self.keep]:
                files[step_saved].unlink(missing_ok=True)
            return
        try:
            newest = self.latest_step()
        except StateDecodingError:  # a malformed ``latest`` is replaced
            newest = None
        if newest is not None and newest > step:  # a writer resumed after a freeze: the step fences it
            log.warning("checkpoint_stale_not_marked", step=step, latest=newest, path=str(path))
            return
        tmp = self.directory / "latest.tmp"
        tmp.write_text(json.dumps({"step": step, "path": path.name}))
        os.replace(tmp, self.directory / "latest")
        log.info("checkpoint_saved", step=step, path=str(path))
        for old in sorted(self.directory.glob("step-*"))[: -self.keep]:
            if old.is_dir():  # written by torch.distributed.checkpoint (an earlier unicron)
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)

    def wait(self) -> None:
        """Wait for the save in flight, if any."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def latest_step(self) -> int | None:
        """The step of the newest complete checkpoint (with shards: that every shard has), or None.

        Raises:
            StateDecodingError: The ``latest`` file is malformed.
        """
        if self.shard is not None:
            return newest_common_step({shard: self._shard_files(shard) for shard in self.shards}, self.shards)
        latest = self._latest()
        return None if latest is None else latest[0]

    def _shard_files(self, shard: str) -> dict[int, Path]:
        """``step -> path`` of the complete checkpoints of one shard."""
        pattern = re.compile(rf"step-(\d{{8,}})\.{re.escape(shard)}\.state")
        found = {}
        for path in self.directory.glob(f"step-*.{shard}.state"):
            match = pattern.fullmatch(path.name)
            if match:
                found[int(match.group(1))] = path
        return found

    def _latest(self) -> tuple[int, Path] | None:
        marker = self.directory / "latest"
        if not marker.exists():
            return None
        try:
            doc = json.loads(marker.read_text())
            step, name = doc["step"], doc["path"]
        except (ValueError, TypeError, KeyError) as exc:
            raise StateDecodingError(f"{marker} is not a checkpoint marker: {exc}") from None
        path = self.directory / str(name)
        if type(step) is int and isinstance(name, str) and _CHECKPOINT_NAME.fullmatch(name):
            return step, path
        if isinstance(name, str) and "/" not in name and path.is_dir():
            raise StateDecodingError(
                f"checkpoint {path} was written by torch.distributed.checkpoint (an earlier unicron), whose loading "
                f"unpickles files in it and so could run code: refused. Load it yourself if you trust its origin")
        raise StateDecodingError(f"{marker} names {name!r} (step {step!r}): not a checkpoint of this directory; refused")

    def load(self, step: int | None = None) -> dict[str, Any] | None:
        """The newest complete checkpoint (with shards: this shard's of the newest step every shard has, or of
        ``step`` when given), or None.

        Raises:
            StateDecodingError: The checkpoint (or ``latest``) is not in the safe
                state format (e.g. a pickle); nothing in it ran.
        """
        if self.shard is not None:
            step = self.latest_step() if step is None else step
            path = None if step is None else self._shard_files(self.shard).get(step)
            latest = None if path is None else (step, path)
        else:
            latest = self._latest()
        if latest is None:
            return None
        try:
            return loads(latest[1].read_bytes())
        except StateDecodingError as exc:
            raise StateDecodingError(f"checkpoint {latest[1]}: {exc}") from None


def _write(path: Path, state: EncodedState) -> None:
    """Write the document to ``path`` atomically (a crash leaves no partial file under that name)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        for part in pack_parts(state):
            f.write(part)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
