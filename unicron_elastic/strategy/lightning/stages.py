"""A module's step in Megatron-LM's shape: ``forward_step(data_iterator, model) -> (output_tensor, loss_func)``.

Megatron-LM's ``pretrain_gpt.py`` gives its schedule a ``forward_step`` that
reads a micro-batch from ``data_iterator``, runs its stage of ``model`` and
returns the output with a ``loss_func``; the schedule first hands the stage its
input with ``model.set_input_tensor`` and, on the last stage, calls
``loss_func(output_tensor)``. A LightningModule that defines ``forward_step``
is driven the same way on every pipeline stage (:class:`MegatronStage`):

* ``data_iterator`` yields exactly this micro-batch (the collated batch, after
  Lightning's transfer hooks), on every stage and tensor rank;
* ``model`` is the stage's model: the outermost submodule that has
  ``set_input_tensor`` (e.g. the ``GPTModel``), or the LightningModule when it
  defines ``set_input_tensor`` itself;
* ``loss_func`` returns ``(loss_sum, num_tokens, report)`` or ``(loss,
  report)`` (the loss as it is), as ``pretrain_gpt.py``'s does
  (:class:`MicroBatchLoss`). Without per-token loss the micro-batch's loss is
  ``loss_sum / max(num_tokens, 1)`` (megatron-core's schedule clamps the count,
  so a micro-batch whose tokens are all masked contributes zero, not NaN) and
  the strategy divides the summed gradients by the number of micro-batches;
  with per-token loss (``calculate_per_token_loss``) the backward runs on
  ``loss_sum`` and the strategy divides by the step's token count.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from unicron_elastic.api import ConfigError

ForwardStep = Callable[[Any, Any], tuple[torch.Tensor, Callable[[torch.Tensor], Any]]]


@dataclass(frozen=True)
class MicroBatchLoss:
    """One micro-batch's loss as Megatron-LM's ``loss_func`` gives it.

    Attributes:
        loss_sum: The summed token losses (``(loss_sum, num_tokens, report)``), or the loss as it is.
        num_tokens: The micro-batch's token count (None: the loss is taken as it is).
        report: What ``loss_func`` reports (Megatron-LM: ``{"lm loss": [loss_sum, num_tokens]}``), or None.
    """

    loss_sum: torch.Tensor
    num_tokens: torch.Tensor | None = None
    report: Mapping[str, Any] | None = None

    @property
    def mean(self) -> torch.Tensor:
        """The micro-batch's own loss: ``loss_sum / max(num_tokens, 1)`` (or the loss as it is)."""
        if self.num_tokens is None:
            return self.loss_sum
        return self.loss_sum / torch.clamp(torch.as_tensor(self.num_tokens, device=self.loss_sum.device), min=1)

    def to_backward(self, per_token: bool) -> torch.Tensor:
        """What the backward runs on: ``loss_sum`` with per-token loss, else :attr:`mean`.

        Raises:
            ConfigError: Per-token loss, but ``loss_func`` gave no token count.
        """
        if not per_token:
            return self.mean
        if self.num_tokens is None:
            raise ConfigError("config.calculate_per_token_loss=True: loss_func must return (loss_sum, num_tokens, "
                              "report), as Megatron-LM's pretrain_gpt.py does")
        return self.loss_sum

    def count(self, per_token: bool) -> torch.Tensor | float:
        """What this micro-batch adds to the step's count: its tokens with per-token loss, else 1."""
        return self.num_tokens if per_token else 1.0

    def total(self, per_token: bool) -> torch.Tensor:
        """What this micro-batch adds to the step's loss sum: ``loss_sum`` with per-token loss, else :attr:`mean`."""
        return self.to_backward(per_token)

    def as_output(self) -> dict[str, Any]:
        """As a ``training_step`` returns it: ``"loss"`` (the mean, for any strategy) and the parts."""
        return {"loss": self.mean, "loss_sum": self.loss_sum, "num_tokens": self.num_tokens, "report": self.report}


def loss_of(outputs: Any) -> MicroBatchLoss:
    """The micro-batch's loss from what a Megatron-LM ``loss_func`` returned.

    Raises:
        ConfigError: Neither ``(loss_sum, num_tokens, report)`` nor ``(loss, report)`` with a tensor loss.
    """
    if isinstance(outputs, tuple) and len(outputs) == 3 and isinstance(outputs[0], torch.Tensor):
        loss_sum, num_tokens, report = outputs
        return MicroBatchLoss(loss_sum, num_tokens, report)
    if isinstance(outputs, tuple) and len(outputs) == 2 and isinstance(outputs[0], torch.Tensor):
        return MicroBatchLoss(outputs[0], None, outputs[1])
    raise ConfigError("loss_func must return (loss_sum, num_tokens, report) or (loss, report), as Megatron-LM's "
                      f"pretrain_gpt.py does; got {type(outputs).__name__}")


