"""Where a job's state comes from when no data-parallel replica has it (paper section 6, GEMINI).

Two tiers behind the replicas:

* :class:`MemorySnapshot`: every ``every`` steps the group's primary copies the
  state once into a host buffer and its snapshot writer process
  (:mod:`~unicron_elastic.strategy.snapshots.writer`) sends it into the memory
  of an agent, not of any worker, so it survives the loss of every worker of
  the group (a store only this process reaches: a thread of its own).
  Under ``unicron-run`` those agents are the ones of the *next two* live
  nodes in ring order (GEMINI's placement,
  :mod:`~unicron_elastic.strategy.snapshots.places`; the other node when
  there are two): each agent hosts a snapshot server and publishes its
  address in the meeting store, so losing any one node (dead or frozen)
  loses a replica or a copy, never the only snapshot. Under plain
  ``torchrun`` it is torch's agent TCPStore (the rank-0 node's agent). How
  one snapshot sits in a store is :mod:`~unicron_elastic.strategy.snapshots.wire`.
* :class:`DiskCheckpoints`: every ``every`` steps the primary writes the state
  in a background thread (the step goes on) to ``<directory>/step-<s>.state``;
  a ``latest`` file names the newest *complete* checkpoint, so a crash while
  writing leaves the previous one.

Both are written by one replica only: every data-parallel replica holds the
same state. With tensor/pipeline parallelism each *shard* of that replica
(``tp<t>-pp<p>``) writes its own part (``shard=``), and a resume takes the
newest step that every shard has
(:func:`~unicron_elastic.strategy.snapshots.wire.newest_common_step`): a save
that completed for some shards only is skipped, never mixed with another
step. Both hold it in the format of :mod:`~unicron_elastic.strategy.snapshots.safe_state`
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
from pathlib import Path
from typing import Any

import structlog
import torch.distributed as dist

from unicron_elastic.api import ConfigError, StateDecodingError
from unicron_elastic.store.keys import MeetingKeys
from unicron_elastic.strategy.snapshots.safe_state import EncodedState, encode, loads, pack, pack_parts
from unicron_elastic.strategy.snapshots.places import PeerServers, _OneStore
from unicron_elastic.strategy.snapshots.wire import (
    SLOTS,
    SNAPSHOT_KEY,
    UNREACHABLE,
    newest_common_step,
    read_snapshot,
    read_step,
    state_step,
    upload,
)
from unicron_elastic.strategy.snapshots.writer import SnapshotWriter

log = structlog.get_logger(__name__)

_CHECKPOINT_NAME = re.compile(r"step-\d{8,}\.state")



class MemorySnapshot:
    """The latest state, serialized in the memory of an agent (not of any worker).

    With shards each shard keeps its two newest snapshots (slots used in
    turn), so a save that landed for some shards only (a writer died) still
    leaves a step every shard has.

    Args:
        store: Where it lives: the agents' snapshot servers
            (:class:`~unicron_elastic.strategy.snapshots.places.PeerServers`, under ``unicron-run``), or one store that outlives workers (torch's
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

        Out of process (:mod:`~unicron_elastic.strategy.snapshots.writer`): one
        copy of each array into the kept host buffer, the rest in the writer
        process (call :meth:`settle` before the state changes); while the
        writer still sends the previous snapshot this one is skipped with a
        warning. While the writer process starts (a rank that became the
        primary replica after a regroup, or whose writer was lost), a thread
        sends a copy, so a snapshot lands at once after a failover (and a
        frozen former primary's older upload is refused over it). Else a
        thread of this process packs and uploads a copy, a snapshot still
        being sent waited for first. Training goes on while
        the snapshot is sent (at most one in flight).

        Returns:
            Whether the snapshot was taken (False: skipped).

        Raises:
            StateEncodingError: ``state`` holds a value the safe format cannot
                carry (raised here, not in the background).
        """
        step = state_step(state)
        if self._writer is not None:
            if self._thread is not None and self._thread.is_alive():
                log.warning("snapshot_skipped", step=step, reason="the snapshot sent while the writer started is "
                            "still being sent: the next one due is taken")
                return False
            if self._writer.ready():
                return self._writer.write(encode(state), step, self.shard, self._slot(step), self._spec)
            log.info("snapshot_in_thread", step=step, reason="the snapshot writer is starting (a new primary "
                     "replica, or a lost writer): this one is copied and sent by a thread")
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
        return 0 if self.shard is None else (step // self.every) % SLOTS

    def _upload(self, state: EncodedState, step: int) -> None:
        """In the background thread: the document, then :func:`~unicron_elastic.strategy.snapshots.wire.upload`.

        Failures are warnings: training goes on.
        """
        try:
            upload(self._places, pack(state), step, self.shard, self._slot(step))
        except UNREACHABLE as exc:
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
        except UNREACHABLE as exc:
            log.warning("snapshot_unreachable", error=str(exc)[:200])
            return None
        if self.shard is not None:
            return self._load_shard(sources, step)
        newest = None
        for where, store in sources:
            state = read_snapshot(where, store, SNAPSHOT_KEY)
            if state is not None and (newest is None or state_step(state) > state_step(newest)):
                newest = state
        return newest

    def _load_shard(self, sources: list[tuple[str, dist.Store]], step: int | None) -> dict[str, Any] | None:
        """This shard's snapshot of ``step`` (None: the newest step every shard has), in either slot, on any
        server, or None."""
        steps: dict[str, dict[int, tuple[str, dist.Store, int]]] = {shard: {} for shard in self.shards}
        for where, store in sources:
            for shard in self.shards:
                for slot in range(SLOTS):
                    found = read_step(where, store, shard, slot)
                    if found is not None:
                        steps[shard][found] = (where, store, slot)
        common = newest_common_step(steps, self.shards) if step is None else step
        if common is None or common not in steps[self.shard]:
            return None
        where, store, slot = steps[self.shard][common]
        state = read_snapshot(where, store, MeetingKeys.snapshot(self.shard, slot))
        if state is None or state_step(state) != common:  # overwritten meanwhile: a newer save is on its way
            log.warning("snapshot_changed_while_read", where=where, shard=self.shard, step=common)
            return None
        return state


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
        self._mark(step, path)
        newer = self._newer_files(step)
        if newer:  # frozen between the check and the mark, resumed after newer ones were saved: mark back
            self._mark(max(newer), newer[max(newer)])
            log.warning("checkpoint_stale_not_marked", step=step, latest=max(newer), path=str(path))
            return
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

    def _mark(self, step: int, path: Path) -> None:
        """Point ``latest`` at ``path`` (atomically; each process through a file of its own)."""
        tmp = self.directory / f"latest.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"step": step, "path": path.name}))
        os.replace(tmp, self.directory / "latest")

    def _newer_files(self, step: int) -> dict[int, Path]:
        """``step -> path`` of the complete (unsharded) checkpoints of steps after ``step``."""
        found = {}
        for path in self.directory.glob("step-*.state"):
            match = re.fullmatch(r"step-(\d{8,})\.state", path.name)
            if match and int(match.group(1)) > step:
                found[int(match.group(1))] = path
        return found

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
