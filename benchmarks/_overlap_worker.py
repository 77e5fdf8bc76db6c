"""One rank of ``benchmarks/overlap.py``: a deep MLP trained by the engine or by megatron-core's own DDP (CPU, gloo).

Both sides train the same model (``--depth`` square layers of ``--width``, then one output), from the same
data, with the same global batch (one micro-batch per rank and step) and gradient buckets of
``--bucket-numel`` elements:

* ``--side unicron``: ``ElasticDataParallel`` (float32 sums; ``--no-overlap`` starts the buckets when the
  reduction begins instead of from backward; ``--sharded``: the distributed optimizer, one instance, the
  buckets reduce-scattered (``--all-reduce``: all-reduced), with ``overlap_param_gather``);
* ``--side megatron``: megatron-core's ``DistributedDataParallel`` with ``overlap_grad_reduce`` (and with
  ``--sharded`` its ``DistributedOptimizer`` with ``overlap_param_gather``), run on the CPU with the three
  answers to its CUDA questions of ``_megatron_do_worker.py``;
* ``--side torch-ddp``: torch's ``DistributedDataParallel``, as Lightning's ``ddp`` strategy builds it
  (replicated optimizer only).

Each rank writes ``OUT/rank<R>.json``: per step its end time and the seconds the step waited for its
gradients after its backward (``exposed``: the reduction not hidden behind compute), and the bytes of every
tensor storage reachable from the model, its gradients' buffers and the optimizer at the end, counted once
(``unicron_elastic.strategy.engine.footprint``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def model_and_data(width: int, depth: int, samples: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))
    generator = torch.Generator().manual_seed(1)
    return model, torch.randn(samples, width, generator=generator), torch.randn(samples, 1, generator=generator)


def unicron(args: argparse.Namespace, rank: int, world: int) -> list[dict]:
    from unicron_elastic.strategy.engine import ElasticDataParallel, EngineOptions, GlobalBatchPlan
    from unicron_elastic.strategy.engine.footprint import engine_bytes
    from unicron_elastic.meeting import connect_meeting_store

    model, xs, ys = model_and_data(args.width, args.depth, args.samples)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ddp = ElasticDataParallel(
        model, optimizer, GlobalBatchPlan(len(xs), args.global_batch, args.global_batch // world, seed=0),
        batch=lambda idx: (xs[idx], ys[idx]), loss_fn=lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
        store=connect_meeting_store(), rank=rank, world_size=world,
        options=EngineOptions(bucket_numel=args.bucket_numel, timeout=timedelta(seconds=120),
                              overlap_grad_reduce=not args.no_overlap,
                              optimizer_instances=1 if args.sharded else None,
                              overlap_param_gather=args.sharded,
                              reduce_scatter=args.sharded and not args.all_reduce))
    reports = []
    try:
        for step in range(args.steps):
            ddp.begin_step(step)
            waited = time.perf_counter()
            ddp.finish_gradients()
            exposed = time.perf_counter() - waited
            optimizer.step()
            ddp.next_step = step + 1
            reports.append({"step": step, "finished_at": time.time(), "exposed": exposed})
        ddp.finish()
        held = engine_bytes(ddp)
    finally:
        ddp.close()
    return reports + [{"bytes": held, "params": sum(p.numel() for p in model.parameters())}]


def megatron(args: argparse.Namespace, rank: int, world: int) -> list[dict]:
    from _megatron_do_worker import patch_cuda_for_the_cpu, wrapped

    patch_cuda_for_the_cpu()
    from unicron_elastic.strategy.engine.footprint import storage_bytes
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1)
    config = TransformerConfig(num_layers=1, hidden_size=args.width, num_attention_heads=1,
                               params_dtype=torch.float32)
    mlp, xs, ys = model_and_data(args.width, args.depth, args.samples)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=args.sharded,
        overlap_param_gather=args.sharded, bucket_size=args.bucket_numel), wrapped(config, mlp))
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-4, weight_decay=0.01, params_dtype=torch.float32,
        use_distributed_optimizer=args.sharded, clip_grad=0.0), [model])
    per_rank = args.global_batch // world
    reports = []
    for step in range(args.steps):
        at = (step * args.global_batch + rank * per_rank) % (len(xs) - per_rank)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(xs[at:at + per_rank]), ys[at:at + per_rank]).backward()
        waited = time.perf_counter()
        model.finish_grad_sync()
        exposed = time.perf_counter() - waited
        optimizer.step()
        reports.append({"step": step, "finished_at": time.time(), "exposed": exposed})
    inner = [chained.optimizer for chained in getattr(optimizer, "chained_optimizers", [optimizer])]
    buffers = [b.grad_data for b in model.buffers] + [b.param_data for b in model.buffers if b.param_data is not None]
    held = storage_bytes(mlp, buffers, inner)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return reports + [{"bytes": held, "params": sum(p.numel() for p in mlp.parameters())}]


def torch_ddp(args: argparse.Namespace, rank: int, world: int) -> list[dict]:
    """torch's ``DistributedDataParallel`` as Lightning's ``ddp`` strategy builds it (its overlap is always on).

    DDP waits for its buckets inside ``backward``, and its bucket buffers are its own: neither the exposed
    communication nor the bytes held are reported (NaN).
    """
    dist.init_process_group("gloo")
    model, xs, ys = model_and_data(args.width, args.depth, args.samples)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_numel * 4 / 2**20)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    per_rank = args.global_batch // world
    reports = []
    for step in range(args.steps):
        at = (step * args.global_batch + rank * per_rank) % (len(xs) - per_rank)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(ddp(xs[at:at + per_rank]), ys[at:at + per_rank]).backward()
        optimizer.step()
        reports.append({"step": step, "finished_at": time.time(), "exposed": float("nan")})
    dist.destroy_process_group()
    return reports + [{"bytes": float("nan"), "params": sum(p.numel() for p in model.parameters())}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--side", choices=["unicron", "megatron", "torch-ddp"], required=True)
    parser.add_argument("--no-overlap", action="store_true")
    parser.add_argument("--sharded", action="store_true")
    parser.add_argument("--all-reduce", action="store_true", help="(--sharded) all-reduce, not reduce-scatter")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--bucket-numel", type=int, default=400_000)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    reports = {"unicron": unicron, "megatron": megatron, "torch-ddp": torch_ddp}[args.side](args, rank, world)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(reports))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
