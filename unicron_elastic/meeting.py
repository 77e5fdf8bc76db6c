"""Where a task's workers meet: a store that survives the loss of any one node.

Survivors of a failure, joiners and each generation's gloo bootstrap meet in
a c10d store (:class:`~unicron_elastic.store.keys.MeetingKeys`). Under
``unicron-run`` with the ``unicron`` rendezvous the agent puts that store in
etcd (under :meth:`~unicron_elastic.store.keys.Keys.meeting`) and tells its
workers how to reach it in :data:`MEETING_ENV`; it also keeps each worker's
liveness key there, attached to the node's lease. Without it (plain
``torchrun``), workers meet in the launcher's TCPStore, hosted by the agent of
the rank-0 node: losing that node is then not survived (docs/strategy.md).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from datetime import timedelta

import torch.distributed as dist

from unicron_elastic.api import ConfigError, EtcdConfig

#: JSON ``{"etcd": EtcdConfig fields without the password, "prefix": ...}`` set by the agent.
MEETING_ENV = "UNICRON_MEETING"
#: The etcd password, when there is one, travels in this variable (never in :data:`MEETING_ENV`).
PASSWORD_ENV = "UNICRON_ETCD_PASSWORD"
#: The highest rank + 1 a worker of this run may have: ``WORLD_SIZE`` plus the workers of the nodes
#: that may still grow the run (``--nnodes``' max); set by ``unicron-run``'s agent.
MAX_WORLD_ENV = "UNICRON_MAX_WORLD"


def encode_meeting(config: EtcdConfig, prefix: str) -> str:
    """The value of :data:`MEETING_ENV` for ``config`` and the store's key ``prefix`` (no password)."""
    fields = {k: v for k, v in asdict(config).items() if k != "password"}
    return json.dumps({"etcd": fields, "prefix": prefix})


def decode_meeting(text: str) -> tuple[EtcdConfig, str]:
    """Parse :data:`MEETING_ENV`.

    Raises:
        ConfigError: The value is malformed (the message names the variable).
    """
    try:
        raw = json.loads(text)
        fields = dict(raw["etcd"])
        if fields.get("user") is not None:
            fields["password"] = os.environ[PASSWORD_ENV]
        prefix = raw["prefix"]
        if not isinstance(prefix, str) or not prefix.endswith("/"):
            raise ValueError(f"prefix {prefix!r} must be a string ending in '/'")
        return EtcdConfig(**fields), prefix
    except ConfigError:
        raise
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"{MEETING_ENV} is malformed: {exc}") from None


def connect_meeting_store(timeout: timedelta = timedelta(seconds=60)) -> dist.Store:
    """The workers' meeting store: etcd when the agent says so, else the launcher's TCPStore.

    Raises:
        ConfigError: :data:`MEETING_ENV` is malformed, or neither it nor
            ``MASTER_ADDR``/``MASTER_PORT`` is set.
    """
    text = os.environ.get(MEETING_ENV)
    if text:
        from unicron_elastic.store.c10d import EtcdC10dStore
        from unicron_elastic.store.client import StatusStore

        config, prefix = decode_meeting(text)
        return EtcdC10dStore(StatusStore(config), prefix, timeout=timeout)
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise ConfigError(f"no meeting store: set by unicron-run ({MEETING_ENV}) or torchrun (MASTER_ADDR/MASTER_PORT)")
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
