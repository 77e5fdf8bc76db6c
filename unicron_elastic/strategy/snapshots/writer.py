"""A snapshot costs the training step one copy: the document is built in a kept host buffer, another process sends it.

The training process lays the state out as a safe-state document
(:func:`~unicron_elastic.strategy.snapshots.safe_state.layout`) straight into a
:class:`HostBuffer` it keeps between snapshots: anonymous shared memory
(``memfd``), pinned and filled on a side CUDA stream when the state is on a
GPU. Each array is copied once by torch (or numpy), in C; Python only walks
the list of arrays. A child process, the *snapshot writer*
(started with this module's :func:`main`), maps the same
memory and does everything else outside the training interpreter: cutting
the document into pieces, sending them to the agents' snapshot servers
(GEMINI's placement, :class:`~unicron_elastic.strategy.snapshots.places.PeerServers`)
or to torch's agent store, and deleting the previous upload.

The two talk over a ``SOCK_SEQPACKET`` socket pair. The writer first says it
is ready (its imports done, 1-3 s). A rank that saves from the start waits for
that once, before its first step (:meth:`SnapshotWriter.start`); a rank that
becomes a saver later (the new primary replica after a regroup) or whose
writer was lost starts one without waiting (:meth:`SnapshotWriter.ready`), and
:class:`~unicron_elastic.strategy.snapshots.tiers.MemorySnapshot` sends the
snapshots due meanwhile from a thread: the step never waits for a writer's
start, and a snapshot lands at once after a failover. A job names the
document's size and where it goes (and passes the buffer's file descriptor
when the buffer is new); the writer answers ``{"done": id}`` once every
target has it or failed with a warning. One job is in flight at a time: the
buffer is not written while the writer reads it. The writer exits when the
training process closes its end (or dies: the socket reports end of file);
the memory is freed when both have closed it.
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog
import torch

from unicron_elastic.api import ConfigError, StoreError
from unicron_elastic.strategy.snapshots.safe_state import EncodedState, Layout, layout
from unicron_elastic.strategy.snapshots.places import places_from
from unicron_elastic.strategy.snapshots.wire import upload

log = structlog.get_logger(__name__)

_GROWTH = 1.25  # a new buffer's headroom over the document (optimizer state appears after the first step)
_MESSAGE = 1 << 16  # largest control message
WRITER_NICENESS = 5  # the writer yields the CPU to the training process, without starving on a busy node
READY_TIMEOUT_S = 60.0  # the writer's start (an interpreter, torch) on a loaded machine
_WRITER_MAIN = "from unicron_elastic.strategy.snapshots.writer import main; main()"  # (not -m: the package imports it)


@dataclass(frozen=True)
class Job:
    """One snapshot for the writer to send.

    Attributes:
        id: Increasing per training process.
        size: Bytes of the document at the start of the buffer.
        step: The snapshot's step.
        shard: The model shard (``tp<t>-pp<p>``) or None.
        slot: The shard's slot (0 without shards).
        places: Where it goes, as :meth:`~unicron_elastic.strategy.snapshots.tiers.MemorySnapshot` describes them.
    """

    id: int
    size: int
    step: int
    shard: str | None
    slot: int
    places: dict[str, Any]


class HostBuffer:
    """Shared host memory the training process keeps between snapshots (a ``memfd``), as a byte tensor.

    Args:
        capacity: Bytes.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = max(capacity, mmap.PAGESIZE)
        self.fd = os.memfd_create("unicron-snapshot", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.capacity)
        self._map = mmap.mmap(self.fd, self.capacity)
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._pinned = False

    def pin(self) -> None:
        """Page-lock the buffer for asynchronous copies from a GPU (once; a failure is a warning)."""
        if self._pinned:
            return
        self._pinned = True
        result = torch.cuda.cudart().cudaHostRegister(self.bytes.data_ptr(), self.capacity, 0)
        if int(result) != 0:
            log.warning("snapshot_buffer_not_pinned", error=str(result), bytes=self.capacity)

    def close(self) -> None:
        """Release this process's mapping and descriptor (the writer keeps its own until it maps another)."""
        if self._pinned and torch.cuda.is_available():
            torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
        del self.bytes
        self._map.close()
        os.close(self.fd)


def copy_document(encoded: EncodedState, buffer: HostBuffer, doc_layout: Layout,
                  stream: torch.cuda.Stream | None = None) -> None:
    """Lay the document out in ``buffer``: its head, then each array at its offset (one copy of each).

    Args:
        encoded: The state, not copied (its tensors may be on a GPU).
        buffer: At least ``doc_layout.size`` bytes.
        doc_layout: ``layout(encoded)``.
        stream: The side CUDA stream for tensors on a GPU (the caller waits for it before the state changes).
    """
    target = buffer.bytes
    target[: len(doc_layout.head)].copy_(torch.frombuffer(bytearray(doc_layout.head), dtype=torch.uint8))
    for array_, (offset, nbytes) in zip(encoded.buffers, doc_layout.buffers):
        start = doc_layout.body + offset
        if isinstance(array_, np.ndarray):
            np.ndarray(array_.shape, array_.dtype, buffer=buffer._map, offset=start)[...] = array_
            continue
        if nbytes == 0:
            continue
        place = target[start : start + nbytes].view(array_.dtype).view(array_.shape)
        if array_.is_cuda and stream is not None:
            with torch.cuda.stream(stream):
                place.copy_(array_, non_blocking=True)
                array_.record_stream(stream)
        else:
            place.copy_(array_.resolve_conj().resolve_neg())


