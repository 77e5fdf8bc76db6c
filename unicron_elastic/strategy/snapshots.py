"""Where a job's state comes from when no data-parallel replica has it (paper section 6, GEMINI).

Two tiers behind the replicas:

* :class:`MemorySnapshot`: every ``every`` steps the group's leader copies the
  state and, in a background thread, serializes it into the memory of an
  agent, not of any worker, so it survives the loss of every worker of the
  group. Under ``unicron-run`` that agent is the one of the *next* live node
  in ring order (GEMINI's placement, :func:`snapshot_targets`): each agent
  hosts a snapshot server and publishes its address in the meeting store
  (:class:`PeerServers`), so losing the writer's node loses the replica, not
  the snapshot. Under plain ``torchrun`` it is torch's agent TCPStore (the
  rank-0 node's agent).
* :class:`DiskCheckpoints`: every ``every`` steps the leader writes the state
  in a background thread (the step goes on) to ``<directory>/step-<s>.state``;
  a ``latest`` file names the newest *complete* checkpoint, so a crash while
  writing leaves the previous one.

Both are written by one replica only: every data-parallel replica holds the
same state. Both hold it in the format of :mod:`~unicron_elastic.strategy.safe_state`
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
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import structlog
import torch.distributed as dist

from unicron_elastic.api import ConfigError, StateDecodingError, StoreError
from unicron_elastic.store.keys import MeetingKeys
from unicron_elastic.strategy.safe_state import EncodedState, encode, loads, pack, pack_parts

log = structlog.get_logger(__name__)

SNAPSHOT_KEY = MeetingKeys.SNAPSHOT
_UNREACHABLE = (RuntimeError, OSError, LookupError, ValueError, StoreError)  # a store or its host is gone


def snapshot_targets(own_node: int, live_nodes: Sequence[int]) -> list[int]:
    """The nodes whose agents hold the snapshot written on ``own_node`` (GEMINI's ring).

    Args:
        own_node: The writer's node (group rank).
        live_nodes: The nodes whose agents are alive (any order; may include ``own_node``).

    Returns:
        The next live node after ``own_node`` in ring order (wrapping to the
        lowest); ``[own_node]`` only when no other node is alive (then the
        snapshot does not survive losing that node).
    """
    others = sorted(set(live_nodes) - {own_node})
    if not others:
        return [own_node]
    after = [node for node in others if node > own_node]
    return [after[0] if after else others[0]]


class _OneStore:
    """The snapshot's place under plain ``torchrun``: one store, written and read."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store

    def targets(self) -> list[tuple[str, dist.Store]]:
        return [("the agent's store", self.store)]

    sources = targets


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

    def __init__(self, meeting: dist.Store, node: int, connect_timeout: timedelta = timedelta(seconds=5)) -> None:
        self.meeting, self.node, self.connect_timeout = meeting, int(node), connect_timeout
        self._alone = False

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
        """The server(s) the snapshot written on this node goes to: the next live node's.

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

    Args:
        store: Where it lives: the agents' snapshot servers (:class:`PeerServers`,
            under ``unicron-run``), or one store that outlives workers (torch's
            agent TCPStore under plain ``torchrun``); None: no snapshots.
        every: Steps between snapshots (0: never).

    Raises:
        ConfigError: ``every`` < 0.
    """

    def __init__(self, store: dist.Store | PeerServers | None, every: int) -> None:
        if every < 0:
            raise ConfigError(f"snapshot_every={every} must be >= 0")
        self.store, self.every = store, every
        self._places = store if isinstance(store, PeerServers) or store is None else _OneStore(store)
        self._thread: threading.Thread | None = None

    def due(self, step: int) -> bool:
        """Whether a snapshot is due at the start of ``step`` (never without a store)."""
        return self._places is not None and self.every > 0 and step % self.every == 0

    def save(self, state: dict[str, Any]) -> None:
        """Copy the tensors of ``state`` now; serialize and upload in the background.

        Training goes on while the snapshot is written; a snapshot still being
        written is waited for first (at most one in flight).

        Raises:
            StateEncodingError: ``state`` holds a value the safe format cannot
                carry (raised here, not in the background).
        """
        self.wait()
        frozen = encode(state, copy=True)
        self._thread = threading.Thread(target=self._upload, args=(frozen,), name="unicron-snapshot", daemon=True)
        self._thread.start()

    def _upload(self, state: EncodedState) -> None:
        """In the background thread: find the target(s), then write (failures are warnings: training goes on)."""
        try:
            targets = self._places.targets()
        except _UNREACHABLE as exc:
            log.warning("snapshot_upload_failed", error=str(exc)[:200])
            return
        payload = pack(state) if targets else b""
        for where, store in targets:
            try:
                store.set(SNAPSHOT_KEY, payload)
            except _UNREACHABLE as exc:  # its host is gone: a later save may succeed
                log.warning("snapshot_upload_failed", where=where, error=str(exc)[:200])
            else:
                log.info("snapshot_saved", where=where, bytes=len(payload))

    def wait(self) -> None:
        """Wait for the snapshot being written, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def load(self) -> dict[str, Any] | None:
        """The newest snapshot (highest ``"step"``) of every store that can be reached, or None.

        A store that cannot be reached is skipped with a ``snapshot_unreachable`` warning.

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
        newest = None
        for where, store in sources:
            state = _read(where, store)
            if state is not None and (newest is None or _step(state) > _step(newest)):
                newest = state
        return newest


def _read(where: str, store: dist.Store) -> dict[str, Any] | None:
    """The snapshot in one store, or None (none there, or the store is unreachable: a warning).

    Raises:
        StateDecodingError: The value is not a safe state document.
    """
    try:
        if not store.check([SNAPSHOT_KEY]):
            return None
        payload = store.get(SNAPSHOT_KEY)
    except _UNREACHABLE as exc:  # the node holding it was lost
        log.warning("snapshot_unreachable", where=where, error=str(exc)[:200])
        return None
    try:
        return loads(payload)
    except StateDecodingError as exc:
        raise StateDecodingError(f"in-memory snapshot ({SNAPSHOT_KEY!r} in {where}): {exc}") from None


def _step(state: dict[str, Any]) -> int:
    step = state.get("step") if isinstance(state, dict) else None
    return step if type(step) is int else -1


class DiskCheckpoints:
    """Asynchronous saves of the state, newest complete one named by ``latest``.

    Args:
        directory: Checkpoint directory (created).
        every: Steps between checkpoints (0: never).
        keep: Complete checkpoints kept (older ones are deleted).

    Raises:
        ConfigError: ``every`` < 0 or ``keep`` < 1.
    """

    def __init__(self, directory: str | os.PathLike[str], every: int, keep: int = 2) -> None:
        if every < 0:
            raise ConfigError(f"checkpoint_every={every} must be >= 0")
        if keep < 1:
            raise ConfigError(f"keep={keep} must be >= 1")
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
        path = self.directory / f"step-{step:08d}.state"
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
        """The step of the newest complete checkpoint, or None.

        Raises:
            StateDecodingError: The ``latest`` file is malformed.
        """
        latest = self._latest()
        return None if latest is None else latest[0]

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

    def load(self) -> dict[str, Any] | None:
        """The newest complete checkpoint, or None.

        Raises:
            StateDecodingError: The checkpoint (or ``latest``) is not in the safe
                state format (e.g. a pickle); nothing in it ran.
        """
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
