"""A micro-batch's random streams: seeded from (seed, step, micro-batch, stage), whoever computes it.

Dropout and the like then do not depend on which rank computes micro-batch
*j* (after a failure another rank recomputes it), and every tensor-parallel
rank of a stage draws the same numbers (like megatron-core's default
generator outside its model-parallel regions).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def micro_batch_seed(seed: int, step: int, micro_batch: int, stage: int | None = None) -> int:
    """The seed of micro-batch ``micro_batch`` of ``step``; with a pipeline, of its ``stage`` (each stage a stream)."""
    value = (seed * 1_000_003 + step) * 65_537 + micro_batch
    return value if stage is None else value * 131 + stage  # (one stage: the seeds of earlier versions)


@contextmanager
def micro_batch_rng(seed: int, device: torch.device) -> Iterator[None]:
    """Inside the block, the CPU generator and ``device``'s (a GPU) draw from ``seed``; outside, as before."""
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.default_generators[device.index].manual_seed(seed)  # this rank's GPU only
        yield
