"""Where a rank of the strategy meets the others: the meeting store, and where the in-memory snapshot lives.

Under ``unicron-run`` the meeting store is in etcd (it survives the loss of
any node) and snapshots go to the agents' snapshot servers; under plain
``torchrun`` both are torch's agent TCPStore on the rank-0 node; a
single-process run without a launcher meets in a ``HashStore``.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from unicron_elastic.api import ConfigError
from unicron_elastic.env import meeting_text
from unicron_elastic.meeting import connect_meeting_store
from unicron_elastic.strategy.lightning.environment import UnicronEnvironment
from unicron_elastic.strategy.snapshots.places import PeerServers

__all__ = ["connect_store", "snapshot_store"]


def connect_store(env: UnicronEnvironment) -> dist.Store:
    """The workers' meeting store: etcd under ``unicron-run`` (survives any node), else the launcher's store.

    Args:
        env: The strategy's cluster environment.

    Returns:
        The meeting store.

    Raises:
        ConfigError: The launcher does not share its store with workers.
    """
    if env.launch_world_size == 1 and "MASTER_PORT" not in os.environ:
        return dist.HashStore()
    if meeting_text():
        return connect_meeting_store()
    return _agent_store(env)


def _agent_store(env: UnicronEnvironment) -> dist.Store:
    """The launcher agent's TCPStore (on the rank-0 node): it outlives workers.

    Raises:
        ConfigError: The launcher does not share its store with workers.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "True") != "True":
        raise ConfigError("unicron_megatron needs the launcher's store (TORCHELASTIC_USE_AGENT_STORE=True, "
                          "unset TORCH_DISABLE_SHARE_RDZV_TCP_STORE): a store hosted by a worker dies with it")
    return dist.TCPStore(env.main_address, env.main_port, is_master=False, timeout=timedelta(seconds=60))


def snapshot_store(store: dist.Store | None, env: UnicronEnvironment) -> dist.Store | PeerServers | None:
    """Where the in-memory snapshot lives (bulk bytes never go to etcd).

    Under ``unicron-run``: the agents' snapshot servers, the next live
    node's for writing (GEMINI's placement), every reachable one for
    reading. Under plain ``torchrun``: torch's agent TCPStore on the
    rank-0 node (the workers' store).

    Args:
        store: The meeting store (:func:`connect_store`).
        env: The strategy's cluster environment (its node rank).

    Returns:
        The snapshot servers, or ``store``.
    """
    if isinstance(store, dist.HashStore) or not (meeting := meeting_text()):
        return store
    return PeerServers.from_meeting(meeting, env.node_rank())
