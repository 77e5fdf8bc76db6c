"""Partial-iteration resumption on CPU/gloo: a tiny MLP trained by ElasticDataParallel.

Environment: ``RANK``, ``WORLD_SIZE``, and the meeting store: under ``unicron-run``
etcd (``UNICRON_MEETING``), else a TCPStore that outlives workers at
``MASTER_ADDR:MASTER_PORT``; faults from ``unicron_elastic.testing``. Under
``unicron-run`` the worker declares itself resumable: when it dies the agent
restarts it alone and it rejoins the group with state from a replica.
Each rank writes ``OUT/rank<R>.json`` (per-step reports) and, if it trained to the end (or
until the plan retired it), ``OUT/params<R>.pt`` and ``OUT/state<R>.json`` (the optimizer-state
bytes it holds: with ``--optimizer-instances``, its share; and every byte its engine keeps alive:
:func:`~unicron_elastic.strategy.engine.footprint.engine_bytes`); a rank admitted after training ended, or
left out until then, writes none (its ``rank<R>.json`` ends with ``{"trained": false}``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch

from unicron_elastic.env import max_world
from unicron_elastic.meeting import connect_meeting_store
from unicron_elastic.strategy.engine.effects import StepReport
from unicron_elastic.strategy.engine.elastic_dp import ElasticDataParallel, EngineHooks, EngineOptions, Excluded, Retired
from unicron_elastic.strategy.engine.footprint import engine_bytes
from unicron_elastic.strategy.engine.microbatch import GlobalBatchPlan
from unicron_elastic.testing import maybe_fail, toy_problem
from unicron_elastic.worker import get_worker


def _hold_for_joiner(ddp: ElasticDataParallel, world: int, worker) -> None:
    """Wait until every rank is a member or waits to join (bounded: 120 s)."""
    worker.set_paused(True)  # waiting for a peer is not a hang
    deadline = time.monotonic() + 120
    while len(set(ddp.members) | set(ddp.waiting())) < world and time.monotonic() < deadline:
        time.sleep(0.05)
    worker.set_paused(False)


def _hold_until(path: Path, rank: int, worker) -> None:
    """Touch ``<path>.waiting<RANK>``, then wait (at most 300 s) until ``path`` exists (a declared pause)."""
    path.with_name(f"{path.name}.waiting{rank}").touch()
    worker.set_paused(True, pause_for=300.0)
    deadline = time.monotonic() + 300
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    worker.set_paused(False)


def _state_bytes(ddp: ElasticDataParallel) -> int:
    """Bytes of optimizer state this rank holds (with a sharded optimizer: its shares and their main parameters)."""
    if ddp.optimizer_shards is not None:
        return ddp.optimizer_shards.state_bytes()
    return sum(v.numel() * v.element_size() for state in ddp.optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor))


def _clipped_step(ddp: ElasticDataParallel, step: int, max_norm: float) -> StepReport:
    """:meth:`ElasticDataParallel.train_step` with the gradients clipped by their whole norm before the optimizer's
    step (reduce-scattered: each rank's share, by the norm of all of them)."""
    ddp.begin_step(step)
    report = ddp.finish_gradients()
    if ddp.reduction.scatters:
        ddp.reduction.clip_grad_norm_(max_norm)
    else:
        torch.nn.utils.clip_grad_norm_(ddp.params, max_norm)
    ddp.optimizer.step()
    ddp.next_step = step + 1
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=24)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--bucket-numel", type=int, default=None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--width", type=int, default=16, help="hidden width of the MLP")
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (slow demo)")
    parser.add_argument("--progress", action="store_true", help="write OUT/progress<RANK> (last completed step) every step")
    parser.add_argument("--members", default=None, help="initial members, e.g. 0,1 (default: all)")
    parser.add_argument("--member-schedule", default="{}", help='JSON {"step": [members]}: reconfigure at that step')
    parser.add_argument("--grad-dtype", choices=["float32", "float64"], default="float32",
                        help="dtype of the gradient sums (float64: bit-identical to a failure-free run)")
    parser.add_argument("--hold-for-joiner", type=int, default=None, metavar="STEP",
                        help="before STEP, wait (at most 120 s) until every rank is a member or asks to join: "
                             "restarted ranks are then admitted before training ends, however slow their start")
    parser.add_argument("--hold-until", type=Path, default=None, metavar="FILE",
                        help="before step --hold-step, wait (at most 300 s) until FILE exists: lets a test decide "
                             "when the run may end instead of racing it")
    parser.add_argument("--hold-step", type=int, default=0)
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd",
                        help="SGD with momentum (default) or AdamW (lr 0.01, weight decay 0.1)")
    parser.add_argument("--optimizer-instances", type=int, default=None, metavar="I",
                        help="shard the optimizer's state over the members in I instances (Megatron-LM's distributed "
                             "optimizer); default: every rank keeps all of it")
    parser.add_argument("--grad-reduce-in-bf16", action="store_true",
                        help="all-reduce every gradient bucket but the last in bfloat16 (Megatron-LM's flag)")
    parser.add_argument("--overlap-param-gather", action="store_true",
                        help="with --optimizer-instances: gather the updated parameters into the next step's forward")
    parser.add_argument("--param-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the model's parameters (bfloat16: with --optimizer-instances, float32 main parameters)")
    parser.add_argument("--clip-grad", type=float, default=None, metavar="NORM",
                        help="clip the gradients by their whole norm before each optimizer step")
    parser.add_argument("--reduce-scatter", action="store_true",
                        help="with --optimizer-instances 1: reduce-scatter the gradient buckets (each rank receives "
                             "its share's sum)")
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = connect_meeting_store()  # etcd under unicron-run (survives any node), else the launcher's TCPStore
    worker = get_worker()
    scheduled = bool(json.loads(args.member_schedule))  # a member schedule alone decides the members
    worker.hello(resumable=True, leavable=not scheduled, growable=not scheduled)
    restarted = int(os.environ.get("UNICRON_WORKER_RESTARTS", "0")) > 0

    model, optimizer, xs, ys = toy_problem(args.width)
    dtype = getattr(torch, args.param_dtype)
    model, xs, ys = model.to(dtype), xs.to(dtype), ys.to(dtype)
    if args.optimizer == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)

    members = [int(m) for m in args.members.split(",")] if args.members else list(range(world))
    batch_plan = GlobalBatchPlan(len(xs), args.global_batch, args.micro_batch, seed=2)
    ddp = ElasticDataParallel(
        model, optimizer, batch_plan,
        batch=lambda idx: (xs[idx], ys[idx]),
        loss_fn=lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
        store=store, rank=rank, world_size=world, members=members, joining=restarted or rank not in members,
        member_schedule={int(k): v for k, v in json.loads(args.member_schedule).items()},
        options=EngineOptions(
            bucket_numel=args.bucket_numel, timeout=timedelta(seconds=20), grad_dtype=getattr(torch, args.grad_dtype),
            max_world=max_world(world),  # a node that grows the run joins past WORLD_SIZE
            optimizer_instances=args.optimizer_instances, overlap_param_gather=args.overlap_param_gather,
            reduce_dtype=torch.bfloat16 if args.grad_reduce_in_bf16 else None, reduce_scatter=args.reduce_scatter,
        ),
        hooks=EngineHooks(fault_point=maybe_fail, pause=worker.set_paused, report_waiting=worker.waiting),
    )
    ddp.reduction.measure_norm = args.clip_grad is not None  # (reduce-scattered: the shares' norms summed)
    start = ddp.join() if restarted or rank not in members else 0
    trained = start is not None  # admitted before training ended (else it trained nothing)
    reports = []
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        step = args.steps if start is None else start
        while step < args.steps:
            if step == args.hold_for_joiner:
                _hold_for_joiner(ddp, world, worker)
            if args.hold_until is not None and step == args.hold_step:
                _hold_until(args.hold_until, rank, worker)
            began = time.monotonic()
            try:
                report = ddp.train_step(step) if args.clip_grad is None else _clipped_step(ddp, step, args.clip_grad)
                reports.append({**vars(report), "finished_at": time.time(), "pid": os.getpid()})
            except Excluded:  # alive but left out of a regroup: come back as a joiner
                rejoined = ddp.join()
                reports.append({"excluded_at": step, "rejoined_at": rejoined})
                step = args.steps if rejoined is None else rejoined
                trained = rejoined is not None  # left behind until training ended: its parameters are stale
                continue
            if args.progress:  # the last completed step, for whoever watches from outside
                (args.out / f".progress{rank}").write_text(str(step))
                (args.out / f".progress{rank}").replace(args.out / f"progress{rank}")
            time.sleep(args.step_time)
            worker.heartbeat(step, time.monotonic() - began)
            step += 1
        ddp.finish()
    except Retired:
        reports.append({"retired_at": step})
    finally:
        ddp.close()
    if restarted:
        reports.insert(0, {"joined_at": start, "state_from": ddp.handout.state_source if start is not None else None})
    args.out.mkdir(parents=True, exist_ok=True)
    if not trained:
        reports.append({"trained": False})  # no params<R>.pt: what it holds is not a result
    (args.out / f"rank{rank}.json").write_text(json.dumps(reports))
    if trained:
        torch.save([p.detach() for p in model.parameters()], args.out / f"params{rank}.pt")
        (args.out / f"state{rank}.json").write_text(json.dumps({
            "optimizer_state_bytes": _state_bytes(ddp), "held_bytes": engine_bytes(ddp),
            "parameters": sum(p.numel() for p in model.parameters())}))


if __name__ == "__main__":
    main()
