"""Where a task's workers meet: a store that survives the loss of any one node.

Survivors of a failure, joiners and each generation's gloo bootstrap meet in
a c10d store (:class:`~unicron_elastic.store.keys.MeetingKeys`). Under
``unicron-run`` with the ``unicron`` rendezvous the agent puts that store in
etcd (under :meth:`~unicron_elastic.store.keys.Keys.meeting`) and tells its
workers how to reach it in ``$UNICRON_MEETING`` (:data:`~unicron_elastic.env.MEETING`); it also keeps each worker's
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
from unicron_elastic.env import ETCD_PASSWORD, MEETING, etcd_password, meeting_text


def encode_meeting(config: EtcdConfig, prefix: str) -> str:
    """The value of :data:`~unicron_elastic.env.MEETING` for ``config`` and the store's key ``prefix`` (no password)."""
    fields = {k: v for k, v in asdict(config).items() if k != "password"}
    return json.dumps({"etcd": fields, "prefix": prefix})


def decode_meeting(text: str) -> tuple[EtcdConfig, str]:
    """Parse :data:`~unicron_elastic.env.MEETING`.

    Raises:
        ConfigError: The value is malformed (the message names the variable).
    """
    try:
        raw = json.loads(text)
        fields = dict(raw["etcd"])
        if fields.get("user") is not None:
            if (password := etcd_password()) is None:
                raise KeyError(ETCD_PASSWORD.name)
            fields["password"] = password
        prefix = raw["prefix"]
        if not isinstance(prefix, str) or not prefix.endswith("/"):
            raise ValueError(f"prefix {prefix!r} must be a string ending in '/'")
        return EtcdConfig(**fields), prefix
    except ConfigError:
        raise
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"{MEETING.name} is malformed: {exc}") from None


def connect_meeting_store(timeout: timedelta = timedelta(seconds=60)) -> dist.Store:
    """The workers' meeting store: etcd when the agent says so, else the launcher's TCPStore.

    Raises:
        ConfigError: :data:`~unicron_elastic.env.MEETING` is malformed, or neither it nor
            ``MASTER_ADDR``/``MASTER_PORT`` is set.
    """
    text = meeting_text()
    if text:
        from unicron_elastic.store.c10d import EtcdC10dStore
        from unicron_elastic.store.client import StatusStore

        config, prefix = decode_meeting(text)
        return EtcdC10dStore(StatusStore(config), prefix, timeout=timeout)
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise ConfigError(f"no meeting store: set by unicron-run ({MEETING.name}) or torchrun (MASTER_ADDR/MASTER_PORT)")
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
