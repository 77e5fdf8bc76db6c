"""megatron-core's own distributed optimizer on the examples' MLP, for ``benchmarks/sharded.py`` (CPU, gloo).

megatron-core's ``DistributedDataParallel`` (``use_distributed_optimizer=True``: gradients reduce-scattered into
each rank's shard, in ``--instances`` instances) and ``get_megatron_optimizer`` (a ``DistributedOptimizer`` around torch's AdamW: fp32 main
parameters and Adam's moments of the shard, the updated parameters all-gathered), data parallel only, the
examples' MLP (``unicron_elastic.testing.toy_problem``) and its data, 24 samples a step over the ranks.

megatron-core 0.16 asks CUDA for three things that a CPU run must answer, patched here in this process only
(none changes the arithmetic): ``torch.cuda.current_device()`` as the device of its buffers (the CPU);
``device="cuda"`` in its tensor factories (``optimizer.py``, ``clip_grads.py``, ``utils.py``: the CPU); and its
dtype checks, which compare ``Tensor.type()`` with ``"torch.cuda.FloatTensor"`` (``distrib_optimizer.py``,
``clip_grads.py``: a CPU tensor's type answered with the CUDA name).

Each rank writes ``OUT/rank<R>.json`` (each step's end time) and ``OUT/state<R>.json`` (optimizer-state bytes
from the tensors: the fp32 main parameters of its shard and Adam's state).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

GLOBAL_BATCH = 24


def patch_cuda_for_the_cpu() -> None:
    """The three answers megatron-core 0.16 asks CUDA for, given on the CPU (see the module's docstring)."""
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]

    def on_the_cpu(factory: Any) -> Any:
        def made(*args: Any, **kwargs: Any) -> Any:
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)
        return made

    for name in ("tensor", "zeros", "empty", "ones", "full"):
        setattr(torch, name, on_the_cpu(getattr(torch, name)))
    tensor_type = torch.Tensor.type

    def cuda_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:  # a conversion, not the question
            return tensor_type(self, *args, **kwargs)
        name = tensor_type(self)
        return name if name.startswith("torch.cuda.") else "torch.cuda." + name[len("torch."):]

    torch.Tensor.type = cuda_type  # type: ignore[method-assign,assignment]


def wrapped(config: Any, module: torch.nn.Module) -> torch.nn.Module:
    """``module`` as the ``MegatronModule`` megatron-core's ``DistributedDataParallel`` takes (after the patch)."""
    from megatron.core.transformer.module import MegatronModule

    class Wrapped(MegatronModule):
        def __init__(self) -> None:
            super().__init__(config=config)
            self.mlp = module

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mlp(x)

    return Wrapped()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--instances", type=int, default=1,
                        help="num_distributed_optimizer_instances (above 1 megatron-core needs einops)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    patch_cuda_for_the_cpu()
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    from unicron_elastic.testing import toy_problem

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    parallel_state.initialize_model_parallel(1, 1, num_distributed_optimizer_instances=args.instances)
    config = TransformerConfig(num_layers=1, hidden_size=args.width, num_attention_heads=1,
                               params_dtype=torch.float32)
    mlp, _, xs, ys = toy_problem(args.width)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True,
        num_distributed_optimizer_instances=args.instances), wrapped(config, mlp))
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=0.01, weight_decay=0.1, params_dtype=torch.float32, use_distributed_optimizer=True,
        clip_grad=0.0),  # (its default clips at 1.0: a norm pass the other two sides do not make)
        [model])
    per_rank = GLOBAL_BATCH // world
    reports = []
    for step in range(args.steps):
        at = (step * GLOBAL_BATCH + rank * per_rank) % (len(xs) - per_rank)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(xs[at:at + per_rank]), ys[at:at + per_rank]).backward()
        model.finish_grad_sync()  # the reduce-scatter into this rank's shard
        optimizer.step()  # AdamW on the shard, then the all-gather of the parameters
        reports.append({"step": step, "finished_at": time.time()})
    held = 0
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = chained.optimizer
        held += sum(p.numel() * p.element_size() for group in inner.param_groups for p in group["params"])
        held += sum(v.numel() * v.element_size() for state in inner.state.values() for v in state.values()
                    if isinstance(v, torch.Tensor))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(reports))
    (args.out / f"state{rank}.json").write_text(json.dumps({"optimizer_state_bytes": held}))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
