"""How the elastic engine makes and drops its process groups: gloo on CPU, NCCL on GPU.

The engine (:class:`~unicron_elastic.strategy.engine.elastic_dp.ElasticDataParallel`)
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
  key gone (:mod:`~unicron_elastic.strategy.engine.group_watch`: the agent deleted it, or
  the node's lease expired) and aborts its communicators (:meth:`interrupt`),
  else at its collective ``timeout``; as an error rather than a killed
  process (:func:`nccl_error_handling`: torch's watchdog aborts the
  communicators and the process lives on; no blocking wait, so the host runs
  ahead of the GPU and megatron-core's collectives stay asynchronous). The
  engine waits for a result it reads with :meth:`NcclTransport.wait`, which
  raises when the work failed or its group was aborted. The state a replica sends is
  staged on the GPU. **Untested**: no GPU was available to this project's sessions.
"""

from __future__ import annotations

import os
import socket
import struct
from abc import ABC, abstractmethod
from datetime import timedelta

import structlog
import torch
import torch.distributed as dist
from typing_extensions import override

from unicron_elastic.api import ConfigError
from unicron_elastic.strategy.engine.bootstrap import ForwardingStore

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

    def wait(self, pg: dist.ProcessGroup, work: dist.Work) -> None:
        """Wait until ``work``, started on ``pg``, is done and its result can be read here.

        A failure's traceback keeps this frame: it must hold no reference to ``pg`` by then, since the group
        goes with the last reference :meth:`GenerationGroups.abort
        <unicron_elastic.strategy.engine.groups.GenerationGroups.abort>` drops (gloo's destructor closes its
        sockets; a group held elsewhere costs a full garbage collection there).

        Raises:
            RuntimeError: It failed (gloo's error), or ``pg`` was aborted meanwhile.
        """
        del pg  # (gloo's work raises its own error)
        work.wait()


