"""The baseline of benchmarks/transition.py: plain torch.distributed data parallelism
under torchrun, a checkpoint every --ckpt-every steps; after a failure torchrun restarts
every worker, which reload the checkpoint and recompute the lost steps."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from unicron_elastic.strategy.engine.microbatch import GlobalBatchPlan, deal
from unicron_elastic.testing import maybe_fail, toy_problem


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--ckpt-every", type=int, default=4)
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (as the elastic worker)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer, xs, ys = toy_problem(args.width)
    plan = GlobalBatchPlan(len(xs), 24, 4, seed=2)
    ckpt = args.out / "ckpt.pt"
    start = 0
    if ckpt.exists():  # restarted by torchrun: reload the last checkpoint
        state = torch.load(ckpt, weights_only=True)  # plain tensors and numbers: nothing is unpickled as code
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    params = list(model.parameters())
    log = args.out / f"steps{rank}.jsonl"
    for step in range(start, args.steps):
        total = [torch.zeros_like(p) for p in params]
        for j in deal(plan.num_micro_batches, list(range(world)))[rank]:
            maybe_fail(rank, step, micro_batch=j)
            model.zero_grad()
            idx = plan.indices(step, j)
            torch.nn.functional.mse_loss(model(xs[idx]), ys[idx]).backward()
            for t, p in zip(total, params):
                t += p.grad
        flat = torch.cat([t.reshape(-1) for t in total])
        dist.all_reduce(flat)  # one flat bucket, like ElasticDataParallel's default
        offset = 0
        for p in params:
            p.grad = (flat[offset : offset + p.numel()] / plan.num_micro_batches).view_as(p)
            offset += p.numel()
        optimizer.step()
        time.sleep(args.step_time)
        with log.open("a") as f:
            f.write(json.dumps({"step": step, "finished_at": time.time(),
                                "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}) + "\n")
        if rank == 0 and (step + 1) % args.ckpt_every == 0:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1}, tmp)
            os.replace(tmp, ckpt)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
