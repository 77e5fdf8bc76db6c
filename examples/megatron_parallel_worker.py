"""Tensor x pipeline x resilient data parallelism with megatron-core's parallel layers, on CPU/gloo.

The torch-level engine without Lightning: each rank runs
:class:`~unicron_elastic.strategy.engine.elastic_dp.ElasticDataParallel` for its shard
of a small MLP (``--tp`` tensor-parallel ranks per stage, ``--pp`` stages);
the ranks of one data-parallel replica are ``TP x PP`` consecutive launch ranks.
When a rank dies its whole replica is lost: its peers fail in a collective of
the model and leave (exit code 3: they would rejoin under ``unicron-run``);
the other replicas compute the lost replica's micro-batches and finish the step.

Environment as for torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ``TORCHELASTIC_USE_AGENT_STORE=True``: the store outlives
workers). Writes ``OUT/rank<R>.json`` and, for a rank that trained every step, ``OUT/params<R>.pt``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from unicron_elastic.strategy.engine.elastic_dp import ElasticDataParallel, EngineHooks, EngineOptions, Excluded
from unicron_elastic.strategy.engine.engine_options import GroupListener
from unicron_elastic.strategy.engine.microbatch import GlobalBatchPlan
from unicron_elastic.strategy.lightning.parallel import destroy_world, drop_world, rebuild_world
from unicron_elastic.strategy.engine.replicas import ModelParallel
from unicron_elastic.testing import maybe_fail, toy_data

WIDTH, HIDDEN = 8, 16


class Block(torch.nn.Module):
    """A tensor-parallel MLP block (column- then row-parallel), seeded like the same block on one rank."""

    def __init__(self, config: ModelParallelConfig, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)  # the full weight is drawn, then split over the TP ranks
        init = torch.nn.init.normal_
        self.col = ColumnParallelLinear(WIDTH, HIDDEN, config=config, init_method=init, bias=True,
                                        gather_output=False)
        self.row = RowParallelLinear(HIDDEN, WIDTH, config=config, init_method=init, bias=True,
                                     input_is_parallel=True, skip_bias_add=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.col(x)
        out, _ = self.row(torch.tanh(hidden) * 0.1)
        return x + out


def stage_model(config: ModelParallelConfig, stage: int, stages: int, blocks: int = 2) -> torch.nn.Sequential:
    """The layers of ``stage``: ``blocks`` TP blocks each, the last stage adds a head (seeds per layer)."""
    layers: list[torch.nn.Module] = [Block(config, seed=stage * blocks + i) for i in range(blocks)]
    if stage == stages - 1:
        torch.manual_seed(1000)
        layers.append(torch.nn.Linear(WIDTH, 1))
    return torch.nn.Sequential(*layers)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--bucket-numel", type=int, default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    layout = ModelParallel(args.tp, args.pp)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=60))
    members = list(range(layout.replicas(world)))

    model: torch.nn.Module | None = None  # Built once the first world exists.

    class World(GroupListener):
        """The world of the model's own collectives, built with the engine's groups of each generation."""

        def on_configure(self, bootstrap: dist.Store, generation: int, members: list[int]) -> None:
            rebuild_world(bootstrap, generation, layout, members, rank, timedelta(seconds=30), module=model)

        def on_abort(self) -> None:
            drop_world(model)

    stage, stages = layout.stage(rank), args.pp
    xs, ys = toy_data()

    def stage_fn(model: torch.nn.Module, batch, received: torch.Tensor | None) -> torch.Tensor:
        out = model(batch[0] if received is None else received)
        return torch.nn.functional.mse_loss(out, batch[1]) if stage == stages - 1 else out

    # The engine builds the first world (its listener's) before the model, whose layers need it.
    engine = ElasticDataParallel(
        None, None, GlobalBatchPlan(len(xs), 24, 4, seed=2),
        batch=lambda idx: (xs[idx], ys[idx]),
        loss_fn=lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
        store=store, rank=rank, world_size=world,
        options=EngineOptions(bucket_numel=args.bucket_numel, timeout=timedelta(seconds=30), model_parallel=layout,
                              grad_dtype=torch.float64),
        hooks=EngineHooks(fault_point=lambda _, step, **where: maybe_fail(rank, step, **where),
                          stage_fn=stage_fn if stages > 1 else None, group_listener=World()),
    )
    config = ModelParallelConfig(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                                 use_cpu_initialization=True, gradient_accumulation_fusion=False,
                                 params_dtype=torch.float32, pipeline_dtype=torch.float32)
    model = stage_model(config, stage, stages)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    engine.bind(model, optimizer)
    engine.reduction.tie()
    code = 0
    try:
        reports = []
        for step in range(args.steps):
            try:
                reports.append(vars(engine.train_step(step)))
            except Excluded as exc:  # a peer of this replica was lost: under unicron-run it would rejoin
                print(f"rank {rank} left out at step {step}: {exc}", file=sys.stderr)
                code = 3
                break
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"rank{rank}.json").write_text(json.dumps({
            "replica": layout.replica(rank), "shard": layout.shard(rank), "stage": stage,
            "members": engine.members, "reports": reports, "forward_only": engine.computation.forward_only,
            "trained": code == 0}))
        if code == 0:  # a rank left out holds a stale state: not a result
            torch.save([p.detach() for p in model.parameters()], args.out / f"params{rank}.pt")
    finally:
        # no gloo group may outlive the interpreter: a live one can abort a finished rank (SIGABRT)
        engine.close()
        destroy_world()
    sys.exit(code)


if __name__ == "__main__":
    main()