class GlooTransport(CollectiveTransport):
    """gloo groups (CPU tensors; CUDA tensors are staged through host memory)."""

    name = "gloo"

    def __init__(self, device: torch.device = torch.device("cpu")) -> None:
        super().__init__(device)
        self._connections: dict[int, set[tuple[int, str]]] = {}  # id(pg) -> its sockets (fd, inode)
        self._stores: dict[int, dist.Store] = {}  # id(pg) -> its rendezvous view (gloo calls it while it lives)

    def new_group(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
        """A gloo group; the connections of its full mesh are noted as its own (:func:`group_connections`)."""
        rendezvous = RendezvousRecord(store)
        before = stream_sockets()
        pg = dist.ProcessGroupGloo(rendezvous, rank, size, timeout)
        opened = stream_sockets() - before
        own = group_connections(opened, rendezvous.published(), rendezvous.received())
        if size > 1 and not own:
            log.warning("gloo_connections_not_found", opened=len(opened), size=size,
                        reason="no socket opened while the group formed names an address its members published: "
                               "an interrupt cannot fail its operations in flight (they wait for the timeout)")
        self._connections[id(pg)] = own
        self._stores[id(pg)] = rendezvous
        return pg

    def abort(self, pg: dist.ProcessGroup) -> None:
        """Shut the group's connections down (:meth:`interrupt`) and forget them; the engine releases the group."""
        self.interrupt(pg)
        self._connections.pop(id(pg), None)
        self._stores.pop(id(pg), None)

    def interrupt(self, pg: dist.ProcessGroup) -> None:
        """Shut down the group's connections: its operations in flight fail here and at every peer.

        ``ProcessGroupGloo.abort()`` closes nothing (torch 2.13), and the
        group's destructor waits for an operation in flight, which with a
        frozen peer lasts until the group's timeout. A connection shut down
        makes gloo fail that operation at once ("Connection closed by peer"),
        here and at the peers, as a reset would. Only the group's own
        connected sockets are touched (:func:`group_connections`: noted when
        it formed, and only while the descriptor still names the same socket);
        a socket another thread opened meanwhile (an etcd reconnect, a
        snapshot upload) is not, nor is the group's listening socket (gloo's
        listener aborts the process on an error).
        """
        for fd, inode in self._connections.get(id(pg), ()):
            shut_down(fd, inode)
        try:
            pg.abort()
        except RuntimeError:
            pass


class RendezvousRecord(ForwardingStore):
    """The store a gloo group forms in, noting the values its members publish there (their addresses).

    gloo's full mesh is built by each rank publishing its listening address
    in the store and reading the others'. Every operation goes to ``store``
    as it is; the values this rank wrote and the ones it read under other keys
    are kept, so the group's connections can be told from any other socket
    (:func:`group_connections`).
    """

    def __init__(self, store: dist.Store) -> None:
        super().__init__(store)
        self._set: dict[str, bytes] = {}
        self._got: dict[str, bytes] = {}

    def published(self) -> list[bytes]:
        """The values this rank wrote (its own address)."""
        return list(self._set.values())

    def received(self) -> list[bytes]:
        """The values it read under keys it did not write (its peers' addresses)."""
        return [value for key, value in self._got.items() if key not in self._set]

    @override
    def set(self, key: str, value: str | bytes) -> None:  # noqa: D102 - c10d semantics
        self._set[key] = value.encode() if isinstance(value, str) else bytes(value)
        self._store.set(key, value)

    @override
    def get(self, key: str) -> bytes:  # noqa: D102 - c10d semantics
        value = self._store.get(key)
        self._got[key] = bytes(value)
        return value


def group_connections(opened: set[tuple[int, str]], published: list[bytes],
                      received: list[bytes]) -> set[tuple[int, str]]:
    """Those of the sockets ``opened`` while a gloo group formed that are the group's own connections.

    A connection of the group's full mesh either was accepted by this rank's
    listener (its local address is the one this rank ``published``) or
    connects to a peer's listener (its remote address is one this rank
    ``received`` from a peer). gloo publishes each address as a ``sockaddr``
    (family, port, address), so an endpoint counts when its ``sockaddr`` bytes
    appear in those values. Anything else opened meanwhile, by another thread
    of the process, is not the group's.
    """
    own = set()
    for fd, inode in opened:
        ends = _endpoints(fd, inode)
        if ends is None:
            continue
        local, remote = ends
        if any(_names(value, local) for value in published) or any(_names(value, remote) for value in received):
            own.add((fd, inode))
    return own


def _endpoints(fd: int, inode: str) -> tuple[tuple[int, str, int], tuple[int, str, int]] | None:
    """``((family, host, port) local, (family, host, port) remote)`` of a connected stream socket, or None."""
    try:
        if os.readlink(f"/proc/self/fd/{fd}") != inode:
            return None
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        local, remote = sock.getsockname(), sock.getpeername()
        return (sock.family, local[0], local[1]), (sock.family, remote[0], remote[1])
    except OSError:  # not connected (a listener)
        return None
    finally:
        sock.detach()  # the descriptor is not ours


def _names(value: bytes, endpoint: tuple[int, str, int]) -> bool:
    """Whether ``value`` holds ``endpoint`` as a ``sockaddr_in``/``sockaddr_in6`` (a v4-mapped IPv6 address
    matches its IPv4 form too)."""
    family, host, port = endpoint
    forms = [(family, host)]
    if family == socket.AF_INET6 and host.startswith("::ffff:") and "." in host:
        forms.append((socket.AF_INET, host[len("::ffff:"):]))
    for form_family, form_host in forms:
        head = struct.pack("=H", form_family) + struct.pack("!H", port)
        address = socket.inet_pton(form_family, form_host.split("%", 1)[0])
        offset = 0 if form_family == socket.AF_INET else 4  # (sockaddr_in6: a flow label before the address)
        at = value.find(head)
        while at >= 0:
            start = at + len(head) + offset
            if value[start:start + len(address)] == address:
                return True
            at = value.find(head, at + 1)
    return False


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


#: torch's ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` mode ``CleanUpOnly`` (ProcessGroupNCCL.hpp's ``ErrorHandlingMode``).
NCCL_CLEAN_UP_ONLY = "2"


def nccl_error_handling() -> None:
    """NCCL's failures reach the engine as errors, without a host-blocking wait and without killing the process.

    torchelastic starts workers with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``
    (``TearDown``): torch's watchdog then kills the process when a collective
    fails or times out, and every survivor of a failure would die with it.
    Mode 2 (``CleanUpOnly``) has the watchdog abort the communicators of that
    collective and the process lives on; work on them then fails with a
    ``DistBackendError``, which the engine takes for a lost peer (it
    regroups). ``TORCH_NCCL_BLOCKING_WAIT`` is removed: with it every
    ``wait()`` holds the host until the GPU is done (megatron-core's
    tensor-parallel collectives inside each layer included) and torch starts
    no watchdog; without it ``wait()`` orders the streams only, and the engine
    waits on the host only for what it reads (:meth:`NcclTransport.wait`: the
    buckets at the step's end, its commit). Must run before the first NCCL
    group is made (torch reads the variables then).
    """
    blocking = os.environ.pop("TORCH_NCCL_BLOCKING_WAIT", None)
    if blocking not in (None, "", "0"):
        log.warning("nccl_blocking_wait_unset", was=blocking,
                    reason="every wait() would hold the host until the GPU is done and torch would start no "
                           "watchdog; the engine waits on the host only for the results it reads")
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = NCCL_CLEAN_UP_ONLY


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
        self._aborted: set[int] = set()  # id() of the groups aborted or interrupted (while their work may run)

    @override
    def wait(self, pg: dist.ProcessGroup, work: dist.Work) -> None:
        """Order the stream after ``work``, wait on the host until the stream is done, and refuse the result of a
        failed work or of an aborted group (an aborted communicator's kernels end without an error of their own).

        Raises:
            RuntimeError: The work failed or ``pg`` was aborted (named as NCCL names it, a lost peer).
        """
        key = id(pg)
        # torch's watchdog sets the group's error when a collective failed or timed out (ErrorType, torch >= 2.6)
        get_error = getattr(pg, "get_error", None)
        del pg  # (no reference to the group in a failure's traceback: see CollectiveTransport.wait)
        try:
            work.wait()
            torch.cuda.current_stream(self.device).synchronize()
            kind = get_error() if get_error is not None else None
        finally:
            del get_error
        if key in self._aborted or (kind is not None and kind.name != "SUCCESS"):  # (aborted while it waited)
            raise RuntimeError(f"NCCL communicator was aborted: a collective on it failed ({kind})")

    def new_group(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, size, options)
        self._aborted.discard(id(pg))  # (an id reused by a new group)
        return pg

    def abort(self, pg: dist.ProcessGroup) -> None:
        """Abort the communicators: this rank's pending NCCL operations fail (the peers' at their timeout)."""
        self._aborted.add(id(pg))
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
