"""Where a job's state comes from when no data-parallel replica has it (paper section 6, GEMINI).

Two tiers behind the replicas:

* :class:`MemorySnapshot`: every ``every`` steps the group's leader puts the
  serialized state into the rendezvous store. That store lives in the memory
  of the agent hosting the rendezvous (on another node than most workers), not
  in any worker, so it survives the loss of every worker of the group.
* :class:`DiskCheckpoints`: every ``every`` steps the leader writes the state
  in a background thread (the step goes on) to ``<directory>/step-<s>.state``;
  a ``latest`` file names the newest *complete* checkpoint, so a crash while
  writing leaves the previous one.

Both are written by one replica only: every data-parallel replica holds the
same state. Both hold it in the format of :mod:`~unicron_elastic.strategy.safe_state`
(raw tensor bytes plus JSON), so reading one never unpickles anything: the
agent's TCPStore has no authentication, and a checkpoint directory may be
shared.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import structlog
import torch.distributed as dist

from unicron_elastic.api import ConfigError, StateDecodingError
from unicron_elastic.strategy.safe_state import EncodedState, encode, loads, pack, pack_parts

log = structlog.get_logger(__name__)

SNAPSHOT_KEY = "unicron-snapshot/state"
_CHECKPOINT_NAME = re.compile(r"step-\d{8,}\.state")


class MemorySnapshot:
    """The latest state, serialized in the memory of the store's host.

    Args:
        store: The rendezvous store (outlives workers); None: its host is
            unreachable, no snapshots.
        every: Steps between snapshots (0: never).

    Raises:
        ConfigError: ``every`` < 0.
    """

    def __init__(self, store: dist.Store | None, every: int) -> None:
        if every < 0:
            raise ConfigError(f"snapshot_every={every} must be >= 0")
        self.store, self.every = store, every
        self._thread: threading.Thread | None = None

    def due(self, step: int) -> bool:
        """Whether a snapshot is due at the start of ``step`` (never without a store)."""
        return self.store is not None and self.every > 0 and step % self.every == 0

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
        try:
            self.store.set(SNAPSHOT_KEY, pack(state))
        except (RuntimeError, OSError) as exc:  # its host is gone: training goes on, a later save may succeed
            log.warning("snapshot_upload_failed", error=str(exc)[:200])

    def wait(self) -> None:
        """Wait for the snapshot being written, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def load(self) -> dict[str, Any] | None:
        """The latest snapshot, or None.

        Raises:
            StateDecodingError: The value in the store is not a safe state
                document (e.g. a pickle someone put there); nothing in it ran.
        """
        if self.store is None:
            return None
        try:
            if not self.store.check([SNAPSHOT_KEY]):
                return None
            payload = self.store.get(SNAPSHOT_KEY)
        except (RuntimeError, OSError) as exc:  # the node holding it was lost
            log.warning("snapshot_unreachable", error=str(exc)[:200])
            return None
        try:
            return loads(payload)
        except StateDecodingError as exc:
            raise StateDecodingError(f"in-memory snapshot ({SNAPSHOT_KEY!r} in the agent's store): {exc}") from None


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
