"""What a megatron-core model asks of each step besides the data-parallel sum (read from its config, no I/O).

Megatron-LM's ``finalize_model_grads`` does, after the data-parallel reduce:

* sum over the tensor group the gradients of parameters every tensor rank holds
  whole but computes only part of: with sequence parallelism those marked
  ``sequence_parallel`` (layer norms and row-parallel biases see one chunk of
  the sequence), and with ``qk_layernorm`` the ``q_layernorm``/``k_layernorm``
  weights (each tensor rank normalises its own heads); average those marked
  ``average_gradients_across_tp_domain``;
* with ``calculate_per_token_loss`` divide the gradients by the step's token count.

With ``gradient_accumulation_fusion`` megatron-core's linear layers accumulate
their weight gradients into ``param.main_grad`` instead of ``.grad``.

:func:`model_reductions` turns the model's config into the engine's
:class:`~unicron_elastic.strategy.engine.engine_options.ModelReductions`.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

from unicron_elastic.api import ConfigError
from unicron_elastic.strategy.engine.engine_options import ModelReductions, TensorReduced
from unicron_elastic.strategy.engine.step_totals import TotalsLayout
from unicron_elastic.strategy.lightning.megatron_checks import megatron_configs

#: The config switches that change what a step does, and their defaults.
_SWITCHES = ("sequence_parallel", "qk_layernorm", "calculate_per_token_loss", "gradient_accumulation_fusion")
_QK_NORMS = ("q_layernorm", "k_layernorm")


@dataclass(frozen=True)
class MegatronSwitches:
    """The model's config switches that change what a step does.

    Attributes:
        sequence_parallel: ``config.sequence_parallel``.
        qk_layernorm: ``config.qk_layernorm``.
        per_token: ``config.calculate_per_token_loss``.
        fusion: ``config.gradient_accumulation_fusion``.
    """

    sequence_parallel: bool = False
    qk_layernorm: bool = False
    per_token: bool = False
    fusion: bool = False


def switches(module: torch.nn.Module) -> MegatronSwitches:
    """The switches of the model's megatron-core configs (all off without one).

    Raises:
        ConfigError: Two configs of the model disagree on one.
    """
    values: dict[str, bool] = {}
    for config in megatron_configs(module):
        for name in _SWITCHES:
            value = bool(getattr(config, name, False))
            if values.setdefault(name, value) != value:
                raise ConfigError(f"the model's megatron-core configs disagree on {name}: build every module from "
                                  "one TransformerConfig")
    return MegatronSwitches(values.get("sequence_parallel", False), values.get("qk_layernorm", False),
                            values.get("calculate_per_token_loss", False),
                            values.get("gradient_accumulation_fusion", False))


def tensor_reduced(named: list[tuple[str, torch.nn.Parameter]], flags: MegatronSwitches) -> TensorReduced:
    """The parameters whose gradients megatron-core reduces over the tensor group, by position in ``named``.

    The rule of megatron-core 0.16's ``_allreduce_non_tensor_model_parallel_grads``: averaged when marked
    ``average_gradients_across_tp_domain``, else summed when marked ``sequence_parallel`` (with sequence
    parallelism on) or named ``q_layernorm``/``k_layernorm`` (with ``qk_layernorm``).
    """
    summed, averaged = [], []
    for i, (name, p) in enumerate(named):
        if getattr(p, "average_gradients_across_tp_domain", False):
            averaged.append(i)
        elif (flags.sequence_parallel and getattr(p, "sequence_parallel", False)) or \
                (flags.qk_layernorm and any(norm in name for norm in _QK_NORMS)):
            summed.append(i)
    return TensorReduced(tuple(summed), tuple(averaged))


def check_sequence_parallel_norms(module: torch.nn.Module, flags: MegatronSwitches) -> None:
    """Refuse a layer norm whose gradient would be partial on each tensor rank and that nothing sums.

    With sequence parallelism a norm sees one chunk of the sequence, so its
    gradient must be summed over the tensor group: megatron-core knows it by
    the parameters' ``sequence_parallel`` mark (Apex's and Transformer Engine's
    norms set it; a plain torch norm does not, and would train apart on each
    tensor rank).

    Raises:
        ConfigError: With sequence parallelism, a ``LayerNorm``/``RMSNorm`` whose parameters are not marked
            ``sequence_parallel`` (and that is no q/k layer norm, which is summed by name).
    """
    if not flags.sequence_parallel:
        return
    norms = tuple(cls for cls in (torch.nn.LayerNorm, getattr(torch.nn, "RMSNorm", None)) if cls is not None)
    for name, sub in module.named_modules():
        if not isinstance(sub, norms) or any(norm in name for norm in _QK_NORMS):
            continue
        for pname, p in sub.named_parameters(recurse=False):
            if p.requires_grad and not getattr(p, "sequence_parallel", False):
                raise ConfigError(f"config.sequence_parallel=True but {name}.{pname} ({type(sub).__name__}) is not "
                                  "marked sequence_parallel: its gradient would be partial on each tensor rank and "
                                  "never summed. Use a norm that marks its parameters (Transformer Engine's or "
                                  "Apex's; megatron-core's WrappedTorchNorm refuses sequence parallelism), or set "
                                  "param.sequence_parallel = True on its parameters")


def model_reductions(module: torch.nn.Module, named: list[tuple[str, torch.nn.Parameter]], megatron_shape: bool,
                     report_keys: tuple[str, ...], check_finite: bool) -> ModelReductions:
    """What the engine does for this model each step besides the data-parallel sum.

    Args:
        module: The LightningModule.
        named: The parameters the engine sums, with their names, in its order.
        megatron_shape: The module gives its step in Megatron-LM's ``forward_step`` shape (its losses carry
            token counts and reports: the step's totals are summed and logged).
        report_keys: The keys of ``loss_func``'s report.
        check_finite: Stop on a NaN or Inf (no loss scaler).

    Raises:
        ConfigError: See :func:`switches` and :func:`check_sequence_parallel_norms`.
    """
    flags = switches(module)
    check_sequence_parallel_norms(module, flags)
    totals = TotalsLayout(tuple(report_keys)) if megatron_shape or flags.per_token else None
    return ModelReductions(tensor_reduced=tensor_reduced(named, flags), totals=totals, per_token=flags.per_token,
                           main_grad=flags.fusion, check_finite=check_finite)
