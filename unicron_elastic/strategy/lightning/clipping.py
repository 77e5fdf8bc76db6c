"""Clipping by norm with the whole replica's gradient norm (TP x PP > 1), in place of Lightning's per-shard norm.

Lightning's precision plugin clips with ``clip_grad_by_norm``; with TP x PP >
1 that would clip each shard by its own norm. The engine takes the replica's
norm in the step's commit (every parameter counted once, as megatron-core
counts it), and :class:`ReplicaNormClip` clips every shard by it alike.

With a sharded optimizer the gradients clipped are the model's reduced ones,
as the shares load them (:func:`~unicron_elastic.strategy.engine.gradients.optimizer_gradient`:
a half-precision parameter's ``main_grad``, in the sums' dtype), with torch's
arithmetic (:func:`clip_by_norm`, :func:`scale_to_norm`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from unicron_elastic.strategy.engine.gradients import optimizer_gradient, scale_to_norm
from unicron_elastic.strategy.lightning.precision import loss_scaler

if TYPE_CHECKING:
    from unicron_elastic.strategy.engine.elastic_dp import ElasticDataParallel

__all__ = ["ReplicaNormClip", "clip_by_norm", "clip_by_value", "install_clipping", "replica_grad_norm",
           "scale_to_norm"]


def gradients_of(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """The reduced gradients of ``params`` that a sharded optimizer loads (those that exist)."""
    return [g for g in map(optimizer_gradient, params) if g is not None]


def clip_by_norm(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch's ``clip_grad_norm_`` (2-norm) on gradient tensors themselves; returns the norm before clipping."""
    total = torch.nn.utils.get_total_norm(grads)
    if grads:
        scale_to_norm(grads, max_norm, total)
    return total


def clip_by_value(grads: list[torch.Tensor], clip_value: float) -> None:
    """torch's ``clip_grad_value_`` on gradient tensors themselves."""
    for grad in grads:
        grad.clamp_(min=-float(clip_value), max=float(clip_value))


def replica_grad_norm(engine: ElasticDataParallel | None, precision: Any) -> float | None:
    """The norm of the whole replica's gradients as Lightning clips them in this step (TP x PP > 1).

    Taken from the reduced gradients in the step's commit, divided by the
    number of micro-batches and, with a loss scaler, by the scale being
    unscaled (read it up to the optimizer step).

    Args:
        engine: The elastic engine (None: no norm).
        precision: Lightning's precision plugin (its loss scaler, if any).

    Returns:
        The norm; None with TP = PP = 1 (Lightning computes it) and before the step's gradients are reduced.
    """
    norm = engine.reduction.grad_norm if engine is not None else None
    scaler = loss_scaler(precision)
    if norm is not None and scaler is not None and scaler.is_enabled():
        norm /= scaler.get_scale()
    return norm


class ReplicaNormClip:
    """Lightning's clipping by norm with the whole replica's norm, on every shard alike.

    Set as the precision plugin's ``clip_grad_by_norm`` for a fit.

    Args:
        norm: Returns the replica's norm of this step (:func:`replica_grad_norm`).
        precision: Lightning's precision plugin (its ``main_params``).
        device: The strategy's root device (where the norm goes when no parameter has a gradient).
        params: The parameters whose gradients are clipped (a sharded optimizer: the model's, whose reduced
            gradients the shares load after the clipping); None: the optimizer's main parameters.
    """

    def __init__(self, norm: Callable[[], float | None], precision: Any, device: torch.device,
                 params: list[torch.nn.Parameter] | None = None) -> None:
        self.norm, self.precision, self.device, self.params = norm, precision, device, params

    def __call__(self, optimizer: Any, clip_val: float) -> None:
        """Scale the gradients of ``optimizer``'s parameters so that the replica's norm is at most ``clip_val``.

        Args:
            optimizer: The optimizer whose parameters' gradients are clipped.
            clip_val: The largest norm.

        Raises:
            RuntimeError: No norm was taken in this step.
        """
        norm = self.norm()
        if norm is None:
            raise RuntimeError("unicron_megatron: clipping by norm, but this step's commit took no gradient norm")
        # torch clamps the coefficient at 1, so there is nothing to scale; older releases' docs do not say they clamp.
        if norm + 1e-6 <= clip_val:
            return
        if self.params is not None:
            grads = gradients_of(self.params)
        else:
            grads = [p.grad for p in self.precision.main_params(optimizer) if p.grad is not None]
        device = grads[0].device if grads else self.device
        scale_to_norm(grads, clip_val, torch.tensor(norm, dtype=torch.float32, device=device))


def clip_model_gradients(precision: Any, params: list[torch.nn.Parameter]) -> None:
    """(A sharded optimizer) Lightning's clipping applied to the model's reduced gradients, for a fit.

    Lightning clips the gradients of the optimizer's parameters, which with a sharded optimizer are this
    rank's shares, whose gradients are loaded from the model's only after the clipping. Every rank holds the
    whole reduced gradient, so clipping the model's by the whole norm is what the unsharded optimizer does
    (a half-precision parameter's is its ``main_grad``, which the shares load).

    Args:
        precision: Lightning's precision plugin (its ``clip_grad_by_norm`` and ``clip_grad_by_value`` are set).
        params: The model's parameters whose gradients the engine reduces.
    """
    precision.clip_grad_by_norm = lambda optimizer, clip_val: clip_by_norm(gradients_of(params), clip_val)
    precision.clip_grad_by_value = lambda optimizer, clip_val: clip_by_value(gradients_of(params), clip_val)


def install_clipping(precision: Any, engine: ElasticDataParallel, sharded: bool, norm: Callable[[], float | None],
                     device: torch.device) -> None:
    """Lightning's clipping, for a fit, where the plugin's own would be wrong.

    With TP x PP > 1 the plugin would clip each shard by its own norm: :class:`ReplicaNormClip` clips by the
    replica's (the engine measures it in the step's commit, on the primary replica). With a sharded optimizer
    the optimizer's parameters are shares whose gradients are loaded after Lightning clips: the model's reduced
    gradients are clipped instead (:func:`clip_model_gradients`).

    Args:
        precision: Lightning's precision plugin.
        engine: The elastic engine, its model bound.
        sharded: The optimizer is sharded.
        norm: Returns the replica's norm of this step (:func:`replica_grad_norm`).
        device: The strategy's root device.
    """
    params = engine.params if sharded else None
    if params is not None:
        clip_model_gradients(precision, params)
    if engine.layout.size > 1:
        engine.reduction.measure_norm = True
        precision.clip_grad_by_norm = ReplicaNormClip(norm, precision, device, params)
