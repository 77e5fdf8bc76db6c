"""The bytes a rank holds for training: every tensor storage its model, optimizer and gradient sums keep alive.

Megatron-LM states its distributed optimizer's memory in bytes per parameter
(docs/user-guide/features/dist_optimizer.md: ``8 + 8/d`` with float32
parameters and gradients, ``6 + 12/d`` with bfloat16 parameters and float32
gradients, at ``d`` data-parallel ranks). :func:`engine_bytes` counts the same
for the engine, so that the figure can be compared with that table and tested
against it: each storage once, however many views point into it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from unicron_elastic.strategy.engine.elastic_dp import ElasticDataParallel

__all__ = ["engine_bytes", "megatron_table", "storage_bytes"]


def storage_bytes(*roots: Any) -> int:
    """Bytes of every distinct tensor storage reachable from ``roots`` (tensors and their ``grad``/``main_grad``,
    modules, optimizers, dicts, lists, tuples), each storage once."""
    seen: dict[int, int] = {}

    def visit(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
            for attr in ("grad", "main_grad"):
                extra = getattr(value, attr, None)
                if isinstance(extra, torch.Tensor):
                    visit(extra)
        elif isinstance(value, torch.nn.Module):
            visit([*value.parameters(), *value.buffers()])
        elif isinstance(value, torch.optim.Optimizer):
            visit([value.state, value.param_groups])
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    for root in roots:
        visit(root)
    return sum(seen.values())


def engine_bytes(engine: ElasticDataParallel) -> int:
    """Bytes this rank's engine keeps alive between steps: its model and optimizer (the shares' main parameters
    and state) and the gradient sums' buffers (:meth:`~unicron_elastic.strategy.engine.gradients.GradientBuffer.kept`:
    the local sum, the reduce buffer, the whole reduced sum or this rank's share, and the wire buffer)."""
    gradients, shards = engine.gradients, engine.optimizer_shards
    return storage_bytes(engine.model, engine.optimizer, gradients.kept() if gradients is not None else [],
                         shards.main if shards is not None else [])


def megatron_table(param_dtype: torch.dtype, data_parallel: int) -> float:
    """Megatron-LM's bytes per parameter with its distributed optimizer at ``data_parallel`` ranks (float32
    gradients; Adam): ``8 + 8/d`` for float32 parameters, ``6 + 12/d`` for bfloat16 or float16 ones."""
    if param_dtype == torch.float32:
        return 8 + 8 / data_parallel
    return 6 + 12 / data_parallel
