"""One stage of a 3-stage pipeline over gloo point-to-point (tests/test_pipeline.py).

argv: OUT SCHEDULE. Rank r holds layer r of a 3-layer MLP (seeded like the
reference), runs one step of 4 micro-batches with ``SCHEDULE`` ("gpipe" or
"1f1b") and saves its layer's gradients and (last stage) the losses to
``OUT/grads<r>.pt``.
"""

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from unicron_elastic.strategy.engine.pipeline import SCHEDULES, StageLinks, run_pipeline

MICRO_BATCHES = 4


def layers() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh()),
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()), torch.nn.Linear(8, 1)]


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(MICRO_BATCHES, 3, 4, generator=generator), torch.randn(MICRO_BATCHES, 3, 1, generator=generator)


def main() -> None:
    out, schedule = Path(sys.argv[1]), sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        module = layers()[rank]
        xs, ys = data()
        links = StageLinks(rank - 1 if rank > 0 else None, rank + 1 if rank < world - 1 else None)

        def forward(j: int, received: torch.Tensor | None) -> torch.Tensor:
            output = module(xs[j] if received is None else received)
            return torch.nn.functional.mse_loss(output, ys[j]) / MICRO_BATCHES if links.last else output

        losses = run_pipeline(forward, SCHEDULES[schedule](rank, world, MICRO_BATCHES), links)
        out.mkdir(parents=True, exist_ok=True)
        torch.save({"grads": [p.grad for p in module.parameters()], "losses": losses}, out / f"grads{rank}.pt")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
