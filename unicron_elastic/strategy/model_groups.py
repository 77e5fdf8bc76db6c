"""The process groups a model's megatron-core modules hold, kept on the current world.

megatron-core's modules keep the groups they were built with: each parallel
layer its ``tp_group``, a ``GPTModel`` or a ``TransformerBlock`` its
``pg_collection`` (a ``ProcessGroupCollection``: TP, PP, DP, CP, the embedding
groups...) and copies of some of them (``tp_group``, ``pp_group``,
``embd_group``...). When the strategy rebuilds the world after a membership
change, megatron-core's ``parallel_state`` gets new groups and the old ones are
destroyed, so every group a module holds must be replaced by the new world's
group of the same *role* (the field of ``ProcessGroupCollection`` it is):

* :func:`release_groups`, before the old world is destroyed, replaces each held
  group by a :class:`ReleasedGroup` naming its role (gloo closes a group's
  connections only when the last reference to it goes, so a held group would
  keep a peer blocked on this rank waiting for the collective timeout);
* :func:`rebind_groups`, once the new world exists, puts the new world's group
  of that role in its place.

A group that is not one of ``parallel_state``'s (one the module made itself)
cannot be rebuilt: :func:`check_groups` refuses it at ``fit``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist

from unicron_elastic.api import ConfigError


@dataclass(frozen=True)
class ReleasedGroup:
    """Stands where a module held a group of the world being rebuilt.

    Attributes:
        role: The ``ProcessGroupCollection`` field the group was (``"tp"``, ``"pp"``, ``"embd"``...).
    """

    role: str


def _collection_type() -> type | None:
    try:
        from megatron.core.process_groups_config import ProcessGroupCollection
    except ImportError:
        return None
    return ProcessGroupCollection


def current_groups() -> dict[str, dist.ProcessGroup]:
    """megatron-core's groups of the current world by role; empty without megatron-core or its groups."""
    collection = _collection_type()
    if collection is None:
        return {}
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return {}
    groups = collection.use_mpu_process_groups()
    return {f.name: getattr(groups, f.name) for f in fields(groups)
            if isinstance(getattr(groups, f.name), dist.ProcessGroup)}


def _holders(module: torch.nn.Module) -> Iterator[tuple[str, Any, str, Any]]:
    """``(where, owner, attribute, value)`` of every group (or released group) ``module`` holds.

    The owners are ``module``'s submodules (their instance attributes) and the
    ``ProcessGroupCollection`` objects they hold, each visited once.
    """
    collection = _collection_type()
    seen: set[int] = set()
    for path, sub in module.named_modules():
        for attribute, value in list(vars(sub).items()):
            if isinstance(value, (dist.ProcessGroup, ReleasedGroup)):
                yield f"{path or '<model>'}.{attribute}", sub, attribute, value
            elif collection is not None and isinstance(value, collection) and id(value) not in seen:
                seen.add(id(value))
                for f in fields(value):
                    held = getattr(value, f.name)
                    if isinstance(held, (dist.ProcessGroup, ReleasedGroup)):
                        yield f"{path or '<model>'}.{attribute}.{f.name}", value, f.name, held


def _roles() -> dict[int, str]:
    """The role of each of the current world's groups, by the group's identity."""
    roles: dict[int, str] = {}
    for role, group in current_groups().items():
        roles.setdefault(id(group), role)
    return roles


def check_groups(module: torch.nn.Module) -> None:
    """Every group ``module`` holds is one of the current world's megatron-core groups.

    Raises:
        ConfigError: A module holds a group the strategy cannot rebuild after a
            membership change (one it made itself), or one of an older world.
    """
    roles = _roles()
    for where, _, _, value in _holders(module):
        if isinstance(value, ReleasedGroup) or id(value) not in roles:
            raise ConfigError(f"{where} holds a process group that is not one of megatron-core's parallel_state "
                              "groups of the current world: unicron_megatron rebuilds the world when the members "
                              "change and can only give a module parallel_state's groups again (build the model "
                              "from parallel_state's groups, e.g. ProcessGroupCollection.use_mpu_process_groups())")


def release_groups(module: torch.nn.Module) -> int:
    """Replace every group ``module`` holds by a :class:`ReleasedGroup` of its role (before the world goes).

    A group that is not one of the current world's is left where it is (a
    failure is being handled: nothing is raised here); :func:`check_groups`
    refuses it once the new world is bound.

    Returns:
        How many were released.
    """
    roles = _roles()
    released = 0
    for _, owner, attribute, value in _holders(module):
        if not isinstance(value, ReleasedGroup) and id(value) in roles:
            setattr(owner, attribute, ReleasedGroup(roles[id(value)]))
            released += 1
    return released


def rebind_groups(module: torch.nn.Module) -> int:
    """Give every released group of ``module`` the current world's group of its role.

    Returns:
        How many were rebound.

    Raises:
        ConfigError: The current world has no group of a released role.
    """
    groups = current_groups()
    rebound = 0
    for where, owner, attribute, value in _holders(module):
        if not isinstance(value, ReleasedGroup):
            continue
        if value.role not in groups:
            raise ConfigError(f"{where}: the new world has no {value.role!r} group")
        setattr(owner, attribute, groups[value.role])
        rebound += 1
    return rebound
