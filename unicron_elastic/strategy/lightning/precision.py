"""Lightning's precision under the strategy's own micro-batch loop: what is refused, and loss scaling.

The strategy runs each step's micro-batches itself (Lightning's
``Strategy.training_step``, where Lightning enters the precision's autocast,
is not called), so it applies the precision plugin where Lightning would:
each micro-batch's forward under ``train_step_context()`` (autocast for the
``*-mixed`` precisions), never the gradient reduce; the batch through
``convert_input``; the module through Lightning's own ``convert_module``.

With a loss scaler (``16-mixed``) each micro-batch's loss is scaled before
its backward (:func:`scaled`). Lightning's ``MixedPrecision.optimizer_step``
then unscales the reduced gradients once, before clipping, and skips the
step (lowering the scale) when a value is not finite. That verdict must be
the same on every rank, or the replicas drift apart: the data-parallel
members of a shard reduce into the same bytes, so they agree by
construction; the shards of a replica (TP x PP) sum their verdicts
(:func:`overflowed`) in the step's commit, and a rank whose own shard was
finite fills its gradients with NaN so that its scaler skips too. The
scaler's state is part of Lightning's checkpoint, hence of the state a joiner
receives and of snapshots and disk checkpoints. Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

import torch

from unicron_elastic.api import ConfigError

#: Precision plugins of other strategies: their semantics (sharded scalers, engines) are not this strategy's.
_OTHER_STRATEGIES = ("FSDPPrecision", "DeepSpeedPrecision", "XLAPrecision")


def loss_scaler(plugin: Any) -> torch.amp.GradScaler | None:
    """The plugin's loss scaler (``16-mixed``), or None."""
    return getattr(plugin, "scaler", None)


def check_precision(plugin: Any) -> None:
    """Refuse a precision the strategy cannot honour (at ``Trainer`` construction, when Lightning attaches it).

    Every precision of Lightning's own strategies works: ``32-true``,
    ``bf16-mixed``, ``16-mixed`` (a ``torch.amp.GradScaler``), ``bf16-true``,
    ``16-true``, ``64-true``, and a ``MixedPrecision``/``HalfPrecision``/
    ``DoublePrecision`` plugin the user passes.

    Raises:
        ConfigError: ``plugin`` belongs to another strategy (FSDP, DeepSpeed,
            XLA), or its loss scaler is not a ``torch.amp.GradScaler`` (or is
            FSDP's ``ShardedGradScaler``).
    """
    name = type(plugin).__name__
    if any(cls.__name__ in _OTHER_STRATEGIES for cls in type(plugin).__mro__):
        raise ConfigError(f"unicron_megatron: the precision plugin {name} belongs to another strategy; use "
                          "precision='32-true', 'bf16-mixed', '16-mixed', 'bf16-true', '16-true' or '64-true'")
    scaler = loss_scaler(plugin)
    if scaler is None:
        return
    kind = type(scaler).__name__
    if not isinstance(scaler, torch.amp.GradScaler) or kind == "ShardedGradScaler":
        raise ConfigError(f"unicron_megatron: the loss scaler {kind} of {name} is not a torch.amp.GradScaler "
                          "of one process (FSDP's ShardedGradScaler reduces its verdict over a group of its own): "
                          "the strategy agrees the inf/NaN verdict itself")


def check_module(plugin: Any, module: torch.nn.Module, device: torch.device) -> None:
    """Refuse autocast on the CPU around megatron-core's parallel layers (at ``fit``, once the model exists).

    Their backward re-enters the forward's autocast for CUDA only
    (``custom_bwd``), so on the CPU it multiplies a half-precision gradient
    by a float32 weight and fails in the middle of the first step.

    Raises:
        ConfigError: The plugin autocasts on the CPU and ``module`` holds megatron-core's parallel layers.
    """
    if device.type != "cpu" or not _autocasts_on_cpu(plugin):
        return
    for sub in module.modules():
        if type(sub).__module__.startswith("megatron.core.tensor_parallel"):
            raise ConfigError(f"unicron_megatron: precision {plugin.precision!r} autocasts on the CPU around "
                              f"megatron-core's parallel layers ({type(sub).__name__}), whose backward re-enters "
                              "autocast on GPUs only and so fails here; train on a GPU, or with "
                              "precision='32-true' on the CPU")


def _autocasts_on_cpu(plugin: Any) -> bool:
    """Whether the plugin's training context turns CPU autocast on."""
    with plugin.train_step_context():
        return torch.is_autocast_enabled("cpu")


def scaled(plugin: Any, loss: torch.Tensor) -> torch.Tensor:
    """``loss`` as its backward needs it: scaled by the plugin's loss scaler, if it has one."""
    scaler = loss_scaler(plugin)
    return loss if scaler is None or not scaler.is_enabled() else scaler.scale(loss)


def start_scale(plugin: Any, device: torch.device) -> None:
    """Start the scaler's scale on a pipeline stage before the last (once, at ``setup``).

    Such a stage scales no loss, yet Lightning unscales its gradients (which
    the last stage's scaled loss produced): its scaler needs a scale, the
    same as the last stage's. Every stage starts from the same initial scale
    and follows the same agreed verdicts, so they stay equal.
    """
    scaler = loss_scaler(plugin)
    if scaler is not None and scaler.is_enabled():
        scaler.scale(torch.zeros((), device=device))  # (the scale is created on its first use)


def overflowed(plugin: Any, total: torch.Tensor, micro_batches: int) -> bool:
    """Whether the reduced gradient sum ``total`` holds a value that is not finite once unscaled.

    What the scaler's own check will find after the strategy divides the sum
    by ``micro_batches`` and Lightning unscales it: the largest magnitude
    goes through the same two operations in the same dtype, so a finite
    result means every value stays finite (a NaN anywhere makes it NaN).

    Args:
        plugin: The precision plugin (no scaler: never).
        total: The shard's reduced sum of the micro-batches' scaled gradients.
        micro_batches: Micro-batches per step (the sum's divisor).
    """
    scaler = loss_scaler(plugin)
    if scaler is None or not scaler.is_enabled() or total.numel() == 0:
        return False
    inverse = torch.tensor(1.0 / scaler.get_scale(), dtype=torch.float64).to(total.dtype)
    peak = total.abs().amax().div(micro_batches).mul(inverse.to(total.device))
    return not bool(torch.isfinite(peak))
