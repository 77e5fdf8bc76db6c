"""A Lightning ``ClusterEnvironment`` for a world whose size changes while training runs.

Lightning derives the world size from ``devices x num_nodes`` and checks it
against the launcher's; an elastic job has neither fixed. :class:`UnicronEnvironment`
reads the launcher's variables (torchrun / ``unicron-run``: ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``)
once, and afterwards follows what the strategy tells it: after a failure or a
reconfiguration the survivors are renumbered ``0..n-1`` in the rebuilt world.
"""

from __future__ import annotations

import os

from lightning.fabric.plugins.environments import ClusterEnvironment
from typing_extensions import override

from unicron_elastic import _lightning_hook
from unicron_elastic.api import ConfigError
from unicron_elastic.env import MAX_WORLD, max_world


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None


class UnicronEnvironment(ClusterEnvironment):
    """The launcher's environment, with a rank and world size that may change.

    Raises:
        ConfigError: A launcher variable is not an integer.
    """

    def __init__(self) -> None:
        self._launch_rank = _env_int("RANK", 0)
        self._rank = self._launch_rank
        self._launch_world_size = self._world_size = _env_int("WORLD_SIZE", 1)
        self._local_rank = _env_int("LOCAL_RANK", 0)
        self._node_rank = _env_int("GROUP_RANK", _env_int("NODE_RANK", 0))

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return True

    @property
    @override
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    @override
    def main_port(self) -> int:
        return _env_int("MASTER_PORT", 0)

    @staticmethod
    @override
    def detect() -> bool:
        return "RANK" in os.environ and "WORLD_SIZE" in os.environ

    @property
    def launch_rank(self) -> int:
        """The rank the launcher gave this process: its identity in the data-parallel group."""
        return self._launch_rank

    @property
    def launch_world_size(self) -> int:
        """The world size the launcher started with."""
        return self._launch_world_size

    @property
    def max_world_size(self) -> int:
        """Ranks that may join the run: :data:`~unicron_elastic.env.MAX_WORLD`, else the launch world.

        Raises:
            ConfigError: The variable is not an integer, or below ``WORLD_SIZE``.
        """
        value = max_world(self._launch_world_size)
        if value < self._launch_world_size:
            raise ConfigError(f"{MAX_WORLD.name}={value} is below WORLD_SIZE={self._launch_world_size}")
        return value

    @override
    def world_size(self) -> int:
        return self._world_size

    @override
    def set_world_size(self, size: int) -> None:
        self._world_size = size

    @override
    def global_rank(self) -> int:
        return self._rank

    @override
    def set_global_rank(self, rank: int) -> None:
        self._rank = rank

    @override
    def local_rank(self) -> int:
        return self._local_rank

    @override
    def node_rank(self) -> int:
        return self._node_rank


# Importing this module first imported Lightning, whose import could not register the strategy (it needs
# UnicronEnvironment, defined only now): register it now.
_lightning_hook.install()