class SnapshotWriter:
    """The training process's side: the kept buffer, the writer process and one job in flight.

    Raises:
        OSError: The writer process cannot be started.
    """

    def __init__(self) -> None:
        self._buffer: HostBuffer | None = None
        self._sent: HostBuffer | None = None  # the buffer the writer has mapped
        self._socket: socket.socket | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._ids = 0
        self._in_flight: Job | None = None
        self._pending: tuple[Job, torch.cuda.Event] | None = None  # copied on a side stream, not sent yet
        self._stream: torch.cuda.Stream | None = None
        self._starting_since: float | None = None  # monotonic time the writer was started, until it said ready

    def write(self, encoded: EncodedState, step: int, shard: str | None, slot: int, places: dict[str, Any]) -> bool:
        """Copy the document into the buffer now; the writer sends it (after :meth:`settle` for GPU tensors).

        Never waits for the writer: while it is still sending the previous
        snapshot, or is starting (not started before with :meth:`start`, or
        lost: it is started again here), this one is skipped
        (``snapshot_skipped``, a warning) and the next one due is taken instead.

        Returns:
            Whether the snapshot was taken.

        Raises:
            StateEncodingError: The state's skeleton cannot be written as JSON.
        """
        self.settle()
        if not self._idle():
            log.warning("snapshot_skipped", step=step, reason=f"the snapshot of step {self._in_flight.step} is "
                        "still being sent: the next one due is taken")
            return False
        if not self._running():
            log.warning("snapshot_skipped", step=step, reason="the snapshot writer is starting: the next one due "
                        "is taken")
            return False
        doc_layout = layout(encoded)
        buffer = self._room(doc_layout.size)
        cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in encoded.buffers)
        if cuda:
            buffer.pin()
            self._stream = self._stream or torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())
        copy_document(encoded, buffer, doc_layout, self._stream if cuda else None)
        self._ids += 1
        job = Job(self._ids, doc_layout.size, step, shard, slot, places)
        if cuda:
            event = torch.cuda.Event()
            event.record(self._stream)
            self._pending = (job, event)
            return True
        return self._send(job)

    def settle(self) -> None:
        """Before the state changes (the optimizer step): the side stream's copy is done; the writer gets the job."""
        if self._pending is None:
            return
        job, event = self._pending
        self._pending = None
        torch.cuda.current_stream().wait_event(event)
        event.synchronize()
        self._send(job)

    def wait(self) -> None:
        """Until the writer has sent the snapshot in flight (if any)."""
        self.settle()
        while self._in_flight is not None:
            self._reply(block=True)

    def _idle(self) -> bool:
        """Whether no snapshot is in flight any more (answers already received are read, without waiting)."""
        while self._in_flight is not None:
            if not self._reply(block=False):
                return False
        return True

    def _reply(self, block: bool) -> bool:
        """Read one answer of the writer (False: none yet, not blocking); a lost writer ends the job in flight."""
        try:
            raw = self._socket.recv(_MESSAGE, 0 if block else socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError as exc:
            raw, error = b"", str(exc)
        else:
            error = "the snapshot writer exited"
        try:
            reply = json.loads(raw) if raw else None
        except ValueError:
            reply, error = None, f"malformed answer {raw[:100]!r}"
        if reply is None:
            log.warning("snapshot_writer_lost", error=error[:200], step=self._in_flight.step)
            self._stop()
        elif reply.get("done") == self._in_flight.id:
            self._in_flight = None
        return True

    def close(self) -> None:
        """Wait for the snapshot in flight, then stop the writer and free the buffer."""
        self.wait()
        self._stop()
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None

    def _room(self, size: int) -> HostBuffer:
        """The kept buffer, replaced by a larger one when the document outgrew it."""
        if self._buffer is None or self._buffer.capacity < size:
            if self._buffer is not None:
                self._buffer.close()
            self._buffer = HostBuffer(int(size * _GROWTH))
        return self._buffer

    def _send(self, job: Job) -> bool:
        """Hand ``job`` to the (ready) writer; a writer lost meanwhile is a warning (the next snapshot restarts it).

        Returns:
            Whether the writer has the job.
        """
        assert self._buffer is not None
        message = json.dumps(vars(job)).encode()
        try:
            fds = [] if self._sent is self._buffer else [self._buffer.fd]  # (a new buffer may reuse the number)
            socket.send_fds(self._socket, [message], fds)
        except OSError as exc:
            log.warning("snapshot_writer_lost", error=str(exc)[:200], step=job.step)
            self._stop()
            return False
        self._sent = self._buffer
        self._in_flight = job
        return True

    def start(self) -> None:
        """Start the writer process now and wait until it is ready (1-3 s): the first snapshot is not skipped.

        Raises:
            OSError: The process cannot be started, or did not say it is
                ready within :data:`READY_TIMEOUT_S` (stopped again).
        """
        self._spawn()
        if self._starting_since is not None:
            self._socket.settimeout(READY_TIMEOUT_S)
            try:
                self._hear_ready(self._socket.recv(_MESSAGE))
            except OSError as exc:
                self._stop()
                raise OSError(f"the snapshot writer did not start: {exc}") from None
            finally:
                if self._socket is not None:
                    self._socket.settimeout(None)

    def ready(self) -> bool:
        """Whether the writer is ready for a job, without waiting: a lost one is replaced, a new one started."""
        return self._running()

    def _running(self) -> bool:
        """Whether the writer is ready for a job, without waiting: a lost one is replaced, a new one started.

        A writer that does not become ready within :data:`READY_TIMEOUT_S` is
        stopped with a warning (the next snapshot due starts another).
        """
        if self._process is not None and self._process.poll() is not None:
            log.warning("snapshot_writer_lost", error=f"the snapshot writer exited ({self._process.returncode})")
            self._stop()
        try:
            self._spawn()
        except OSError as exc:
            log.warning("snapshot_writer_lost", error=f"the snapshot writer cannot be started: {exc}"[:200])
            return False
        if self._starting_since is None:
            return True
        try:
            self._hear_ready(self._socket.recv(_MESSAGE, socket.MSG_DONTWAIT))
        except BlockingIOError:
            if time.monotonic() - self._starting_since > READY_TIMEOUT_S:
                log.warning("snapshot_writer_lost", error=f"not ready within {READY_TIMEOUT_S:.0f} s")
                self._process.kill()  # (stuck: the step must not wait for it to exit)
                self._stop()
            return False
        except OSError as exc:
            log.warning("snapshot_writer_lost", error=str(exc)[:200])
            self._stop()
            return False
        return True

    def _spawn(self) -> None:
        """Start the writer process, if none runs (it says it is ready later: :meth:`_hear_ready`).

        Raises:
            OSError: The process cannot be started.
        """
        if self._process is not None:
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            try:
                self._process = subprocess.Popen(
                    [sys.executable, "-c", _WRITER_MAIN, str(theirs.fileno())],
                    pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
            except OSError:
                ours.close()
                raise
        self._socket, self._sent = ours, None
        self._starting_since = time.monotonic()

    def _hear_ready(self, reply: bytes) -> None:
        """The writer's first message: it is ready.

        Raises:
            OSError: It said something else, or exited (an empty message).
        """
        try:
            ready = json.loads(reply or b"null") == {"ready": True}
        except ValueError:
            ready = False
        if not ready:
            raise OSError(f"the snapshot writer did not start: {reply[:100]!r}")
        self._starting_since = None

    def _stop(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        if self._process is not None:
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None
        self._sent, self._in_flight, self._starting_since = None, None, None


# -- the writer process ----------------------------------------------------------------------------
class _Mapped:
    """The writer's read-only view of the training process's buffer."""

    def __init__(self) -> None:
        self.view: memoryview | None = None
        self._map: mmap.mmap | None = None

    def replace(self, fd: int) -> None:
        if self._map is not None:
            self.view.release()
            self._map.close()
        size = os.fstat(fd).st_size
        self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        os.close(fd)
        self.view = memoryview(self._map)


def _places(spec: dict[str, Any], cache: dict[str, Any]) -> Any:
    """The snapshot's places from their description (connections kept between jobs)."""
    key = json.dumps(spec, sort_keys=True)
    if key not in cache:
        cache[key] = places_from(spec)
    return cache[key]


def serve(channel: socket.socket) -> None:
    """The writer's loop: each job's document, from the shared buffer to its places; an answer per job."""
    mapped, cache = _Mapped(), {}
    os.nice(WRITER_NICENESS)  # (after the imports: a loaded machine would starve them)
    channel.send(json.dumps({"ready": True}).encode())
    while True:
        message, fds, _, _ = socket.recv_fds(channel, _MESSAGE, 1)
        if not message:
            return  # the training process closed its end, or died
        for fd in fds:
            mapped.replace(fd)
        job = Job(**json.loads(message))
        try:
            upload(_places(job.places, cache), mapped.view[: job.size], job.step, job.shard, job.slot)
        except (RuntimeError, OSError, ValueError, LookupError, StoreError, ConfigError) as exc:
            log.warning("snapshot_upload_failed", error=str(exc)[:200], step=job.step)
        channel.send(json.dumps({"done": job.id}).encode())


def main(argv: list[str] | None = None) -> None:
    """The snapshot writer process: serve jobs on the inherited socket whose number is the first argument."""
    args = sys.argv[1:] if argv is None else argv
    channel = socket.socket(fileno=int(args[0]))
    try:
        serve(channel)
    except ConnectionError:
        pass
    finally:
        channel.close()


if __name__ == "__main__":
    main()
