"""megatron-core ``parallel_state`` groups for the strategy, rebuilt when the world changes.

megatron-core is optional: without it only TP = PP = 1 is possible and the
data-parallel group is the whole world. On CPU everything runs on gloo.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import structlog
import torch
import torch.distributed as dist

from unicron_elastic.api import ConfigError
from unicron_elastic.store.keys import MeetingKeys as K
from unicron_elastic.strategy.model_groups import check_groups, rebind_groups, release_groups
from unicron_elastic.strategy.replicas import ModelParallel

log = structlog.get_logger(__name__)
LAZY_GLOO_ENV = "TORCH_GLOO_LAZY_INIT"  # torch reads it when a gloo group is made


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


@contextmanager
def _lazy_gloo() -> Iterator[None]:
    """Gloo groups made inside connect on first use (``TORCH_GLOO_LAZY_INIT``), unless the user chose.

    megatron-core makes a dozen groups per world, most never used on CPU; made
    lazily, rebuilding the world after a failure takes a quarter of the time
    (0.06 s instead of 0.24 s for 3 ranks here).
    """
    if LAZY_GLOO_ENV in os.environ:
        yield
        return
    os.environ[LAZY_GLOO_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(LAZY_GLOO_ENV, None)


def build_world(store: dist.Store, generation: int, rank: int, world_size: int, tensor_parallel: int = 1,
                pipeline_parallel: int = 1, timeout: timedelta = timedelta(seconds=60), backend: str = "gloo") -> None:
    """(Re)build the default process group and megatron-core's groups for this world.

    Every member calls this with the same ``generation``; the old groups are
    destroyed first (a dead peer does not block that: nothing is pending on
    them). Ranks are numbered replica-major (megatron-core's ``order="tp-pp-dp"``):
    ``rank = replica * TP * PP + stage * TP + tensor_rank``, the layout of
    :class:`~unicron_elastic.strategy.replicas.ModelParallel`.

    Raises:
        ConfigError: See :func:`check_sizes`.
    """
    check_sizes(world_size, tensor_parallel, pipeline_parallel)
    started = time.monotonic()
    destroy_world()
    # the world connects now: a peer that dies later fails its collectives at once (e.g. Lightning's on it)
    dist.init_process_group(backend, store=dist.PrefixStore(K.world(generation), store),
                            rank=rank, world_size=world_size, timeout=timeout)
    if megatron_available():
        from megatron.core import parallel_state

        with _lazy_gloo():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel,
                                                     pipeline_model_parallel_size=pipeline_parallel,
                                                     order="tp-pp-dp")
    log.info("world_built", generation=generation, rank=rank, world_size=world_size,
             tp=tensor_parallel, pp=pipeline_parallel, seconds=round(time.monotonic() - started, 3))


def rebuild_world(store: dist.Store, generation: int, layout: ModelParallel, members: list[int], rank: int,
                  timeout: timedelta = timedelta(seconds=60), backend: str = "gloo",
                  module: torch.nn.Module | None = None) -> tuple[int, int]:
    """The world of the replicas ``members`` (:func:`build_world`), and ``module``'s layers pointed at it.

    Args:
        store: The meeting store.
        generation: The generation of the group being formed.
        layout: The model's tensor x pipeline parallelism.
        members: The data-parallel members (replicas).
        rank: This launch rank.
        timeout: The world's collective timeout.
        backend: ``gloo`` or ``nccl``.
        module: The model, if built: every group its megatron-core modules hold becomes the new world's
            group of the same role (:mod:`~unicron_elastic.strategy.model_groups`).

    Returns:
        This rank's rank and the size of the new world.

    Raises:
        RuntimeError: A member is gone while the world forms.
        ConfigError: See :func:`check_sizes`; or the model holds a group that is not megatron-core's.
    """
    index, size = layout.world_rank(members, rank), len(members) * layout.size
    if module is not None:
        release_groups(module)  # (each group's role is read from the world about to be destroyed)
    build_world(store, generation, index, size, layout.tensor, layout.pipeline, timeout, backend)
    if module is not None:
        rebind_groups(module)
        check_groups(module)
    return index, size


def drop_world(module: torch.nn.Module | None = None) -> None:
    """Destroy the world now so that peers blocked in it with this rank fail at once.

    The model's references to the world's groups are dropped first
    (:func:`~unicron_elastic.strategy.model_groups.release_groups`: a group's
    connections close only when the object goes) and a collection frees what a
    traceback may still hold.
    """
    collect = module is not None and release_groups(module)
    destroy_world()
    if collect:
        gc.collect()


def destroy_world() -> None:
    """Destroy megatron-core's groups and the default process group, if any."""
    if megatron_available():
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl":  # pending NCCL work would hold the destroy: abort it first (untested: no GPU)
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        try:
            if abort is not None:
                abort()
        except RuntimeError as exc:
            log.warning("nccl_abort_failed", error=str(exc)[:200])
    if dist.is_initialized():
        dist.destroy_process_group()
