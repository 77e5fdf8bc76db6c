"""Builds megatron-core parallel_state groups with unicron's build_world, then rebuilds them smaller.

Run by tests/test_parallel_state.py (4 ranks around a store the test hosts).
Writes OUT/rank<R>.json: the ranks and sizes megatron-core reports per configuration.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from megatron.core import parallel_state as ps

from unicron_elastic.strategy.lightning.parallel import build_world, destroy_world


def describe() -> dict[str, int]:
    return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(), "tp_rank": ps.get_tensor_model_parallel_rank(),
            "pp_rank": ps.get_pipeline_model_parallel_rank(), "dp_rank": ps.get_data_parallel_rank(),
            "world": dist.get_world_size()}


def main() -> None:
    out = Path(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=60))
    seen = {}
    generation = 0
    for tp, pp in [(1, 1), (2, 1), (1, 2), (2, 2)]:
        build_world(store, generation, rank, world, tp, pp)
        seen[f"{tp}x{pp}"] = describe()
        generation += 1
    # reconfigure: ranks 2 and 3 leave, the others rebuild a world of 2 with TP=2
    if rank < 2:
        build_world(store, generation, rank, 2, 2, 1)
        seen["after_shrink_2x1"] = describe()
    destroy_world()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
