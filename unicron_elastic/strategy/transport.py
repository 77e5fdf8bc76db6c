"""How the elastic engine makes and drops its process groups: gloo on CPU, NCCL on GPU.

The engine (:class:`~unicron_elastic.strategy.elastic_dp.ElasticDataParallel`)
builds a fresh group for every generation (the data-parallel group of its
shard, and with tensor/pipeline parallelism one over the whole world for the
step's commit and the pipeline's point-to-point), and drops a broken one at
once so that peers blocked on it fail within milliseconds. A
:class:`CollectiveTransport` makes and aborts them for one backend:

* :class:`GlooTransport` (CPU, the default; tested): ``ProcessGroupGloo``;
  the engine releases a dropped one at once, whose destructor closes its
  sockets (torch 2.13's ``abort()`` does not).
* :class:`NcclTransport` (GPU): ``ProcessGroupNCCL`` whose communicators are
  aborted (``abort()``) when dropped, which fails this rank's pending
  operations. NCCL has no connection reset: a peer waiting on a dead or
  dropped rank fails only at its collective ``timeout``, as an error rather
  than a killed process (:func:`nccl_error_handling`: blocking wait, no
  asynchronous error handling), so on GPU a failure is found within the
  collective timeout, not within milliseconds. The state a replica sends is
  staged on the GPU. **Untested**: no GPU was available to this project's sessions.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from datetime import timedelta

import os

import torch
import torch.distributed as dist

from unicron_elastic.api import ConfigError


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


class GlooTransport(CollectiveTransport):
    """gloo groups (CPU tensors; CUDA tensors are staged through host memory)."""

    name = "gloo"

    def __init__(self, device: torch.device = torch.device("cpu")) -> None:
        super().__init__(device)

    def new_group(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
        return dist.ProcessGroupGloo(store, rank, size, timeout)

    def abort(self, pg: dist.ProcessGroup) -> None:
        """Abort; the sockets close when the engine releases the group (its destructor).

        ``ProcessGroupGloo.abort()`` does not close them (torch 2.13): a
        survivor whose pending operation is with *this* rank stays blocked
        until the group object is destroyed.
        """
        try:
            pg.abort()
        except RuntimeError:
            pass


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
