"""Progress within a step, for the hang detector: the forward and backward of a model's top-level modules and layers.

The agent's hang verdict needs signs of life finer than the step
(:mod:`~unicron_elastic.detection.hang`): a step of a large model takes
seconds, a rank stuck inside it must not look like a slow one. Besides the
engine's points (each micro-batch, each bucket reduced, around the optimizer
step), :func:`watch_progress` marks the forward of every marked module and,
when its output needs a gradient, the moment backward reaches it (a hook on
the output that returns nothing, so gradients are unchanged). The marked
modules are the model's top-level children and the items of every
``ModuleList`` in it (the transformer layers of GPT-style models, megatron-core's
``decoder.layers`` included). Each mark is a call of
:meth:`~unicron_elastic.worker.WorkerChannel.progress`, which sends at most
one message every few tens of milliseconds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


def marked_modules(model: nn.Module) -> list[nn.Module]:
    """The modules whose forward and backward are marked: ``model``'s children and the items of its ``ModuleList``\\ s."""
    marked: dict[int, nn.Module] = {id(child): child for child in model.children()}
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            marked.update((id(item), item) for item in module)
    return list(marked.values())


def _needing_grad(output: Any) -> torch.Tensor | None:
    """The first tensor of ``output`` (a tensor, or a tuple or list of them) that needs a gradient."""
    items = output if isinstance(output, (tuple, list)) else (output,)
    for item in items:
        if isinstance(item, torch.Tensor) and item.requires_grad:
            return item
    return None


def watch_progress(model: nn.Module, mark: Callable[[], None]) -> list[RemovableHandle]:
    """Call ``mark()`` after each marked module's forward and when backward reaches its output.

    Returns:
        The forward hooks' handles (``handle.remove()`` takes each away).
    """

    def backward_reached(grad: torch.Tensor) -> None:
        mark()

    def forward_done(module: nn.Module, inputs: Any, output: Any) -> None:
        mark()
        tensor = _needing_grad(output)
        if tensor is not None and torch.is_grad_enabled():
            tensor.register_hook(backward_reached)

    return [module.register_forward_hook(forward_done) for module in marked_modules(model)]
