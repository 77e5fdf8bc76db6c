"""Deterministic global batches and their micro-batches (paper section 6), pure.

A global batch of ``global_batch`` samples is ``B = global_batch / micro_batch``
micro-batches. :class:`GlobalBatchPlan` names the samples of micro-batch ``j``
of step ``s`` from the seed alone, so *any* rank can compute any micro-batch:
work can move when a rank dies or the data-parallel size changes, and no sample
is skipped or seen twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from unicron_elastic.api import ConfigError


@lru_cache(maxsize=8)
def _permutation(size: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(size)


@dataclass(frozen=True)
class GlobalBatchPlan:
    """Which samples make up each micro-batch of each step.

    Attributes:
        dataset_size: Samples in the dataset.
        global_batch: Samples per optimizer step (constant across reconfigurations).
        micro_batch: Samples per micro-batch.
        seed: Shuffling seed (each epoch is a fresh permutation).

    Raises:
        ConfigError: Sizes are not positive, or the global batch is not a
            multiple of the micro-batch, or larger than the dataset.
    """

    dataset_size: int
    global_batch: int
    micro_batch: int
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.dataset_size, self.global_batch, self.micro_batch) < 1:
            raise ConfigError("dataset_size, global_batch and micro_batch must be >= 1")
        if self.global_batch % self.micro_batch:
            raise ConfigError(f"global_batch {self.global_batch} is not a multiple of micro_batch {self.micro_batch}")
        if self.global_batch > self.dataset_size:
            raise ConfigError(f"global_batch {self.global_batch} exceeds the dataset ({self.dataset_size} samples)")

    @property
    def num_micro_batches(self) -> int:
        """B: micro-batches per global batch."""
        return self.global_batch // self.micro_batch

    @property
    def steps_per_epoch(self) -> int:
        """Full global batches per epoch (the remainder of an epoch is dropped)."""
        return self.dataset_size // self.global_batch

    def indices(self, step: int, micro_batch: int) -> list[int]:
        """Sample indices of micro-batch ``micro_batch`` of ``step``.

        Raises:
            ConfigError: ``micro_batch`` is not in ``0..B-1`` or ``step`` < 0.
        """
        if not 0 <= micro_batch < self.num_micro_batches or step < 0:
            raise ConfigError(f"no micro-batch {micro_batch} of step {step} (B={self.num_micro_batches})")
        epoch, within = divmod(step, self.steps_per_epoch)
        start = within * self.global_batch + micro_batch * self.micro_batch
        return _permutation(self.dataset_size, self.seed, epoch)[start : start + self.micro_batch].tolist()


def deal(num_micro_batches: int, members: list[int]) -> dict[int, list[int]]:
    """Deal micro-batches ``0..B-1`` round-robin over the data-parallel ``members``.

    Args:
        num_micro_batches: B.
        members: Ranks taking part, in order.

    Returns:
        ``rank -> micro-batch indices`` (every index exactly once).

    Raises:
        ConfigError: No members.
    """
    if not members:
        raise ConfigError("cannot deal micro-batches to an empty group")
    return {rank: list(range(i, num_micro_batches, len(members))) for i, rank in enumerate(members)}


def redistribute(assignment: dict[int, list[int]], dead: list[int]) -> dict[int, list[int]]:
    """Deal the dead ranks' micro-batches round-robin to the survivors (scenario 1).

    Returns:
        ``survivor -> extra micro-batch indices`` it must compute.

    Raises:
        ConfigError: Nobody survives.
    """
    survivors = [rank for rank in assignment if rank not in dead]
    if not survivors:
        raise ConfigError("every rank of the data-parallel group died")
    orphans = sorted(j for rank in dead for j in assignment.get(rank, []))
    extra: dict[int, list[int]] = {rank: [] for rank in survivors}
    for i, j in enumerate(orphans):
        extra[survivors[i % len(survivors)]].append(j)
    return extra
