"""What a step counts besides gradients: its loss sum, its count (tokens or micro-batches), the report's sums.

Megatron-LM's ``loss_func`` returns ``(loss_sum, num_tokens, report)``. With
per-token loss (``calculate_per_token_loss``) the gradients of a step are
divided by the number of tokens of the whole global batch, and the logged
``lm loss`` is the token-weighted mean over every micro-batch of every
data-parallel rank. Without it each micro-batch's loss is its own mean and the
step divides by the number of micro-batches.

These totals are a few elements after the gradients in each rank's flat
gradient sum (:class:`~unicron_elastic.strategy.engine.gradients.GradientBuffer`'s
``extras``). They are summed over the data-parallel group by the same
all-reduce as the gradients and, after a failure, moved and recomputed with
them, so each micro-batch enters them exactly once whoever computes it. With
tensor or pipeline parallelism the step's commit hands the last stage's totals
to every rank (a stage before the last computes no loss).

Layout: ``[count, loss_sum, report_1 numerator, report_1 denominator, ...]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from unicron_elastic.api import ConfigError


@dataclass(frozen=True)
class StepTotals:
    """A step's totals over its whole global batch.

    Attributes:
        count: Tokens (per-token loss) or micro-batches counted.
        loss_sum: The sum of the micro-batches' losses (summed token losses with per-token loss).
        report: Each report key's ``(numerator, denominator)`` sums.
    """

    count: float
    loss_sum: float
    report: dict[str, tuple[float, float]]

    @property
    def loss(self) -> float:
        """The step's loss: ``loss_sum / count`` (0 when nothing was counted: every token masked)."""
        return self.loss_sum / self.count if self.count else 0.0

    def reported(self) -> dict[str, float]:
        """Each report key's value over the step (numerator / denominator; 0 where the denominator is 0)."""
        return {key: (num / den if den else 0.0) for key, (num, den) in self.report.items()}


@dataclass(frozen=True)
class TotalsLayout:
    """Where each total sits in the extra elements.

    Attributes:
        report_keys: The keys of the ``report`` dict ``loss_func`` returns, in a fixed order (every rank the same).
    """

    report_keys: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        """Extra elements."""
        return 2 + 2 * len(self.report_keys)

    def encode(self, count: torch.Tensor | float, loss_sum: torch.Tensor,
               report: Mapping[str, torch.Tensor] | None) -> torch.Tensor:
        """One micro-batch's totals as a float64 tensor on the loss's device (no host synchronisation).

        A report value is Megatron-LM's ``[numerator, denominator]`` pair, or a
        scalar (counted as ``[value, 1]``).

        Raises:
            ConfigError: The report's keys are not :attr:`report_keys`, or a value is neither a scalar nor a pair.
        """
        report = dict(report or {})
        if set(report) != set(self.report_keys) and report:
            raise ConfigError(f"loss_func's report has keys {sorted(report)} but the strategy sums "
                              f"{sorted(self.report_keys)}: pass report_keys= to UnicronMegatronStrategy (every "
                              "micro-batch's report must have the same keys)")
        loss = loss_sum.detach().reshape(()).to(torch.float64)  # (a bf16 loss would round a token count)
        values = [torch.as_tensor(count, device=loss.device).reshape(()), loss]
        for key in self.report_keys:
            values.extend(self._pair(key, report.get(key), loss))
        return torch.stack([v.to(torch.float64) for v in values])

    @staticmethod
    def _pair(key: str, value: torch.Tensor | None, loss: torch.Tensor) -> list[torch.Tensor]:
        if value is None:  # (a 2-tuple loss_func: no report)
            return [loss.new_zeros(()), loss.new_zeros(())]
        value = torch.as_tensor(value, device=loss.device).detach().reshape(-1)
        if value.numel() == 1:
            return [value[0], loss.new_ones(())]
        if value.numel() == 2:
            return [value[0], value[1]]
        raise ConfigError(f"loss_func's report[{key!r}] has {value.numel()} elements: give a scalar or Megatron-LM's "
                          "[numerator, denominator] pair")

    def decode(self, values: torch.Tensor) -> StepTotals:
        """The totals in summed extra elements."""
        flat = [float(v) for v in values.reshape(-1).tolist()]
        report = {key: (flat[2 + 2 * i], flat[3 + 2 * i]) for i, key in enumerate(self.report_keys)}
        return StepTotals(flat[0], flat[1], report)
