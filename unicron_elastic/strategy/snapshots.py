"""Where a job's state comes from when no data-parallel replica has it (paper section 6, GEMINI).

Two tiers behind the replicas:

* :class:`MemorySnapshot`: every ``every`` steps the group's leader puts the
  serialized state into the rendezvous store. That store lives in the memory
  of the agent hosting the rendezvous (on another node than most workers), not
  in any worker, so it survives the loss of every worker of the group.
* :class:`DiskCheckpoints`: every ``every`` steps the leader writes the state
  with ``torch.distributed.checkpoint.async_save`` (a background thread; the
  step goes on) to ``<directory>/step-<s>``; a ``latest`` file names the newest
  *complete* checkpoint, so a crash while writing leaves the previous one.

Both are written by one replica only: every data-parallel replica holds the
same state.
"""

from __future__ import annotations

import copy
import io
import json
import os
import shutil
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from unicron_elastic.api import ConfigError

log = structlog.get_logger(__name__)

SNAPSHOT_KEY = "unicron-snapshot/state"
TENSOR_KEYS = ("state_dict", "optimizer_states")  # saved as tensors by DCP; the rest as one blob


class MemorySnapshot:
    """The latest state, serialized in the memory of the store's host.

    Args:
        store: The rendezvous store (outlives workers).
        every: Steps between snapshots (0: never).

    Raises:
        ConfigError: ``every`` < 0.
    """

    def __init__(self, store: dist.Store, every: int) -> None:
        if every < 0:
            raise ConfigError(f"snapshot_every={every} must be >= 0")
        self.store, self.every = store, every
        self._thread: threading.Thread | None = None

    def due(self, step: int) -> bool:
        """Whether a snapshot is due at the start of ``step``."""
        return self.every > 0 and step % self.every == 0

    def save(self, state: dict[str, Any]) -> None:
        """Copy the tensors of ``state`` now; serialize and upload in the background.

        Training goes on while the snapshot is written; a snapshot still being
        written is waited for first (at most one in flight).
        """
        self.wait()
        frozen = _frozen(state)
        self._thread = threading.Thread(target=self._upload, args=(frozen,), name="unicron-snapshot", daemon=True)
        self._thread.start()

    def _upload(self, state: dict[str, Any]) -> None:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        self.store.set(SNAPSHOT_KEY, buffer.getvalue())

    def wait(self) -> None:
        """Wait for the snapshot being written, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def load(self) -> dict[str, Any] | None:
        """The latest snapshot, or None."""
        if not self.store.check([SNAPSHOT_KEY]):
            return None
        return torch.load(io.BytesIO(self.store.get(SNAPSHOT_KEY)), weights_only=False)


def _frozen(state: dict[str, Any]) -> dict[str, Any]:
    """A copy training cannot change underneath a background writer."""
    return tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v), state)


def _split(state: dict[str, Any]) -> dict[str, Any]:
    """Tensors for DCP; everything else (loop progress, callbacks, RNG) as one pickled blob."""
    lightning = state["lightning"]
    rest = {**state, "lightning": {k: v for k, v in lightning.items() if k not in TENSOR_KEYS}}
    blob = io.BytesIO()
    torch.save(rest, blob)
    blob.seek(0)
    return {**{k: lightning[k] for k in TENSOR_KEYS if k in lightning}, "rest": blob}


def _join(saved: dict[str, Any]) -> dict[str, Any]:
    saved["rest"].seek(0)
    state = torch.load(saved["rest"], weights_only=False)
    for key in TENSOR_KEYS:
        if key in saved:
            state["lightning"][key] = saved[key]
    for opt in state["lightning"].get("optimizer_states", []):
        # DCP stores dict keys as strings; optimizers index their state by parameter number
        opt["state"] = {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in opt["state"].items()}
    return state


class DiskCheckpoints:
    """Asynchronous ``torch.distributed.checkpoint`` saves, newest complete one named by ``latest``.

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

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Start writing ``state`` (the state at the start of ``step``); returns at once.

        A save still running is waited for first (at most one in flight).
        """
        from torch.distributed.checkpoint import async_save

        self.wait()
        path = self.directory / f"step-{step:08d}"
        future = async_save(_split(_frozen(state)), checkpoint_id=str(path), no_dist=True)
        future.add_done_callback(lambda f: self._mark(f, step, path))
        self._pending = future

    def _mark(self, future: Future, step: int, path: Path) -> None:
        if future.exception() is not None:
            log.error("checkpoint_failed", step=step, path=str(path), error=str(future.exception()))
            return
        tmp = self.directory / "latest.tmp"
        tmp.write_text(json.dumps({"step": step, "path": path.name}))
        os.replace(tmp, self.directory / "latest")
        log.info("checkpoint_saved", step=step, path=str(path))
        for old in sorted(self.directory.glob("step-*"))[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def wait(self) -> None:
        """Wait for the save in flight, if any."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def latest_step(self) -> int | None:
        marker = self.directory / "latest"
        return json.loads(marker.read_text())["step"] if marker.exists() else None

    def load(self) -> dict[str, Any] | None:
        """The newest complete checkpoint, or None."""
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

        marker = self.directory / "latest"
        if not marker.exists():
            return None
        path = self.directory / json.loads(marker.read_text())["path"]
        return _join(_load_state_dict_from_keys(checkpoint_id=str(path)))