def micro_batch_loss(output: Any) -> MicroBatchLoss:
    """The micro-batch's loss in what ``training_step`` (or a last stage's ``pipeline_forward``) returned.

    A tensor is the loss as it is; a dict has ``"loss"`` and, from :func:`run_forward_step`, the parts of
    Megatron-LM's ``(loss_sum, num_tokens, report)``.

    Raises:
        ConfigError: Neither a tensor nor a dict with ``"loss"``.
    """
    if isinstance(output, MicroBatchLoss):
        return output
    if isinstance(output, torch.Tensor):
        return MicroBatchLoss(output)
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        if isinstance(output.get("loss_sum"), torch.Tensor):
            return MicroBatchLoss(output["loss_sum"], output.get("num_tokens"), output.get("report"))
        return MicroBatchLoss(output["loss"])
    raise ConfigError("training_step must return the loss (a tensor, or a dict with 'loss') under unicron_megatron")


def run_forward_step(forward_step: ForwardStep, batch: Any, model: Any) -> dict[str, Any]:
    """One micro-batch through ``forward_step`` where one stage is the whole model, for a ``training_step``.

    For a ``training_step`` that runs the module's ``forward_step`` (pipeline
    parallel size 1, or another strategy): returns ``{"loss": ..., "loss_sum":
    ..., "num_tokens": ..., "report": ...}`` (:meth:`MicroBatchLoss.as_output`),
    so any Lightning strategy trains on ``"loss"`` (the micro-batch's mean) and
    this one takes the loss as on a pipeline's last stage (per-token loss included).

    Raises:
        ConfigError: ``forward_step`` or its ``loss_func`` returned something else than Megatron-LM's shapes.
    """
    output, loss_func = _call(forward_step, batch, model)
    return loss_of(loss_func(output)).as_output()


def _call(forward_step: ForwardStep, batch: Any, model: Any) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
    result = forward_step(iter([batch]), model)
    if not (isinstance(result, tuple) and len(result) == 2 and callable(result[1])):
        raise ConfigError("forward_step(data_iterator, model) must return (output_tensor, loss_func), as "
                          "Megatron-LM's pretrain_gpt.py does")
    return result


def stage_model(module: torch.nn.Module) -> torch.nn.Module:
    """The model ``forward_step`` runs: the one whose ``set_input_tensor`` hands a stage its input.

    Raises:
        ConfigError: No submodule has ``set_input_tensor``, or several do at the outermost depth.
    """
    if callable(getattr(type(module), "set_input_tensor", None)):
        return module
    found: list[tuple[int, str, torch.nn.Module]] = []
    for name, sub in module.named_modules():
        if name and callable(getattr(sub, "set_input_tensor", None)):
            found.append((name.count("."), name, sub))
    if not found:
        raise ConfigError("forward_step needs a stage model with set_input_tensor (e.g. megatron-core's GPTModel) "
                          "among the LightningModule's submodules, or set_input_tensor on the LightningModule")
    depth = min(d for d, _, _ in found)
    outermost = [(name, sub) for d, name, sub in found if d == depth]
    if len(outermost) > 1:
        raise ConfigError(f"several submodules have set_input_tensor ({', '.join(n for n, _ in outermost)}): define "
                          "set_input_tensor on the LightningModule to say which gets a stage's input")
    return outermost[0][1]


class MegatronStage:
    """One micro-batch through this pipeline stage with the module's ``forward_step``.

    Args:
        module: The LightningModule (its ``forward_step``).
        last: This is the last stage (its output goes through ``loss_func``).

    Raises:
        ConfigError: See :func:`stage_model`.
    """

    def __init__(self, module: torch.nn.Module, last: bool) -> None:
        self.forward_step: ForwardStep = module.forward_step
        self.model = stage_model(module)
        self.last = last

    def __call__(self, batch: Any, input_tensor: torch.Tensor | None) -> torch.Tensor | MicroBatchLoss:
        """This stage's output (the activations for the next stage), or the micro-batch's loss on the last.

        Raises:
            ConfigError: ``forward_step`` or ``loss_func`` returned something else than Megatron-LM's shapes.
        """
        self.model.set_input_tensor(input_tensor)
        output, loss_func = _call(self.forward_step, batch, self.model)
        return loss_of(loss_func(output)) if self.last else output
