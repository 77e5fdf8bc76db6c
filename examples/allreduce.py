"""A tiny gloo all-reduce job: each rank adds its rank+1; rank 0 prints the result.

Run it on one machine with::

    unicron-run --standalone --nproc-per-node=2 examples/allreduce.py

With ``--out DIR`` every rank writes ``DIR/rank<R>.json`` with its world size
and the reduced value (the tests read these). ``--steps N --sleep S`` repeat
the all-reduce N times with S seconds between (so a test can kill a node);
after each step a rank writes ``DIR/progress<R>`` (step and world size).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--sleep", type=float, default=0.0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    value = 0.0
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    for step in range(args.steps):
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        value = float(t.item())
        if args.out is not None:
            (args.out / f"progress{rank}").write_text(f"{step} {world}")
        time.sleep(args.sleep)
    expected = world * (world + 1) / 2
    if value != expected:
        raise SystemExit(f"rank {rank}: all-reduce gave {value}, expected {expected}")
    if rank == 0:
        print(f"all-reduce over {world} ranks = {value} (restart {os.environ.get('TORCHELASTIC_RESTART_COUNT')})")
    if args.out is not None:
        record = {
            "rank": rank,
            "world_size": world,
            "value": value,
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "incarnation": os.environ.get("UNICRON_INCARNATION"),
        }
        (args.out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
