"""TP=2 x DP=2 with megatron-core's tensor-parallel layers on CPU/gloo, resilient DP.

Each tensor-parallel rank runs :class:`ElasticDataParallel` over its own
data-parallel group (store namespace ``tp<k>``). When a rank dies its whole DP
replica is lost: its TP partner fails in a TP collective and leaves; the other
replica notices in both of its DP groups, computes the lost replica's
micro-batches (its two TP ranks in lockstep) and finishes the step.

Environment as for torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ``TORCHELASTIC_USE_AGENT_STORE=True``: the store outlives workers).
Writes ``OUT/params<R>.pt`` and ``OUT/rank<R>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from unicron_elastic.strategy.elastic_dp import ElasticDataParallel
from unicron_elastic.strategy.microbatch import GlobalBatchPlan
from unicron_elastic.testing import maybe_fail, toy_data


class TensorParallelMLP(torch.nn.Module):
    def __init__(self, config: ModelParallelConfig, width: int = 16) -> None:
        super().__init__()
        init = torch.nn.init.normal_
        self.col = ColumnParallelLinear(8, width, config=config, init_method=init, bias=True, gather_output=False)
        self.row = RowParallelLinear(width, 1, config=config, init_method=init, bias=True, input_is_parallel=True,
                                     skip_bias_add=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.col(x)
        out, _ = self.row(torch.tanh(hidden) * 0.1)
        return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    tp_rank, dp_rank, dp_size = ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    config = ModelParallelConfig(tensor_model_parallel_size=2, use_cpu_initialization=True,
                                 gradient_accumulation_fusion=False, params_dtype=torch.float32)
    torch.manual_seed(0)
    model = TensorParallelMLP(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    xs, ys = toy_data()
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=60))
    ddp = ElasticDataParallel(
        model, optimizer, GlobalBatchPlan(len(xs), 24, 4, seed=2),
        batch=lambda idx: (xs[idx], ys[idx]),
        loss_fn=lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
        store=dist.PrefixStore(f"tp{tp_rank}", store), rank=dp_rank, world_size=dp_size,
        timeout=timedelta(seconds=30), hook=lambda _, step, **where: maybe_fail(rank, step, **where),
    )
    try:
        reports = [vars(ddp.train_step(step)) for step in range(args.steps)]
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"rank{rank}.json").write_text(json.dumps({"tp": tp_rank, "dp": dp_rank, "reports": reports}))
        torch.save([p.detach() for p in model.parameters()], args.out / f"params{rank}.pt")
    finally:
        # no gloo group may outlive the interpreter: a live one can abort a finished rank (SIGABRT)
        ddp.close()
        ps.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
