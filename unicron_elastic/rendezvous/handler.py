"""The ``unicron`` rendezvous handler that torchrun loads through ``torchrun.handlers``."""

from __future__ import annotations

import structlog
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousInfo
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)

from unicron_elastic.rendezvous.backend import UnicronRendezvousBackend
from unicron_elastic.rendezvous.gate import JoinGate, JoinRequest, OpenGate
from unicron_elastic.rendezvous.options import BackendOptions, parse_options
from unicron_elastic.store.c10d import EtcdC10dStore
from unicron_elastic.store.client import StatusStore

log = structlog.get_logger(__name__)


class UnicronRendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous, gated by the coordinator's plan.

    Built by :func:`create_handler`; ``gate`` and ``task`` are set there.
    """

    gate: JoinGate = OpenGate()
    task: str = ""
    status_store: StatusStore | None = None

    def next_rendezvous(self) -> RendezvousInfo:
        """Wait for the plan to admit this node, then join the next round."""
        request = JoinRequest(
            run_id=self.get_run_id(),
            task=self.task,
            node=str(self._this_node),
            round=getattr(self._state_holder.state, "round", -1),
        )
        self.gate.admit(request)
        self._forget_agent_store()
        info = super().next_rendezvous()
        log.info(
            "rendezvous_joined",
            run_id=request.run_id,
            task=self.task,
            round=self._state_holder.state.round,
            rank=info.rank,
            nodes=info.world_size,
        )
        return info

    def current_round(self) -> int:
        """The rendezvous round this node last joined (-1 before the first)."""
        return int(getattr(self._state_holder.state, "round", -1))

    def _forget_agent_store(self) -> None:
        """Make the next round start a fresh agent TCPStore (pytorch/pytorch#135712).

        Workers assume "a new TCPStore for every retry" (torch's
        ``_create_c10d_store``) and add no per-round prefix, but torch 2.13's
        handler keeps the rank-0 node's TCPStore server across rounds; workers
        of round N+1 then read round N's gloo addresses and fail to connect.
        Dropping the cached server makes rank 0 of every round bind a new one
        and publish its port through the (per-round) etcd store.
        ``tests/test_rendezvous.py`` pins these private attributes.
        """
        self._shared_tcp_store_server = None
        self._bootstrap_store_info = None


def create_handler(params: RendezvousParameters, gate: JoinGate | None = None) -> UnicronRendezvousHandler:
    """Build the handler from torchrun's rendezvous parameters.

    Args:
        params: ``--rdzv-endpoint`` (etcd), ``--rdzv-id``, ``--nnodes`` and
            ``--rdzv-conf`` as torchrun parsed them.
        gate: Join gate; default admits everyone.

    Returns:
        The handler.

    Raises:
        ConfigError: A ``--rdzv-conf`` key or value is invalid (a ValueError).
    """
    options: BackendOptions = parse_options(params.endpoint, params.run_id, params.config)
    store = StatusStore(options.etcd)
    backend = UnicronRendezvousBackend(store, params.run_id)
    c10d = EtcdC10dStore(store, store.keys.c10d(params.run_id), timeout=options.store_timeout)
    timeout = RendezvousTimeout(
        options.join_timeout, options.last_call_timeout, options.close_timeout, options.heartbeat_timeout
    )
    handler = UnicronRendezvousHandler.from_backend(
        params.run_id,
        c10d,
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        timeout,
        keep_alive_interval=options.keep_alive_interval,
        keep_alive_max_attempt=options.keep_alive_max_attempt,
    )
    handler.gate = gate or OpenGate()
    handler.task = options.task
    handler.status_store = store
    return handler

