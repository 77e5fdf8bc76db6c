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
* ``loss_func`` returns ``(loss, num_tokens, report)`` (the micro-batch's loss
  is ``loss / num_tokens``, megatron-core's default) or ``(loss, report)`` (the
  loss as it is); the strategy sums the micro-batches' gradients and divides by
  their number, as megatron-core's schedule divides each loss by it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from unicron_elastic.api import ConfigError

ForwardStep = Callable[[Any, Any], tuple[torch.Tensor, Callable[[torch.Tensor], Any]]]


def loss_of(outputs: Any) -> torch.Tensor:
    """The micro-batch's loss from what a Megatron-LM ``loss_func`` returned.

    Raises:
        ConfigError: Neither ``(loss, num_tokens, report)`` nor ``(loss, report)`` with a tensor loss.
    """
    if isinstance(outputs, tuple) and len(outputs) == 3 and isinstance(outputs[0], torch.Tensor):
        loss, num_tokens, _ = outputs
        return loss / num_tokens
    if isinstance(outputs, tuple) and len(outputs) == 2 and isinstance(outputs[0], torch.Tensor):
        return outputs[0]
    raise ConfigError("loss_func must return (loss, num_tokens, report) or (loss, report), as Megatron-LM's "
                      f"pretrain_gpt.py does; got {type(outputs).__name__}")


def run_forward_step(forward_step: ForwardStep, batch: Any, model: Any) -> torch.Tensor:
    """One micro-batch through ``forward_step`` where one stage is the whole model: its loss.

    For a ``training_step`` that runs the module's ``forward_step`` (pipeline
    parallel size 1, or another strategy), so the loss is taken as the
    strategy takes it on a pipeline's last stage.

    Raises:
        ConfigError: ``forward_step`` or its ``loss_func`` returned something else than Megatron-LM's shapes.
    """
    output, loss_func = _call(forward_step, batch, model)
    return loss_of(loss_func(output))


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

    def __call__(self, batch: Any, input_tensor: torch.Tensor | None) -> torch.Tensor:
        """This stage's output (the activations for the next stage), or the micro-batch's loss on the last.

        Raises:
            ConfigError: ``forward_step`` or ``loss_func`` returned something else than Megatron-LM's shapes.
        """
        self.model.set_input_tensor(input_tensor)
        output, loss_func = _call(self.forward_step, batch, self.model)
        return loss_of(loss_func(output)) if self.last else output
