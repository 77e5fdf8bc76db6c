"""This rank's random streams: megatron-core's tracker, each micro-batch's streams, and those a joiner continues.

:class:`RandomStreams` applies :mod:`~unicron_elastic.strategy.lightning.rng`
for one rank: it seeds megatron-core's RNG tracker once as Megatron-LM does,
runs each micro-batch under the streams of its own seed, and carries torch's,
numpy's, Python's and the tracker's streams to a rank that joins.
"""

from __future__ import annotations

import random
import sys
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch

from unicron_elastic.strategy.lightning.rng import megatron_tracker, micro_batch_rng, micro_batch_seed, seed_tracker

__all__ = ["RandomStreams"]


class RandomStreams:
    """The random streams of one rank.

    Args:
        seed: The strategy's seed.

    Attributes:
        tracker: megatron-core's RNG tracker once seeded (None: none that can run here).
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.tracker: Any = None
        self._held: dict[str, Any] | None = None

    def seed_tracker(self, device: torch.device, stage: int, tensor_rank: int) -> None:
        """(Once, with megatron-core's layers) seed megatron-core's RNG tracker as Megatron-LM does.

        Megatron-LM's ``_set_random_seed``: the seed plus 100 x the pipeline
        stage, then ``model_parallel_cuda_manual_seed``
        (:func:`~unicron_elastic.strategy.lightning.rng.seed_tracker`). Each
        micro-batch then reseeds it from its own seed (:meth:`micro_batch`);
        this seeding serves what runs outside micro-batches (weight
        initialisation on a GPU, validation).

        Args:
            device: The strategy's root device.
            stage: This rank's pipeline stage.
            tensor_rank: This rank's tensor-parallel rank.
        """
        if self.tracker is not None or "megatron.core" not in sys.modules:
            return
        tracker = megatron_tracker(device)
        if tracker is None:
            return
        seed = self.seed + 100 * stage
        if device.type == "cuda":
            torch.cuda.manual_seed(seed)
        seed_tracker(tracker, seed, tensor_rank)
        self.tracker = tracker

    def micro_batch(self, step: int, micro_batch: int, stage: int | None, device: torch.device,
                    tensor_rank: int) -> AbstractContextManager[None]:
        """The random streams of one micro-batch (:mod:`~unicron_elastic.strategy.lightning.rng`).

        Args:
            step: The micro-batch's step.
            micro_batch: Its index in the step.
            stage: With a pipeline, this rank's stage (each stage a stream); else None.
            device: The strategy's root device.
            tensor_rank: This rank's tensor-parallel rank.

        Returns:
            A context inside which the generators draw from the micro-batch's seed.
        """
        seed = micro_batch_seed(self.seed, step, micro_batch, stage)
        return micro_batch_rng(seed, device, self.tracker, tensor_rank)

    def capture(self) -> dict[str, Any]:
        """The streams a joiner continues: torch's, numpy's, Python's and megatron-core's tracker's (if any)."""
        rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
        if self.tracker is not None:
            # The tracker's streams are this shard's tensor rank's.
            rng["megatron"] = {name: state.clone() for name, state in self.tracker.get_states().items()}
        return rng

    def hold(self, rng: dict[str, Any]) -> None:
        """Keep a replica's streams (:meth:`capture`) until this joiner's first step (:meth:`restore`)."""
        self._held = rng

    def restore(self) -> None:
        """(A joiner, at its first step) continue the replica's streams held by :meth:`hold`; none held: nothing."""
        if self._held is None:
            return
        rng = self._held
        torch.set_rng_state(rng["torch"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
        if self.tracker is not None and rng.get("megatron"):
            self.tracker.set_states(dict(rng["megatron"]))
        self._held = None
