"""megatron-core ``parallel_state`` groups for the strategy, rebuilt when the world changes.

megatron-core is optional: without it only TP = PP = 1 is possible and the
data-parallel group is the whole world. On CPU everything runs on gloo.
"""

from __future__ import annotations

from datetime import timedelta

import structlog
import torch.distributed as dist

from unicron_elastic.api import ConfigError

log = structlog.get_logger(__name__)


def megatron_available() -> bool:
    try:
        from megatron.core import parallel_state  # noqa: F401
    except ImportError:
        return False
    return True


def check_sizes(world_size: int, tensor_parallel: int, pipeline_parallel: int) -> int:
    """The data-parallel size of ``world_size`` ranks split into TP x PP model replicas.

    Raises:
        ConfigError: Sizes < 1, or the world is not a multiple of TP x PP, or
            TP/PP > 1 without megatron-core.
    """
    if tensor_parallel < 1 or pipeline_parallel < 1:
        raise ConfigError(f"tensor/pipeline parallel sizes must be >= 1 (got {tensor_parallel}, {pipeline_parallel})")
    model = tensor_parallel * pipeline_parallel
    if world_size % model:
        raise ConfigError(f"world size {world_size} is not a multiple of TP x PP = {model}")
    if model > 1 and not megatron_available():
        raise ConfigError("tensor/pipeline parallelism needs megatron-core (pip install megatron-core)")
    return world_size // model


def build_world(store: dist.Store, generation: int, rank: int, world_size: int, tensor_parallel: int = 1,
                pipeline_parallel: int = 1, timeout: timedelta = timedelta(seconds=60)) -> None:
    """(Re)build the default process group and megatron-core's groups for this world.

    Every member calls this with the same ``generation``; the old groups are
    destroyed first (a dead peer does not block that: nothing is pending on them).

    Raises:
        ConfigError: See :func:`check_sizes`.
    """
    check_sizes(world_size, tensor_parallel, pipeline_parallel)
    destroy_world()
    backend = "gloo"
    dist.init_process_group(backend, store=dist.PrefixStore(f"unicron-world/gen{generation}", store),
                            rank=rank, world_size=world_size, timeout=timeout)
    if megatron_available():
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel,
                                                 pipeline_model_parallel_size=pipeline_parallel)
    log.info("world_built", generation=generation, rank=rank, world_size=world_size,
             tp=tensor_parallel, pp=pipeline_parallel)


def destroy_world() -> None:
    """Destroy megatron-core's groups and the default process group, if any."""
    if megatron_available():
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
