"""The world Lightning and megatron-core use, rebuilt over each generation's members: the engine's group listener.

:class:`StrategyWorld` is the
:class:`~unicron_elastic.strategy.engine.engine_options.GroupListener` the
strategy gives the elastic engine. The engine's
:class:`~unicron_elastic.strategy.engine.groups.GenerationGroups` calls it
right after it built the engine's groups of a generation, in the same
bootstrap store (which stops waiting for a member whose liveness key is
gone), and right before it aborts them. Without an engine (validate, test,
predict) :func:`build_world_alone` builds the first world the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from typing_extensions import override

from unicron_elastic.strategy.engine.engine_options import GroupListener
from unicron_elastic.strategy.engine.groups import GenerationGroups
from unicron_elastic.strategy.engine.replicas import ModelParallel
from unicron_elastic.strategy.engine.transport import transport_for
from unicron_elastic.strategy.lightning.environment import UnicronEnvironment
from unicron_elastic.strategy.lightning.parallel import drop_world, rebuild_world

__all__ = ["StrategyWorld", "build_world_alone", "set_rank_zero"]


def set_rank_zero(rank: int) -> None:
    """Tell Lightning's ``rank_zero_only`` utilities (Lightning's and Fabric's) this rank's rank in the world."""
    rank_zero_only.rank = fabric_rank_zero_only.rank = rank


class StrategyWorld(GroupListener):
    """The default process group and megatron-core's groups over the members of each generation.

    Args:
        env: The strategy's cluster environment: its global rank and world size follow the world.
        layout: The model's tensor x pipeline parallelism.
        timeout: The world's collective timeout.
        device: The strategy's root device (CUDA: an NCCL world, else gloo).
        module: Returns the LightningModule (None before the Trainer attached one): the groups its
            megatron-core modules hold are pointed at each new world.
    """

    def __init__(self, env: UnicronEnvironment, layout: ModelParallel, timeout: timedelta, device: torch.device,
                 module: Callable[[], torch.nn.Module | None]) -> None:
        self.env, self.layout, self.timeout, self.module = env, layout, timeout, module
        self.backend = "nccl" if device.type == "cuda" else "gloo"

    @override
    def on_configure(self, store: dist.Store, generation: int, members: list[int]) -> None:
        """Rebuild the world for the data-parallel members (replicas) ``members`` of ``generation``.

        The model's megatron-core layers are pointed at the new world's
        groups. Called inside the engine's regroup, which is a declared,
        bounded pause for the hang detector (the engine's ``pause``), and in
        its constructor for generation 0.

        Args:
            store: The generation's bootstrap store (it stops waiting for a member whose liveness key is gone).
            generation: The generation of the engine's groups just built.
            members: The data-parallel members (replicas).

        Raises:
            RuntimeError: A member is gone while the world forms
                (:class:`~unicron_elastic.strategy.engine.bootstrap.MemberGoneError`; the engine regroups).
            ConfigError: The model holds a group that is not megatron-core's.
        """
        index, size = rebuild_world(store, generation, self.layout, members, self.env.launch_rank, self.timeout,
                                    self.backend, self.module())
        self.env.set_global_rank(index)
        self.env.set_world_size(size)
        set_rank_zero(self.env.global_rank())

    @override
    def on_abort(self) -> None:
        """Destroy the world, so that peers blocked in it fail at once.

        With TP > 1 that is a collective of the model; otherwise a collective
        of Lightning's on the default group.
        """
        drop_world(self.module())


def build_world_alone(store: dist.Store, world: StrategyWorld, device: torch.device,
                      members: list[int]) -> GenerationGroups:
    """The first world without the elastic engine (validate, test, predict): generation 0 of ``members``.

    Args:
        store: The meeting store.
        world: The listener that builds it.
        device: The strategy's root device (it chooses the transport).
        members: The initial data-parallel members (replicas).

    Returns:
        The groups holding the world's bootstrap store, to be kept while the world lives (gloo calls it).

    Raises:
        RuntimeError: A member is gone while the world forms.
        LookupError: Its bootstrap keys are gone (a store outage).
    """
    groups = GenerationGroups(store, world.layout, world.env.launch_rank, transport_for(device), world.timeout, world,
                              data_parallel=False)
    groups.configure(0, members)
    return groups
