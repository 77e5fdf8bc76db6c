"""Deterministic global batches and their micro-batches (paper section 6), pure.

A global batch of ``global_batch`` samples is ``B = global_batch / micro_batch``
micro-batches. :class:`GlobalBatchPlan` names the samples of micro-batch ``j``
of step ``s`` from the seed alone, so *any* rank can compute any micro-batch:
work can move when a rank dies or the data-parallel size changes, and no sample
is skipped or seen twice.

Each epoch's order is a seeded bijection of ``0..dataset_size-1``
(:class:`IndexPermutation`) computed per position, never materialised: a
rank's memory for the order does not grow with the dataset (a permutation
array of Llama 3's 1.95e9 samples would be 15.6 GB per rank and epoch). A
dataset that is shuffled already (Megatron-LM's ``GPTDataset`` shuffles its
own sample index) keeps its order with ``shuffle=False``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from unicron_elastic.api import ConfigError

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)  # splitmix64's finaliser


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser of each ``uint64`` (a bijection with full avalanche; wraps modulo 2**64)."""
    values = (values ^ (values >> np.uint64(30))) * _M1
    values = (values ^ (values >> np.uint64(27))) * _M2
    return values ^ (values >> np.uint64(31))


@dataclass(frozen=True)
class IndexPermutation:
    """A seeded permutation of ``0..size-1``, position by position, in memory constant in ``size``.

    A balanced Feistel network of :attr:`ROUNDS` rounds permutes the ``2 *
    half_bits``-bit integers (the smallest even width holding ``size - 1``);
    *cycle walking* applies it again to a value that falls outside
    ``0..size-1`` until one falls inside. Each step of the walk is the same
    bijection of the larger domain, so the values inside stay a bijection of
    ``0..size-1`` (Black and Rogaway, "Ciphers with arbitrary finite
    domains", 2002). The domain is below ``4 * size``: fewer than four rounds
    of the walk on average.

    Args:
        size: Elements permuted (>= 1).
        key: The seed words (the plan's seed and the epoch): each selects another permutation.

    Raises:
        ConfigError: ``size`` < 1 or above 2**62.
    """

    ROUNDS = 6

    size: int
    key: tuple[int, ...]
    half_bits: int = field(init=False)
    round_keys: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.size <= 2**62:
            raise ConfigError(f"cannot permute {self.size} elements (1 .. 2**62)")
        object.__setattr__(self, "half_bits", max(1, ((self.size - 1).bit_length() + 1) // 2))
        words = np.random.SeedSequence(list(self.key)).generate_state(self.ROUNDS, np.uint64)
        object.__setattr__(self, "round_keys", tuple(int(w) for w in words))

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """The elements at ``positions`` (each in ``0..size-1``) of the permuted order, as ``int64``."""
        values = np.asarray(positions, dtype=np.uint64)
        outside = np.ones(values.shape, dtype=bool)
        while outside.any():  # cycle walking: ends, since the network is a bijection of a finite domain
            values[outside] = self._network(values[outside])
            outside = values >= np.uint64(self.size)
        return values.astype(np.int64)

    def _network(self, values: np.ndarray) -> np.ndarray:
        """One pass of the Feistel network over ``2 * half_bits``-bit values."""
        bits = np.uint64(self.half_bits)
        mask = np.uint64((1 << self.half_bits) - 1)
        left, right = values >> bits, values & mask
        for word in self.round_keys:
            left, right = right, left ^ (_mix(right ^ np.uint64(word)) & mask)
        return (left << bits) | right


@lru_cache(maxsize=8)
def _permutation(size: int, seed: int, epoch: int) -> IndexPermutation:
    """The permutation of one epoch (a few hundred bytes: its round keys are derived once, not per call)."""
    return IndexPermutation(size, (seed, epoch))


@dataclass(frozen=True)
class GlobalBatchPlan:
    """Which samples make up each micro-batch of each step.

    Attributes:
        dataset_size: Samples in the dataset.
        global_batch: Samples per optimizer step (constant across reconfigurations).
        micro_batch: Samples per micro-batch.
        seed: Shuffling seed (each epoch is a fresh permutation).
        shuffle: Shuffle each epoch (False: the dataset's own order, every epoch; for a dataset that is
            shuffled already, as Megatron-LM's are).

    Raises:
        ConfigError: Sizes are not positive, or the global batch is not a
            multiple of the micro-batch, or larger than the dataset.
    """

    dataset_size: int
    global_batch: int
    micro_batch: int
    seed: int = 0
    shuffle: bool = True

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

    def order(self, epoch: int) -> IndexPermutation | None:
        """The permutation of ``epoch`` (None without shuffling)."""
        return _permutation(self.dataset_size, self.seed, epoch) if self.shuffle else None

    def indices(self, step: int, micro_batch: int) -> list[int]:
        """Sample indices of micro-batch ``micro_batch`` of ``step``.

        Raises:
            ConfigError: ``micro_batch`` is not in ``0..B-1`` or ``step`` < 0.
        """
        if not 0 <= micro_batch < self.num_micro_batches or step < 0:
            raise ConfigError(f"no micro-batch {micro_batch} of step {step} (B={self.num_micro_batches})")
        epoch, within = divmod(step, self.steps_per_epoch)
        start = within * self.global_batch + micro_batch * self.micro_batch
        positions = np.arange(start, start + self.micro_batch, dtype=np.int64)
        order = self.order(epoch)
        return (positions if order is None else order(positions)).tolist()


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


def dealt_after_losses(num_micro_batches: int, base: list[int], rounds: list[list[int]],
                       members: list[int]) -> dict[int, list[int]]:
    """Who computes which micro-batch of a step dealt over ``base``, the ranks lost in each of ``rounds``
    redistributed in turn (as a member that regrouped once per round does), for each of ``members``."""
    dealt = deal(num_micro_batches, list(base))
    for dead in rounds:
        moved = redistribute(dealt, dead)
        dealt = {r: dealt[r] + moved[r] for r in dealt if r not in dead}
    return {r: dealt.get(r, []) for r in members}
