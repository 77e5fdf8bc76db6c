"""The slots a step's last exchange carries besides gradients: next members, non-finite and overflow verdicts, stop.

They ride in the last gradient bucket (in the gradients' dtype), in the
commit with TP x PP > 1 (float64, followed by the replica's squared gradient
norm) or in the members' agreement (int64), and are summed like it, so no
extra collective runs per step: ``[count, members..., 0..., non-finite, overflow,
stop]``. Every value is a small integer, exact in any of those dtypes. Only the
primary offers members (the others send zeros); any rank's non-finite finding,
overflow or stop counts (non-finite: the number of ranks that found a NaN or
Inf in their own loss or gradient sums, without a loss scaler).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Slots besides the members: their count, the non-finite count, the overflow verdict, the stop request.
EXTRA_SLOTS = 4


@dataclass(frozen=True)
class Exchanged:
    """What summed slots said.

    Attributes:
        members: The members offered (empty: none).
        overflow: A shard's reduced sum was not finite (loss scaling).
        stop: A rank asked to stop after this step.
        non_finite: How many ranks found a NaN or Inf in their own loss or gradients (no loss scaler).
    """

    members: list[int]
    overflow: bool
    stop: bool
    non_finite: int = 0


@dataclass(frozen=True)
class ExchangeSlots:
    """The slots of a group whose replicas ``0..max_replicas-1`` may be members.

    Attributes:
        max_replicas: Replicas that may ever be members.
    """

    max_replicas: int

    @property
    def size(self) -> int:
        """Elements of the slots."""
        return self.max_replicas + EXTRA_SLOTS

    def encode(self, members: list[int] | tuple[int, ...] | None, dtype: torch.dtype, overflow: bool = False,
               stop: bool = False, non_finite: bool = False) -> torch.Tensor:
        """This rank's slots: the members it offers (None: zeros), its verdicts and its stop request."""
        slots = torch.zeros(self.size, dtype=dtype)
        if members is not None:
            slots[0] = len(members)
            slots[1 : 1 + len(members)] = torch.tensor(list(members), dtype=dtype)
        if non_finite:
            slots[-3] = 1
        if overflow:
            slots[-2] = 1
        if stop:
            slots[-1] = 1
        return slots

    @staticmethod
    def decode(slots: torch.Tensor) -> Exchanged:
        """What the summed ``slots`` of every rank say."""
        values = slots.tolist()
        return Exchanged([int(r) for r in values[1 : 1 + int(values[0])]], values[-2] > 0, values[-1] > 0,
                         int(values[-3]))
