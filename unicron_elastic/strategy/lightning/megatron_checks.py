"""What the strategy refuses in a megatron-core model, at ``fit``, with one clear error each: pure, no I/O.

Under ``unicron_megatron`` the strategy does what Megatron-LM's training loop
does around the model: the data-parallel reduce, the tied word embedding's
all-reduce, the tensor group's sums of sequence-parallel and q/k layer-norm
gradients, the per-token division, clipping by the replica's norm, the NaN
check. A model set up to have megatron-core do one of these itself, or to need
something the strategy does not do (interleaved pipeline stages, context or
expert parallelism, FP8's scaling state), would train a different model than
the one defined; it is refused instead. docs/strategy.md has the table of
Megatron-LM's flags.
"""

from __future__ import annotations

from typing import Any

import torch

from unicron_elastic.api import ConfigError

#: ``config`` attributes that must be off (or unset), and why.
_MUST_BE_OFF = {
    "defer_embedding_wgrad_compute": "it defers the output layer's weight gradient into megatron-core's DDP "
                                     "buffers, which the strategy does not use",
    "fp8": "FP8 training keeps per-tensor scaling state (amax history) that the strategy neither reduces across "
           "data-parallel ranks nor hands to a rank that rejoins; train in bf16-mixed",
    "tp_comm_overlap": "Transformer Engine's userbuffer overlap needs buffers set up by Megatron-LM's "
                       "initialize_model_parallel, which the strategy's rebuilt groups do not have",
}
#: ``config`` sizes that must be 1 (or unset), and what they are.
_MUST_BE_ONE = {
    "context_parallel_size": "context parallelism",
    "expert_model_parallel_size": "expert parallelism",
    "virtual_pipeline_model_parallel_size": "interleaved (virtual) pipeline stages",
}


def _is_megatron(obj: Any, package: str) -> bool:
    return type(obj).__module__.startswith(package)


def check_wrappers(module: torch.nn.Module, optimizers: list[Any]) -> None:
    """Refuse megatron-core's DDP wrappers and optimizers: reducing and stepping is the strategy's job.

    Raises:
        ConfigError: The model holds a ``megatron.core.distributed`` module (DDP, FSDP), or an optimizer
            is megatron-core's (``DistributedOptimizer``, ``ChainedOptimizer``, ``MegatronOptimizer``).
    """
    for name, sub in module.named_modules():
        if _is_megatron(sub, "megatron.core.distributed"):
            raise ConfigError(f"{name or 'the model'} is megatron-core's {type(sub).__name__}: under unicron_megatron "
                              "the strategy reduces the gradients (and survives losing ranks while it does); give "
                              "it the model unwrapped")
    for optimizer in optimizers:
        if _is_megatron(optimizer, "megatron.core.optimizer"):
            raise ConfigError(f"megatron-core's {type(optimizer).__name__} is not supported under unicron_megatron: "
                              "the strategy reduces the gradients itself; return a torch.optim optimizer from "
                              "configure_optimizers (for megatron-core's distributed optimizer: "
                              "UnicronMegatronStrategy(distributed_optimizer=True, optimizer_instances=2))")


def megatron_configs(module: torch.nn.Module) -> list[Any]:
    """The distinct megatron-core configs (``ModelParallelConfig`` and subclasses) the modules hold."""
    try:
        from megatron.core.model_parallel_config import ModelParallelConfig
    except ImportError:
        return []
    seen: dict[int, Any] = {}
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if isinstance(config, ModelParallelConfig):
            seen.setdefault(id(config), config)
    return list(seen.values())


def check_configs(module: torch.nn.Module, tensor_parallel: int, pipeline_parallel: int) -> None:
    """Refuse megatron-core configs the strategy would train wrongly.

    Raises:
        ConfigError: A config's TP or PP size is not the strategy's (megatron-core then does not tie the
            embedding across stages, or splits layers differently), or it turns on something listed in
            :data:`_MUST_BE_OFF` / :data:`_MUST_BE_ONE`, or mixture-of-experts or multi-token prediction.
    """
    for config in megatron_configs(module):
        for name, wanted in (("tensor_model_parallel_size", tensor_parallel),
                             ("pipeline_model_parallel_size", pipeline_parallel)):
            if getattr(config, name, wanted) != wanted:
                raise ConfigError(f"the model's config.{name} is {getattr(config, name)} but the strategy's is "
                                  f"{wanted}: build the config from parallel_state (megatron-core reads it to tie "
                                  "the embedding across stages and to place layers)")
        for name, why in _MUST_BE_OFF.items():
            if value := getattr(config, name, False):
                raise ConfigError(f"config.{name}={value} is not supported under unicron_megatron: {why}")
        for name, what in _MUST_BE_ONE.items():
            if (getattr(config, name, None) or 1) != 1:
                raise ConfigError(f"config.{name}={getattr(config, name)}: {what} is not supported under "
                                  "unicron_megatron")
        if getattr(config, "num_moe_experts", None):
            raise ConfigError("mixture-of-experts layers (config.num_moe_experts) are not supported under "
                              "unicron_megatron")
        if getattr(config, "mtp_num_layers", None):
            raise ConfigError("multi-token prediction (config.mtp_num_layers) keeps another copy of the embedding on "
                              "its stage, which unicron_megatron does not keep tied; it is not supported")
