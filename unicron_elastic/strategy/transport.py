"""How the elastic engine makes and drops its process groups: gloo on CPU, NCCL on GPU.

The engine (:class:`~unicron_elastic.strategy.elastic_dp.ElasticDataParallel`)
builds a fresh group for every generation (the data-parallel group of its
shard, and with tensor/pipeline parallelism one over the whole world for the
step's commit and the pipeline's point-to-point), and drops a broken one at
once so that peers blocked on it fail within milliseconds. A
:class:`CollectiveTransport` makes and aborts them for one backend:

* :class:`GlooTransport` (CPU, the default; tested): ``ProcessGroupGloo``.
  gloo's ``abort()`` closes nothing, and its destructor waits for an
  operation in flight (for its timeout when the peer froze), so the transport
  shuts down the group's own connections itself (:meth:`GlooTransport.interrupt`):
  operations in flight fail at once here and at every peer, and a peer that
  was frozen and resumes finds its connections closed (it cannot complete a
  collective with a group that moved on).
* :class:`NcclTransport` (GPU): ``ProcessGroupNCCL`` whose communicators are
  aborted (``abort()``) when dropped, which fails this rank's pending
  operations. NCCL has no connection reset: a peer waiting on a dead, dropped
  or frozen rank fails when its engine's watch sees that member's liveness
  key gone (:mod:`~unicron_elastic.strategy.watch`: the agent deleted it, or
  the node's lease expired) and aborts its communicators (:meth:`interrupt`),
  else at its collective ``timeout``; as an error rather than a killed
  process (:func:`nccl_error_handling`: blocking wait, no asynchronous error
  handling). The state a replica sends is
  staged on the GPU. **Untested**: no GPU was available to this project's sessions.
"""

from __future__ import annotations

import os
import socket
from abc import ABC, abstractmethod
from datetime import timedelta

import structlog
import torch
import torch.distributed as dist

from unicron_elastic.api import ConfigError

log = structlog.get_logger(__name__)


class CollectiveTransport(ABC):
    """Makes and drops the engine's process groups for one backend and device.

    Attributes:
        name: The backend (``gloo``, ``nccl``).
        device: Where tensors that go through its groups live.
    """

    name: str = ""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @abstractmethod
    def new_group(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
        """A group of ``size`` ranks meeting under ``store`` (a prefix of one generation), this one at ``rank``.

        Raises:
            RuntimeError: A member is gone while it forms (the engine regroups).
        """

    @abstractmethod
    def abort(self, pg: dist.ProcessGroup) -> None:
        """Abort ``pg``'s pending work (never raises); the engine then releases its last reference."""

    def interrupt(self, pg: dist.ProcessGroup) -> None:
        """Make ``pg``'s operations in flight fail now, from any thread (never raises): a peer stopped answering."""
        self.abort(pg)


class GlooTransport(CollectiveTransport):
    """gloo groups (CPU tensors; CUDA tensors are staged through host memory)."""

    name = "gloo"

    def __init__(self, device: torch.device = torch.device("cpu")) -> None:
        super().__init__(device)
        self._connections: dict[int, set[tuple[int, str]]] = {}  # id(pg) -> its sockets (fd, inode)

    def new_group(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
        """A gloo group; the sockets it connects while it forms (its full mesh) are noted as its own."""
        before = stream_sockets()
        pg = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._connections[id(pg)] = stream_sockets() - before
        return pg

    def abort(self, pg: dist.ProcessGroup) -> None:
        """Shut the group's connections down (:meth:`interrupt`) and forget them; the engine releases the group."""
        self.interrupt(pg)
        self._connections.pop(id(pg), None)

    def interrupt(self, pg: dist.ProcessGroup) -> None:
        """Shut down the group's connections: its operations in flight fail here and at every peer.

        ``ProcessGroupGloo.abort()`` closes nothing (torch 2.13), and the
        group's destructor waits for an operation in flight, which with a
        frozen peer lasts until the group's timeout. A connection shut down
        makes gloo fail that operation at once ("Connection closed by peer"),
        here and at the peers, as a reset would. Only the group's own
        connected sockets are touched (noted when it formed, and only while
        the descriptor still names the same socket); its listening socket is
        left alone (gloo's listener aborts the process on an error).
        """
        for fd, inode in self._connections.get(id(pg), ()):
            shut_down(fd, inode)
        try:
            pg.abort()
        except RuntimeError:
            pass


def stream_sockets() -> set[tuple[int, str]]:
    """This process's socket descriptors, as ``(fd, inode)`` (empty where ``/proc`` is not readable)."""
    found = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile (or the listing's own descriptor)
            continue
        if target.startswith("socket:"):
            found.add((int(name), target))
    return found


def shut_down(fd: int, inode: str) -> None:
    """Shut down the connected stream socket ``fd`` if it is still ``inode`` (never raises, never closes it)."""
    try:
        if os.readlink(f"/proc/self/fd/{fd}") != inode:
            return  # closed, and the number reused: not the group's any more
        sock = socket.socket(fileno=fd)
    except OSError:
        return
    try:
        if sock.type == socket.SOCK_STREAM and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # not connected (any more)
        pass
    finally:
        sock.detach()  # the descriptor stays gloo's


def nccl_error_handling() -> None:
    """A failed NCCL collective raises in ``wait()`` instead of killing the process.

    torchelastic starts workers with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``:
    NCCL's watchdog then tears a process down when a collective fails or
    times out, and every survivor of a failure would die with it. The engine
    handles the error itself (it regroups), so it asks for a blocking wait and
    no asynchronous error handling (overriding torchelastic's default). Must
    run before the first NCCL group is made (torch reads the variables then).
    """
    os.environ["TORCH_NCCL_BLOCKING_WAIT"] = "1"
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"


class NcclTransport(CollectiveTransport):
    """NCCL groups on this rank's GPU, aborted when dropped (untested here: no GPU was available).

    Raises:
        ConfigError: No CUDA device or no NCCL in this torch build.
    """

    name = "nccl"

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda" or not torch.cuda.is_available() or not dist.is_nccl_available():
            raise ConfigError(f"the NCCL transport needs a CUDA device and a torch build with NCCL (got {device})")
        nccl_error_handling()
        super().__init__(device)

    def new_group(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)

    def abort(self, pg: dist.ProcessGroup) -> None:
        """Abort the communicators: this rank's pending NCCL operations fail (the peers' at their timeout)."""
        try:
            pg.abort()
        except RuntimeError:
            pass


def transport_for(device: torch.device) -> CollectiveTransport:
    """gloo for a CPU device, NCCL for a CUDA one.

    Raises:
        ConfigError: A CUDA device without NCCL.
    """
    return NcclTransport(device) if device.type == "cuda" else GlooTransport(device)


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc``, raised inside a collective of the model, says a peer is gone (not a bug of the model).

    gloo raises a plain ``RuntimeError`` naming its transport (``Connection
    closed by peer``, ``Connection reset by peer``, a timeout); NCCL raises a
    ``DistBackendError``. Anything else is the model's own error and is raised as is.
    """
    if isinstance(exc, getattr(dist, "DistStoreError", ())):
        return False  # the meeting store, not a peer (an etcd blip while a group connects lazily)
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        marker in text for marker in ("gloo/transport", "Connection closed by peer", "Connection reset by peer",
                                      "Broken pipe", "NCCL communicator was aborted"))
