"""A micro-batch's random streams: seeded from (seed, step, micro-batch, stage), whoever computes it.

Dropout and the like then do not depend on which rank computes micro-batch
*j* (after a failure another rank recomputes it), and every tensor-parallel
rank of a stage draws the same numbers from the default generators (like
megatron-core's default generator outside its model-parallel regions).

megatron-core's RNG tracker (``tensor_parallel.get_cuda_rng_tracker()``) holds
the streams its model-parallel regions draw from: ``model-parallel-rng``
(different on each tensor rank: dropout inside a tensor-parallel layer, and with
sequence parallelism the whole transformer block), ``data-parallel-rng`` and
``expert-parallel-rng``. Megatron-LM seeds it once with
``model_parallel_cuda_manual_seed``; here it is seeded the same way, from
the micro-batch's seed, when each micro-batch begins
(:func:`seed_tracker`), and restored when it ends, so those streams too depend
on the micro-batch and the tensor rank only. Its states travel with the rest
of a rank's state to a rank that rejoins.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

#: megatron-core's names of the tracker's streams, and its offsets from the seed (``model_parallel_cuda_manual_seed``).
DATA_PARALLEL, MODEL_PARALLEL, EXPERT_PARALLEL = "data-parallel-rng", "model-parallel-rng", "expert-parallel-rng"
_TENSOR_OFFSET, _EXPERT_OFFSET = 2718, 1024


def micro_batch_seed(seed: int, step: int, micro_batch: int, stage: int | None = None) -> int:
    """The seed of micro-batch ``micro_batch`` of ``step``; with a pipeline, of its ``stage`` (each stage a stream)."""
    value = (seed * 1_000_003 + step) * 65_537 + micro_batch
    return value if stage is None else value * 131 + stage  # (one stage: the seeds of earlier versions)


def megatron_tracker(device: torch.device) -> Any | None:
    """megatron-core's RNG tracker where it can run, else None (no megatron-core; or the stock CUDA tracker
    without a GPU: a CPU run that puts a tracker of its own in place, e.g. the examples', gets that one)."""
    try:
        from megatron.core.tensor_parallel import random as megatron_random
    except ImportError:
        return None
    tracker = megatron_random.get_cuda_rng_tracker()
    if device.type != "cuda" and type(tracker) is megatron_random.CudaRNGStatesTracker:
        return None
    return tracker


def seed_tracker(tracker: Any, seed: int, tensor_rank: int) -> None:
    """Seed megatron-core's tracker as ``model_parallel_cuda_manual_seed(seed)`` does (its interface only).

    ``data-parallel-rng`` gets ``seed``, ``model-parallel-rng`` ``seed + 2718 + tensor_rank`` and
    ``expert-parallel-rng`` ``seed + 1024 + tensor_rank`` (no expert parallelism: expert rank 0, the expert
    tensor rank is the tensor rank).
    """
    tracker.reset()
    tracker.add(DATA_PARALLEL, seed)
    tracker.add(MODEL_PARALLEL, seed + _TENSOR_OFFSET + tensor_rank)
    tracker.add(EXPERT_PARALLEL, seed + _EXPERT_OFFSET + tensor_rank)


@contextmanager
def micro_batch_rng(seed: int, device: torch.device, tracker: Any | None = None,
                    tensor_rank: int = 0) -> Iterator[None]:
    """Inside the block, the CPU generator, ``device``'s (a GPU) and megatron's tracker (if given) draw from
    ``seed``; outside, as before."""
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.default_generators[device.index].manual_seed(seed)  # this rank's GPU only
        if tracker is None:
            yield
            return
        states = tracker.get_states()
        seed_tracker(tracker, seed, tensor_rank)
        try:
            yield
        finally:
            tracker.set_states(states)
