"""Baseline for benchmarks/transition.py --only-tp: the same MegatronGPT in a plain loop, no resilience.

TP x DP ranks under torchrun; megatron-core's ``parallel_state`` (order
``tp-pp-dp``, as the strategy builds it) gives the tensor-parallel and the
data-parallel group. Each step: this replica's micro-batches of the same
global batch (``GlobalBatchPlan``, dealt round-robin like the strategy),
forward and backward with gradients accumulated in ``.grad`` (float32), one
ordinary ``all_reduce`` of all gradients over the data-parallel group (one
bucket), divided by B, AdamW. Step end times go to ``OUT/times<R>.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch.utils.data import default_collate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from lightning_gpt import MegatronGPT, Tokens  # noqa: E402

from unicron_elastic.strategy.engine.microbatch import GlobalBatchPlan, deal  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--global-batch", type=int, default=24)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tensor-parallel", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tensor_parallel, order="tp-pp-dp")
    torch.manual_seed(0)
    model = MegatronGPT(width=args.width, layers=args.layers)
    model.configure_model()
    optimizer = model.configure_optimizers()
    params = [p for p in model.parameters() if p.requires_grad]
    data = Tokens()
    plan = GlobalBatchPlan(len(data), args.global_batch, args.micro_batch, seed=1)
    replicas = parallel_state.get_data_parallel_world_size()
    mine = deal(plan.num_micro_batches, list(range(replicas)))[parallel_state.get_data_parallel_rank()]
    group = parallel_state.get_data_parallel_group()
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / f"times{rank}.jsonl", "w", buffering=1) as times:  # line by line, like StepTimes
        for step in range(args.steps):
            for p in params:
                p.grad = None
            for j in mine:
                batch = default_collate([data[i] for i in plan.indices(step, j)])
                model.pipeline_forward(batch, None).backward()
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat, group=group)
            flat /= plan.num_micro_batches
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
            optimizer.step()
            times.write(json.dumps({"step": step, "t": time.time()}) + "\n")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
