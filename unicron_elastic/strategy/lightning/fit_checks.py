"""What ``unicron_megatron`` refuses (its arguments, at ``fit`` the module's settings) and what it asks of a model.

Every refusal is a :class:`~unicron_elastic.api.ConfigError` that says what
to do instead; the checks of megatron-core's wrappers, configs and groups
are in :mod:`~unicron_elastic.strategy.lightning.megatron_checks` and
:mod:`~unicron_elastic.strategy.lightning.model_groups`.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins.precision import DoublePrecision

from unicron_elastic.api import ConfigError
from unicron_elastic.strategy.engine.engine_options import ModelReductions
from unicron_elastic.strategy.engine.gradients import HALF
from unicron_elastic.strategy.engine.optimizer_shards import check_element_wise
from unicron_elastic.strategy.engine.pipeline import SCHEDULES
from unicron_elastic.strategy.lightning.forward import megatron_shape
from unicron_elastic.strategy.lightning.megatron_checks import check_configs, check_wrappers
from unicron_elastic.strategy.lightning.megatron_reductions import model_reductions
from unicron_elastic.strategy.lightning.model_groups import check_groups
from unicron_elastic.strategy.lightning.precision import check_module, loss_scaler

__all__ = ["check_arguments", "check_fit", "reductions_of"]


def check_arguments(sizes: dict[str, int | None], snapshot_every: int, checkpoint_every: int,
                    pipeline_schedule: str) -> None:
    """Refuse the strategy's arguments that cannot work.

    Args:
        sizes: ``{name: value}`` of the sizes that must be at least 1 when given (``global_batch``, ...).
        snapshot_every: Steps between in-memory snapshots.
        checkpoint_every: Steps between disk checkpoints.
        pipeline_schedule: The pipeline schedule's name.

    Raises:
        ConfigError: A size below 1, a negative interval or an unknown pipeline schedule.
    """
    for name, value in sizes.items():
        if value is not None and value < 1:
            raise ConfigError(f"{name}={value} must be >= 1")
    if snapshot_every < 0 or checkpoint_every < 0:
        raise ConfigError("snapshot_every and checkpoint_every must be >= 0")
    if pipeline_schedule not in SCHEDULES:
        raise ConfigError(f"unknown pipeline_schedule {pipeline_schedule!r}; choose one of {sorted(SCHEDULES)}")


def check_distributed_optimizer(distributed: bool, instances: int, overlap_gather: bool = False,
                                model_parallel: int = 1) -> None:
    """Refuse optimizer instances, or an overlapped gather, without a distributed optimizer.

    Raises:
        ConfigError: ``optimizer_instances`` below 1, or other than 1 without ``distributed_optimizer``;
            ``overlap_param_gather`` without it, or with TP x PP > 1.
    """
    if instances < 1:
        raise ConfigError(f"optimizer_instances={instances} must be >= 1")
    if instances != 1 and not distributed:
        raise ConfigError("optimizer_instances needs distributed_optimizer=True (instances of a sharded state)")
    if overlap_gather and (not distributed or model_parallel > 1):
        raise ConfigError("overlap_param_gather needs distributed_optimizer=True and tensor_model_parallel_size x "
                          f"pipeline_model_parallel_size = 1 (got {model_parallel}): with TP x PP > 1 the shards "
                          "agree that every gather completed before computing")


def check_fit(trainer: Any, module: Any, optimizers: list[Any], precision: Any, device: torch.device,
              sizes: tuple[int, int], trains: bool, sharded: bool = False) -> None:
    """What the strategy cannot train, as clear errors.

    Args:
        trainer: The Trainer.
        module: The LightningModule.
        optimizers: Its optimizers.
        precision: Lightning's precision plugin.
        device: The strategy's root device.
        sizes: The tensor-parallel and pipeline-parallel sizes.
        trains: Whether this rank trains the model: a rank that found training over when it came back
            built its model in a world of its own, and trains nothing (its megatron-core configs and
            groups are then not checked).
        sharded: The optimizer's state is sharded (``distributed_optimizer=True``).

    Raises:
        ConfigError: Manual optimization, several optimizers, gradient accumulation; with PP > 1 a
            module without ``forward_step`` or ``pipeline_forward`` (or with both); a ``*-mixed``
            precision on the CPU around megatron-core's layers; megatron-core's DDP wrappers or
            optimizers, configs the strategy would train wrongly, groups it cannot rebuild
            (:mod:`~unicron_elastic.strategy.lightning.megatron_checks`,
            :mod:`~unicron_elastic.strategy.lightning.model_groups`); sharded, an optimizer that is not
            element-wise, a loss scaler or float64 parameters (:func:`check_parameter_dtypes`).
    """
    tp, pp = sizes
    if not module.automatic_optimization:
        raise ConfigError("unicron_megatron needs automatic optimization")
    if len(optimizers) != 1:
        raise ConfigError(f"unicron_megatron supports one optimizer (got {len(optimizers)})")
    if trainer.accumulate_grad_batches != 1:
        raise ConfigError("unicron_megatron accumulates micro-batches itself: use micro_batch/global_batch, "
                          "not accumulate_grad_batches")
    stages = [name for name in ("forward_step", "pipeline_forward") if callable(getattr(module, name, None))]
    if pp > 1 and len(stages) != 1:
        raise ConfigError(f"pipeline_model_parallel_size={pp}: the LightningModule must implement one of "
                          "forward_step(data_iterator, model) -> (output_tensor, loss_func) (Megatron-LM's "
                          "shape) or pipeline_forward(batch, input_tensor) (see docs/strategy.md); "
                          f"it has {stages or 'neither'}")
    check_module(precision, module, device)
    check_wrappers(module, optimizers)
    if sharded:
        check_element_wise(optimizers[0])
        check_parameter_dtypes(module, precision)
        if loss_scaler(precision) is not None:
            raise ConfigError("distributed_optimizer=True does not support a loss scaler (precision='16-mixed'): "
                              "the scaler unscales the optimizer's gradients before its step, where each rank's "
                              "share is loaded; use 'bf16-mixed' (Megatron-LM's recipes) or 32-bit")
    if trains:
        check_configs(module, tp, pp)
        check_groups(module)


def check_parameter_dtypes(module: Any, precision: Any) -> None:
    """(A sharded optimizer) refuse parameters whose main parameters would round them: float64 ones.

    The shares are float32 main parameters: float32 parameters are their own main parameters; half-precision
    ones (``precision="bf16-true"``, ``"16-true"``: Megatron-LM's mixed precision) are rounded from them by
    each gather, and checkpoints hold the main parameters. With float64 parameters (``"64-true"``) every step
    would round them to float32.

    Raises:
        ConfigError: The ``64-true`` precision, or a trainable parameter that is neither float32 nor half-precision.
    """
    wrong = next(((name, p.dtype) for name, p in module.named_parameters()
                  if p.requires_grad and p.dtype != torch.float32 and p.dtype not in HALF), None)  # (frozen: unsharded)
    if isinstance(precision, DoublePrecision) or wrong is not None:
        found = f"{wrong[0]} is {wrong[1]}" if wrong else f"Lightning's {type(precision).__name__} plugin converts them"
        raise ConfigError("distributed_optimizer=True steps float32 main parameters of float32 or half-precision "
                          f"model parameters ({found}): use precision='bf16-true' (bfloat16 parameters, float32 "
                          "main parameters, as Megatron-LM's bf16 recipes), 'bf16-mixed' or '32-true'")


def reductions_of(module: Any, precision: Any, report_keys: tuple[str, ...]) -> ModelReductions:
    """What the engine does for this model each step besides the data-parallel sum.

    That is what its megatron-core config asks
    (:mod:`~unicron_elastic.strategy.lightning.megatron_reductions`), and the
    check for NaN or Inf where no loss scaler is.

    Args:
        module: The LightningModule.
        precision: Lightning's precision plugin (its loss scaler, if any).
        report_keys: The keys of the ``report`` a Megatron-LM ``loss_func`` returns.

    Returns:
        The model's reductions.

    Raises:
        ConfigError: See :func:`~unicron_elastic.strategy.lightning.megatron_reductions.model_reductions`.
    """
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    scaler = loss_scaler(precision)
    return model_reductions(module, named, megatron_shape(module), report_keys,
                            check_finite=scaler is None or not scaler.is_enabled())
