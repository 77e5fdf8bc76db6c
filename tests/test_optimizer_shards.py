"""The sharded optimizer (Megatron-LM's distributed optimizer with instances) and its recovery, on gloo.

Pure decisions (shares, the pieces a move copies) are checked in-process with
hypothesis; the engine's sharded step with real killed processes: four ranks
train the examples' MLP with AdamW and float64 sums, the optimizer's state
sharded over two instances; a rank is SIGKILLed at a micro-batch, in the
gradient reduction, inside the optimizer step or inside the gather of the
parameters, in either instance. Survivors must end bit-identical to a
failure-free run, none left out, and a failure-free sharded run bit-identical
to the unsharded engine's.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import BIN, EXAMPLES
from unicron_elastic.api import ConfigError, ShardLostError
from unicron_elastic.strategy.engine.footprint import megatron_table
from unicron_elastic.strategy.engine.optimizer_shards import OptimizerShards, check_element_wise
from unicron_elastic.strategy.engine.shard_layout import ShardLayout, plan_pieces, share
from unicron_elastic.testing import Fault, fail_at, faults_env, kill_node, process_tree, run_workers

WORKER = os.path.join(EXAMPLES, "elastic_dp_worker.py")
B = 6  # micro-batches per step (global batch 24 in micro-batches of 4)
NUMEL = 8 * 16 + 16 + 16 + 1  # the MLP's 161 parameters
#: ``--grad-reduce-in-bf16`` against the exact reduction, three AdamW steps of the MLP: the parameters' relative
#: difference (9.8e-5 measured on 2026-12-02; docs/strategy.md, "Precision").
BF16_TOLERANCE = 1e-3


# -- pure decisions ------------------------------------------------------------------------------------
@given(st.integers(0, 500), st.integers(1, 9))
def test_shares_cover_the_range_once_in_order(numel: int, parts: int) -> None:
    bounds = [share(numel, i, parts) for i in range(parts)]
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert max(e - s for s, e in bounds) - min(e - s for s, e in bounds) <= 1


@given(st.lists(st.integers(0, 30), min_size=1, max_size=10, unique=True), st.integers(1, 4), st.integers(0, 300))
def test_every_instance_holds_the_whole_range_and_each_member_one_share(members: list[int], instances: int,
                                                                       numel: int) -> None:
    layout = ShardLayout(tuple(sorted(members)), instances)
    assert layout.copies == min(instances, len(members))
    seen = []
    for k in range(layout.copies):
        block = layout.instance(k)
        assert block, "every instance has a member"
        ranges = sorted(layout.range_of(m, numel) for m in block)
        assert ranges[0][0] == 0 and ranges[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        seen += block
    assert sorted(seen) == sorted(members)
    assert layout.range_of(max(members) + 1, numel) == (0, 0)


@given(st.lists(st.integers(0, 30), min_size=2, max_size=8, unique=True), st.integers(1, 4), st.integers(1, 300),
       st.data())
def test_a_lost_members_share_comes_from_another_instance_or_is_reported_lost(members: list[int], instances: int,
                                                                             numel: int, data) -> None:
    layout = ShardLayout(tuple(sorted(members)), instances)
    lost = set(data.draw(st.lists(st.sampled_from(members), max_size=len(members) - 1)))
    held = [layout.range_of(m, numel) if m not in lost else (0, 0) for m in layout.members]
    covered = sorted({i for start, end in held for i in range(start, end)})
    if covered != list(range(numel)):
        with pytest.raises(ShardLostError) as caught:
            plan_pieces(held, numel)
        assert caught.value.start not in covered
        return
    pieces = plan_pieces(held, numel)
    assert [p.start for p in pieces] == [0] + [p.end for p in pieces[:-1]] and pieces[-1].end == numel
    for piece in pieces:  # each piece comes from a rank that holds all of it
        start, end = held[piece.source]
        assert start <= piece.start < piece.end <= end
    if not lost:  # as few pieces as the instance with the fewest (non-empty) shares has
        fewest = min(sum(1 for m in layout.instance(k) if layout.range_of(m, numel)[1] > layout.range_of(m, numel)[0])
                     for k in range(layout.copies))
        assert len(pieces) <= fewest


@given(st.lists(st.integers(1, 12), min_size=1, max_size=8), st.randoms(use_true_random=False), st.integers(1, 5),
       st.integers(1, 3))
def test_a_share_of_the_flat_sum_holds_one_contiguous_range_of_each_group(sizes: list[int], rng, parts: int,
                                                                         groups: int) -> None:
    # The flat sum lays the parameters out in some order; each optimizer group keeps its own order. A member's
    # share of the flat sum, projected on a group, is one range of it; the ranges of the members cover each group
    # once, in order, and hold exactly the group's elements of that share (read_share hands them over).
    from unicron_elastic.strategy.engine.flat_group import FlatGroup
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    flat_order = list(range(len(params)))
    rng.shuffle(flat_order)
    flat_start, at = {}, 0
    for i in flat_order:
        flat_start[id(params[i])], at = at, at + sizes[i]
    with torch.no_grad():
        for p in params:  # each element's value: its flat position
            p.copy_(torch.arange(flat_start[id(p)], flat_start[id(p)] + p.numel(), dtype=torch.float32))
    owner = [rng.randrange(groups) for _ in params]
    for g in range(groups):
        members = [p for p, o in zip(params, owner) if o == g]
        if not members:
            continue
        group = FlatGroup(members, flat_start)
        assert group.in_flat_order(list(range(len(members)))) == group.order
        values = torch.cat([p.detach() for p in group.params])
        ranges = [group.project(*share(at, i, parts)) for i in range(parts)]
        nonempty = [r for r in ranges if r[1] > r[0]]
        assert nonempty[0][0] == 0 and nonempty[-1][1] == group.numel
        assert all(a[1] == b[0] for a, b in zip(nonempty, nonempty[1:]))
        for i, (start, end) in enumerate(ranges):
            lo, hi = share(at, i, parts)
            inside = values[(values >= lo) & (values < hi)]
            assert torch.equal(values[start:end], inside)
            flat_values = torch.arange(lo, hi, dtype=torch.float32)
            assert torch.equal(group.read_share(start, end, flat_values, lo), inside)


def test_an_optimizer_that_is_not_element_wise_is_refused_with_one_clear_error() -> None:
    model = torch.nn.Linear(3, 2)
    for optimizer in (torch.optim.LBFGS(model.parameters()),
                      type("MyAdam", (torch.optim.Adam,), {})(model.parameters())):
        with pytest.raises(ConfigError, match="cannot be sharded: the distributed optimizer needs an element-wise"):
            check_element_wise(optimizer)
    assert check_element_wise(torch.optim.AdamW(model.parameters()))[1] == ("step",)


def test_a_share_steps_as_those_elements_of_the_whole_step_to_the_bit() -> None:
    torch.manual_seed(0)
    whole = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    parts = [torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3)) for _ in range(3)]
    for part in parts:
        part.load_state_dict(whole.state_dict())
    reference = torch.optim.AdamW(whole.parameters(), lr=0.01, weight_decay=0.1)
    shards = []
    for index, part in enumerate(parts):  # three members in one instance: a share each
        shard = OptimizerShards(1, torch.device("cpu"), waiting=None, point=lambda kind: None, updated=lambda: None)
        shard.bind(torch.optim.AdamW(part.parameters(), lr=0.01, weight_decay=0.1), list(part.parameters()),
                   [0, 1, 2], index)
        shards.append(shard)
    for _ in range(4):
        grads = [torch.randn_like(p) for p in whole.parameters()]
        for params in [whole.parameters()] + [part.parameters() for part in parts]:
            for p, g in zip(params, grads):
                p.grad = g.clone()
        reference.step()
        for shard in shards:
            shard.optimizer.step()
    flat = torch.cat([p.detach().reshape(-1) for p in whole.parameters()])
    mine = torch.cat([shard.main[0].detach() for shard in shards])
    assert torch.equal(mine, flat)
    assert sum(s.state_bytes() for s in shards) == 12 * flat.numel() + 3 * 4  # main, two moments; a step each


def test_an_optimizer_with_state_already_is_refused() -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    shards = OptimizerShards(2, torch.device("cpu"), waiting=None, point=lambda kind: None, updated=lambda: None)
    with pytest.raises(ConfigError, match="already has state"):
        shards.bind(optimizer, list(model.parameters()), [0, 1], 0)


def _bf16_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3)).to(torch.bfloat16)


def _one_rank_shards(model: torch.nn.Module) -> tuple[OptimizerShards, object]:
    """The sharded optimizer of one member over a gloo group of one (in-process)."""
    import torch.distributed as dist

    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    shards = OptimizerShards(1, torch.device("cpu"), waiting=lambda what: contextlib.nullcontext(),
                             point=lambda kind: None, updated=lambda: None, wait=lambda pg, work: work.wait())
    shards.bind(torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1), list(model.parameters()), [0], 0)
    return shards, pg


def test_bf16_parameters_step_float32_main_parameters_from_float32_gradients_and_checkpoints_hold_them() -> None:
    from unicron_elastic.strategy.engine.optimizer_shards import MAIN_PARAM
    from unicron_elastic.strategy.engine.shard_checkpoint import collect, load

    model = _bf16_model()
    shards, pg = _one_rank_shards(model)
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]  # Megatron's main params
    reference = torch.optim.AdamW(masters, lr=0.01, weight_decay=0.1)
    for step in range(3):
        grads = [torch.randn(p.shape) * 1e-3 for p in masters]  # (bfloat16 would round them: 8 bits of mantissa)
        for p, m, g in zip(model.parameters(), masters, grads):
            p.grad, p.main_grad, m.grad = None, g.clone(), g.clone()  # what the engine sets (half_main_grads)
        reference.step()
        shards.optimizer.step()
        shards.refresh(pg, [0], 0, generation=1)  # the gather rounds the main parameters into the model
    flat = torch.cat([m.detach().reshape(-1) for m in masters])
    assert torch.equal(shards.main[0].detach(), flat)  # float32 updates of float32 gradients, not rounded ones
    assert all(torch.equal(p.detach(), m.detach().to(torch.bfloat16)) for p, m in zip(model.parameters(), masters))
    assert not torch.equal(flat, torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]))
    whole = collect(shards, pg, 0)  # a checkpoint's state: each parameter's float32 main parameter beside its moments
    assert all(torch.equal(whole["state"][i][MAIN_PARAM], m.detach()) for i, m in enumerate(masters))
    for resume in ("checkpoint", "tier"):  # a model loaded from the checkpoint holds the rounded values only
        restored = _bf16_model()
        restored.load_state_dict(model.state_dict())
        again, _ = _one_rank_shards(restored)
        if resume == "checkpoint":
            again.optimizer.load_state_dict(whole)  # Lightning's restore (the pre-hook takes this rank's share)
        else:
            load(again, whole, everything=True)  # the rank that resumes a group from a snapshot
        assert torch.equal(again.main[0].detach(), flat), resume
        moments = torch.cat([reference.state[m]["exp_avg"].reshape(-1) for m in masters])
        assert torch.equal(again.optimizer.state[again.main[0]]["exp_avg"], moments), resume


def test_the_gradient_buffer_hands_half_parameters_their_reduced_sum_as_main_grad_unrounded() -> None:
    from unicron_elastic.strategy.engine.gradients import GradientBuffer, optimizer_gradient

    model = _bf16_model()
    params = list(model.parameters())
    buffer = GradientBuffer(params, torch.float32, None, half_main_grads=True)
    local, _ = buffer.zeros(reuse=True)
    local.copy_(torch.randn(local.numel()))
    buffer.reduce_buffer(local, 0)[: local.numel()].copy_(local)
    buffer.set_gradients(3.0, poisoned=False)
    expected = buffer.views(local / 3.0)[1]
    for p, want in zip(params, expected):
        assert p.grad is None and p.main_grad.dtype == torch.float32 and torch.equal(optimizer_gradient(p), want)
    buffer.release()
    assert not any(hasattr(p, "main_grad") for p in params)
    rounded = GradientBuffer(params, torch.float32, None)  # unsharded: the optimizer steps the bf16 parameters
    rounded.reduce_buffer(local, 0)[: local.numel()].copy_(local)
    rounded.set_gradients(1.0, poisoned=False)
    assert all(p.grad.dtype == torch.bfloat16 for p in params)


@given(st.lists(st.integers(1, 40), min_size=1, max_size=6), st.floats(1e-3, 10.0), st.integers(0, 2**31 - 1))
def test_clipping_gradient_tensors_equals_torchs_clipping_of_parameters_to_the_bit(sizes: list[int], clip: float,
                                                                                   seed: int) -> None:
    from unicron_elastic.strategy.lightning.clipping import clip_by_norm, clip_by_value, scale_to_norm

    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    grads = [torch.randn(n, generator=generator) for n in sizes]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    ours = [g.clone() for g in grads]
    assert torch.equal(clip_by_norm(ours, clip), torch.nn.utils.clip_grad_norm_(params, clip))
    assert all(torch.equal(a, p.grad) for a, p in zip(ours, params))
    norm = torch.tensor(2.5)
    scale_to_norm(ours, clip, norm)
    torch.nn.utils.clip_grads_with_norm_(params, clip, norm)
    clip_by_value(ours, clip / 4)
    torch.nn.utils.clip_grad_value_(params, clip / 4)
    assert all(torch.equal(a, p.grad) for a, p in zip(ours, params))


# -- the engine's sharded step with killed processes ----------------------------------------------------
def train(out: Path, *extra: str, faults=(), world: int = 4) -> list[subprocess.CompletedProcess]:
    args = ["--steps", "3", "--out", str(out), "--bucket-numel", "64", "--grad-dtype", "float64",
            "--optimizer", "adamw", *extra]
    return run_workers(WORKER, world, args, faults_env(list(faults), str(out / "faults.log")), timeout=120)


def _params(out: Path, rank: int) -> list[torch.Tensor]:
    return torch.load(out / f"params{rank}.pt")


def _bytes(out: Path, rank: int) -> int:
    return json.loads((out / f"state{rank}.json").read_text())["optimizer_state_bytes"]


def _unsharded_reference(out: Path, steps: int) -> list[torch.Tensor]:
    """Rank 0's parameters after a failure-free unsharded run of ``steps`` (four ranks, AdamW, float64 sums)."""
    results = run_workers(WORKER, 4, ["--steps", str(steps), "--out", str(out), "--grad-dtype", "float64",
                                      "--optimizer", "adamw"], timeout=120)
    assert [r.returncode for r in results] == [0] * 4
    return _params(out, 0)


def _unicron_run(out: Path, faults: list, steps: int, *extra: str) -> subprocess.CompletedProcess:
    """The sharded worker (two instances) under ``unicron-run --standalone`` on four ranks, with ``faults``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=BIN + os.pathsep + os.environ["PATH"])
    env.update(faults_env(faults, str(out / "faults.log")))
    cmd = [os.path.join(BIN, "unicron-run"), "--standalone", "--nproc-per-node=4", "--log-format=json",
           "--monitor-interval=0.05", WORKER, "--steps", str(steps), "--out", str(out), "--grad-dtype", "float64",
           "--optimizer", "adamw", "--optimizer-instances", "2", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)


@pytest.fixture(scope="session")
def sharded_baseline(failure_free) -> list[torch.Tensor]:
    """A failure-free sharded run (DP 4, 2 instances), checked against the unsharded engine's."""
    def reference_run(out: Path) -> list[torch.Tensor]:
        unsharded, sharded = out / "unsharded", out / "sharded"
        assert [r.returncode for r in train(unsharded)] == [0] * 4
        results = train(sharded, "--optimizer-instances", "2")
        assert [r.returncode for r in results] == [0] * 4, results[0].stderr[-3000:]
        reference = _params(unsharded, 0)
        for rank in range(4):
            assert all(torch.equal(a, b) for a, b in zip(_params(sharded, rank), reference)), f"rank {rank}"
        # Optimizer state per rank: 12 bytes (fp32 main parameter, two moments) x P / (DP / I), plus a step counter
        share_bytes = 12 * NUMEL / (4 / 2)
        per_rank = [_bytes(sharded, rank) for rank in range(4)]
        print(f"optimizer state bytes per rank: sharded {per_rank} (12 x P / (DP / I) = {share_bytes:.0f}), "
              f"unsharded {[_bytes(unsharded, rank) for rank in range(4)]}")
        assert all(abs(b - share_bytes) <= 0.05 * share_bytes for b in per_rank)
        assert all(_bytes(unsharded, rank) == 8 * NUMEL + 4 * 4 for rank in range(4))  # two moments, 4 steps
        return reference

    return failure_free("test_optimizer_shards.sharded_baseline", reference_run)


POINTS = {"micro-batch": {}, "reduction": dict(bucket=2), "optimizer-step": dict(at="optimizer_step"),
          "gather": dict(at="gather")}


#: The victim the e2e tier kills at each point (the default tier: the gather's); the other instance's is in matrix.
KILLED = {"micro-batch": 1, "reduction": 2, "optimizer-step": 1, "gather": 2}
#: The victim the e2e tier restarts at each point: the other instance's than ``KILLED``'s (the rest in matrix).
RESTARTED = {point: 3 - victim for point, victim in KILLED.items()}


def _cases(chosen: dict[str, int], default: tuple[str, int] | None = None) -> list:
    """Each point, a victim in each instance (ranks 0-1, 2-3): ``chosen``'s in e2e (``default``: in the default
    tier), the other in matrix."""
    def marks(point: str, victim: int) -> tuple:
        if (point, victim) == default:
            return ()
        return (pytest.mark.e2e,) if chosen[point] == victim else (pytest.mark.matrix,)

    return [pytest.param(point, victim, id=f"{point}-{victim}", marks=marks(point, victim))
            for point in POINTS for victim in (1, 2)]


def _fault(point: str, victim: int, step: int) -> Fault:
    """A kill of ``victim`` at ``point`` of ``step`` (at a micro-batch: one of its own, B = 6 over 4 ranks)."""
    return fail_at(rank=victim, step=step, **(dict(POINTS[point]) or dict(micro_batch=victim + 4 if victim < 2
                                                                             else victim)))


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("point", "victim"), _cases(KILLED, default=("gather", 2)))
def test_a_rank_killed_anywhere_in_the_sharded_step_costs_no_other_rank_a_restart(tmp_path: Path, sharded_baseline,
                                                                                  point: str, victim: int) -> None:
    results = train(tmp_path, "--optimizer-instances", "2", faults=[_fault(point, victim, 1)])
    assert len((tmp_path / "faults.log").read_text().splitlines()) == 1, "the fault did not fire"
    assert results[victim].returncode == -9
    for rank in (r for r in range(4) if r != victim):  # none left out, none restarted: each finished every step
        assert results[rank].returncode == 0, results[rank].stderr[-3000:]
        reports = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert [rep["step"] for rep in reports] == [0, 1, 2]
        assert sorted(d for rep in reports for d in rep["dead"]) == [victim]
        assert all(torch.equal(a, b) for a, b in zip(_params(tmp_path, rank), sharded_baseline)), f"rank {rank}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("victim", [1, pytest.param(2, marks=(pytest.mark.e2e, pytest.mark.matrix))],
                         ids=["a-source", "not-a-source"])
def test_overlapped_gather_a_rank_killed_in_it_costs_no_other_rank_a_restart(tmp_path: Path, sharded_baseline,
                                                                              victim: int) -> None:
    # Rank 1 sends the second piece of the gather (instance 0 holds the pieces sent): killed after the first piece
    # started, it never sends its own, so the survivors' forward waits fail (GatherFailed) and they compute after
    # the step's regroup. Rank 2 sends none (gloo's broadcast may still pass through it).
    overlapped = ("--optimizer-instances", "2", "--overlap-param-gather")
    results = train(tmp_path, *overlapped, faults=[fail_at(rank=victim, step=1, at="gather")])
    assert len((tmp_path / "faults.log").read_text().splitlines()) == 1, "the fault did not fire"
    assert results[victim].returncode == -9
    for rank in (r for r in range(4) if r != victim):
        assert results[rank].returncode == 0, results[rank].stderr[-3000:]
        reports = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert [rep["step"] for rep in reports] == [0, 1, 2]
        assert sorted(d for rep in reports for d in rep["dead"]) == [victim]
        said = results[rank].stdout + results[rank].stderr
        assert victim != 1 or "the parameters' gather failed" in said, (rank, said[-2000:])
        assert all(torch.equal(a, b) for a, b in zip(_params(tmp_path, rank), sharded_baseline)), f"rank {rank}"


@pytest.mark.e2e
@pytest.mark.matrix
@pytest.mark.timeout(240)
def test_overlapped_gather_failure_free_equals_the_gather_before_the_step(tmp_path: Path, sharded_baseline) -> None:
    results = train(tmp_path, "--optimizer-instances", "2", "--overlap-param-gather")
    assert [r.returncode for r in results] == [0] * 4, results[0].stderr[-3000:]
    for rank in range(4):
        assert all(torch.equal(a, b) for a, b in zip(_params(tmp_path, rank), sharded_baseline)), f"rank {rank}"


@pytest.mark.timeout(240)
def test_grad_reduce_in_bf16_trains_within_bfloat16s_rounding_of_the_exact_reduction(tmp_path: Path,
                                                                                     sharded_baseline) -> None:
    # Every bucket but the last (the step's totals and slots) is all-reduced in bfloat16: the parameters differ
    # from the exact reduction's by the rounding of each sum to 8 bits of mantissa, not more.
    results = train(tmp_path, "--optimizer-instances", "2", "--grad-reduce-in-bf16")
    assert [r.returncode for r in results] == [0] * 4, results[0].stderr[-3000:]
    for rank in range(4):
        ours = torch.cat([p.reshape(-1) for p in _params(tmp_path, rank)])
        exact = torch.cat([p.reshape(-1) for p in sharded_baseline])
        assert torch.equal(ours, torch.cat([p.reshape(-1) for p in _params(tmp_path, 0)])), rank  # all ranks alike
        print(f"rank {rank}: relative difference {float((ours - exact).norm() / exact.norm()):.2e}")
        assert not torch.equal(ours, exact)  # (the wire is bfloat16)
        assert float((ours - exact).norm() / exact.norm()) <= BF16_TOLERANCE, rank


def _bytes_per_parameter(out: Path, rank: int) -> float:
    """Every byte the rank's engine kept alive at the end, per parameter (``footprint.engine_bytes``)."""
    state = json.loads((out / f"state{rank}.json").read_text())
    return state["held_bytes"] / state["parameters"]


@pytest.mark.timeout(240)
def test_reduce_scatter_equals_the_all_reduce_to_the_bit_and_each_rank_keeps_a_share_of_the_sum(
        tmp_path: Path, sharded_baseline) -> None:
    # One instance, the buckets reduce-scattered (each rank receives its share of the flat sum), the parameters
    # gathered into the next forward: float64 sums make the result the unsharded engine's, to the bit.
    results = train(tmp_path, "--optimizer-instances", "1", "--reduce-scatter", "--overlap-param-gather")
    assert [r.returncode for r in results] == [0] * 4, results[0].stderr[-3000:]
    for rank in range(4):
        assert all(torch.equal(a, b) for a, b in zip(_params(tmp_path, rank), sharded_baseline)), f"rank {rank}"
        # float32 parameters (the main parameters are views of them) 4 + float64 local sum 8 + its reduced share
        # 8/4 + AdamW's moments 8/4 = 16 (and the slots and step counters: 1.4 over the MLP's 161 parameters);
        # all-reduced, the reduce buffer alone would hold another 6
        held = _bytes_per_parameter(tmp_path, rank)
        assert 16 <= held <= 18, (rank, held)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.compat), torch.bfloat16],
                         ids=["float32", "bfloat16"])  # (compat: gloo's uneven reduce-scatter on torch 2.8)
def test_reduce_scatter_holds_at_most_115x_megatrons_bytes_per_parameter_at_dp4(tmp_path: Path,
                                                                                dtype: torch.dtype) -> None:
    # Megatron-LM's table (its distributed optimizer, float32 gradients, Adam): 8 + 8/d with float32 parameters,
    # 6 + 12/d with bfloat16 ones; every storage the engine keeps alive is counted, the worst rank's
    results = train(tmp_path, "--optimizer-instances", "1", "--reduce-scatter", "--grad-dtype", "float32",
                    "--width", "512", "--bucket-numel", "1000", "--param-dtype", str(dtype).removeprefix("torch."))
    assert [r.returncode for r in results] == [0] * 4, results[0].stderr[-3000:]
    worst = max(_bytes_per_parameter(tmp_path, rank) for rank in range(4))
    table = megatron_table(dtype, 4)
    print(f"{dtype}: worst rank {worst:.3f} bytes per parameter, Megatron-LM's table {table:.2f}: "
          f"{worst / table:.3f}x")
    assert worst <= 1.15 * table


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_reduce_scattered_clipping_scales_every_share_by_the_whole_gradients_norm(tmp_path: Path) -> None:
    # Each rank clips its share by the norm of all of them (the squared norms summed in the step's last exchange):
    # the result is torch's clip_grad_norm_ of the whole gradient, up to the norm's rounding (float64 over the
    # shares against torch's over the parameters' gradients); clipping is active at every step.
    clipped = ("--optimizer-instances", "1", "--clip-grad", "0.05")
    ours, theirs = tmp_path / "reduce-scatter", tmp_path / "all-reduce"
    for out, extra in ((ours, ("--reduce-scatter",)), (theirs, ())):
        results = train(out, *clipped, *extra)
        assert [r.returncode for r in results] == [0] * 4, results[0].stderr[-3000:]
    unclipped = tmp_path / "unclipped"
    assert [r.returncode for r in train(unclipped, "--optimizer-instances", "1", "--reduce-scatter")] == [0] * 4
    flat = [torch.cat([p.reshape(-1) for p in _params(out, 0)]) for out in (ours, theirs, unclipped)]
    assert float((flat[0] - flat[1]).norm() / flat[1].norm()) <= 1e-6
    assert float((flat[2] - flat[1]).norm() / flat[1].norm()) >= 1e-4  # (the clipping changed the trajectory)


REJOIN_STEPS = 8


@pytest.fixture(scope="session")
def unsharded_8_steps(failure_free) -> list[torch.Tensor]:
    """Rank 0's parameters after a failure-free unsharded run of 8 steps (four ranks, AdamW, float64 sums)."""
    return failure_free("test_optimizer_shards.unsharded_8_steps",
                        lambda out: _unsharded_reference(out, REJOIN_STEPS))


def _restarted(log: str) -> list[int]:
    """The ranks the agent restarted, from its JSON log (``--log-format=json``)."""
    events = (json.loads(line) for line in log.splitlines() if line.startswith("{"))
    return sorted(e["rank"] for e in events if e.get("event") == "worker_restarted")


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("point", "victim"), _cases(RESTARTED))
def test_a_killed_rank_is_restarted_and_rejoins_with_its_share_from_the_other_instance(
        tmp_path: Path, unsharded_8_steps, point: str, victim: int) -> None:
    result = _unicron_run(tmp_path, [_fault(point, victim, 1)], REJOIN_STEPS, "--step-time", "0.3",
                          "--hold-for-joiner", str(REJOIN_STEPS - 2), "--bucket-numel", "64")
    assert result.returncode == 0, result.stderr[-3000:]
    assert len((tmp_path / "faults.log").read_text().splitlines()) == 1, "the fault did not fire"
    assert _restarted(result.stdout + result.stderr) == [victim]  # nobody else restarted
    back = json.loads((tmp_path / f"rank{victim}.json").read_text())
    assert back[0]["state_from"] == "replica" and 2 <= back[0]["joined_at"] < REJOIN_STEPS
    for rank in range(4):  # the rejoiner too: its share came from the other instance, its parameters by the gather
        assert all(torch.equal(a, b) for a, b in zip(_params(tmp_path, rank), unsharded_8_steps)), f"rank {rank}"


@pytest.mark.e2e
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("extra", "fault"), [
    ((), dict(micro_batch=3)), (("--reduce-scatter",), dict(at="backward"))], ids=["all-reduce", "reduce-scatter"])
def test_one_instance_a_lost_share_stops_the_survivors_with_shard_lost(tmp_path: Path, extra: tuple,
                                                                       fault: dict) -> None:
    # (reduce-scattered: killed while its first bucket is in flight and backward still runs)
    results = train(tmp_path, "--optimizer-instances", "1", *extra, faults=[fail_at(rank=3, step=1, **fault)])
    assert len((tmp_path / "faults.log").read_text().splitlines()) == 1, "the fault did not fire"
    assert results[3].returncode == -9
    for rank in range(3):
        assert results[rank].returncode != 0
        assert "ShardLostError: optimizer state elements [120, 161) were held only by lost ranks" in \
            results[rank].stderr
        assert "optimizer_state_without_copy" in results[rank].stdout + results[rank].stderr  # said at the start


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_reduce_scattered_a_rank_admitted_at_step_1_scatters_over_the_new_layout_on_the_trajectory(
        tmp_path: Path, sharded_baseline) -> None:
    # DP 3 then 4 with one instance: the joiner gets its share from the members, every bucket of step 1 is
    # scattered over the four members' shares, and the global batch is the same at both sizes.
    results = train(tmp_path, "--optimizer-instances", "1", "--reduce-scatter", "--members", "0,1,2",
                    "--member-schedule", json.dumps({"1": [0, 1, 2, 3]}))
    assert [r.returncode for r in results] == [0] * 4, [r.stderr[-2000:] for r in results]
    for rank in range(4):
        assert all(torch.equal(a, b) for a, b in zip(_params(tmp_path, rank), sharded_baseline)), f"rank {rank}"


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_scale_in_4_3_and_out_to_4_reshards_and_keeps_the_trajectory(tmp_path: Path, sharded_baseline) -> None:
    schedule = json.dumps({"1": [0, 1, 2], "2": [0, 1, 2, 3]})
    results = train(tmp_path, "--optimizer-instances", "2", "--member-schedule", schedule)
    assert [r.returncode for r in results] == [0] * 4, [r.stderr[-2000:] for r in results]
    assert json.loads((tmp_path / "rank3.json").read_text())[-1] == {"retired_at": 1}
    for rank in range(3):  # the global batch is the same at every size: float64 sums make it exact
        assert all(torch.equal(a, b) for a, b in zip(_params(tmp_path, rank), sharded_baseline)), f"rank {rank}"
    assert len(json.loads((tmp_path / "rank0.json").read_text())[1]["micro_batches"]) == 2  # B = 6 over 3


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_a_node_lost_for_good_shrinks_dp_4_to_3_and_its_return_grows_it_to_4_on_the_trajectory(
        etcd, tmp_path: Path, unsharded_8_steps) -> None:
    """Four one-rank nodes, ``--nnodes=3:4``: rank 3's node is SIGKILLed (launcher and worker); the three others
    go on at DP 3 (the shares resharded in memory, rank 3's from the other instance); the node started again joins
    and the shares are resharded over 4. Every rank ends bit-identical to the failure-free run (float64 sums: the
    trajectory does not depend on the DP size)."""
    from test_node_loss import _start, _wait_for_fault

    run_id = "sharded-node-loss"
    cmd = [os.path.join(BIN, "unicron-run"), f"--rdzv-endpoint={etcd.endpoint}", f"--rdzv-id={run_id}",
           "--nnodes=3:4", "--nproc-per-node=1", "--monitor-interval=0.05", "--log-format=json",
           f"--rdzv-conf=cluster={run_id},keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=1",
           WORKER, "--steps", str(REJOIN_STEPS), "--grad-dtype", "float64", "--optimizer", "adamw",
           "--optimizer-instances", "2", "--step-time", "0.2", "--hold-for-joiner", str(REJOIN_STEPS - 2),
           "--progress", "--out", str(tmp_path)]
    fault = fail_at(rank=3, step=1, micro_batch=3, kind="hang")  # parked in its micro-batch, then its node is lost
    launchers = _start(cmd, tmp_path, [fault], 4)
    again: list[subprocess.Popen] = []
    try:
        fired = _wait_for_fault(tmp_path, launchers)
        victim = next(i for i, p in enumerate(launchers) if fired["pid"] in process_tree(p.pid))
        kill_node(launchers[victim].pid)
        progress, deadline = tmp_path / "progress0", time.monotonic() + 120
        while not (progress.exists() and int(progress.read_text()) >= 2):  # a step at DP 3 after the failed one
            assert time.monotonic() < deadline, "the survivors did not train a step at DP 3"
            assert all(p.poll() is None for i, p in enumerate(launchers) if i != victim)
            time.sleep(0.05)
        again = _start(cmd, tmp_path, [fault], 1, first=4)  # the node comes back, same flags
        survivors = [p for i, p in enumerate(launchers) if i != victim]
        codes = [p.wait(timeout=240) for p in [*survivors, *again]]
    finally:
        for p in [*launchers, *again]:
            if p.poll() is None:
                kill_node(p.pid)
    assert codes == [0, 0, 0, 0], (tmp_path / "node4.log").read_text()[-3000:]
    ranks = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)}
    for r in (0, 1, 2):  # one process each, every step; the lost rank's share taken from the other instance
        assert [rep["step"] for rep in ranks[r]] == list(range(REJOIN_STEPS))
        assert len({rep["pid"] for rep in ranks[r]}) == 1
        assert ranks[r][1]["dead"] == [3]
    sizes = [len(rep["micro_batches"]) for rep in ranks[0]]  # B = 6: 2 a rank at DP 3, [2, 2, 1, 1] at DP 4
    assert sizes[2] == 2 and ranks[0][-1]["micro_batches"] == [0, 4], sizes
    assert ranks[3][0]["state_from"] == "replica" and 2 <= ranks[3][0]["joined_at"] < REJOIN_STEPS
    for rank in range(4):
        assert all(torch.equal(a, b) for a, b in zip(_params(tmp_path, rank), unsharded_8_steps)), f"rank {rank}"


# -- under Lightning: UnicronMegatronStrategy(distributed_optimizer=True) -------------------------------
GPT = os.path.join(EXAMPLES, "lightning_gpt.py")
SHARDED = ("--distributed-optimizer", "--optimizer-instances", "2")


def fit(out: Path, faults=(), *args: str, world: int = 4, steps: int = 8) -> subprocess.CompletedProcess:
    """The examples' GPT (AdamW, float64 sums) under ``unicron-run`` on ``world`` ranks."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **faults_env(list(faults), str(out / "faults.log")))
    cmd = [os.path.join(BIN, "unicron-run"), "--standalone", f"--nproc-per-node={world}", "--monitor-interval=0.05",
           GPT, "--steps", str(steps), "--out", str(out), *args]
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)


def _optimizer_state(path: Path) -> dict:
    return torch.load(path, weights_only=False)["optimizer_states"][0]


def _same_optimizer_state(ours: dict, reference: dict) -> bool:
    return ours["param_groups"] == reference["param_groups"] and ours["state"].keys() == reference["state"].keys() \
        and all(torch.equal(ours["state"][i][k], v) for i, s in reference["state"].items() for k, v in s.items())


@pytest.fixture(scope="session")
def gpt_baseline(failure_free) -> Path:
    """A failure-free unsharded fit of 8 steps on 4 ranks (its parameters and final checkpoint)."""
    def reference_run(out: Path) -> Path:
        proc = fit(out)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return out

    return failure_free("test_optimizer_shards.gpt_baseline", reference_run)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_lightning_sharded_fit_equals_the_unsharded_one_checkpoint_included(tmp_path: Path, gpt_baseline) -> None:
    proc = fit(tmp_path, (), *SHARDED)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = _params(gpt_baseline, 0)
    for rank in range(4):
        assert all(torch.equal(a, b) for a, b in zip(_params(tmp_path, rank), reference)), f"rank {rank}"
    # trainer.save_checkpoint after fit: the whole optimizer state, in the unsharded optimizer's format
    assert _same_optimizer_state(_optimizer_state(tmp_path / "final.ckpt"), _optimizer_state(gpt_baseline / "final.ckpt"))


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_lightning_overlapped_gather_snapshots_and_checkpoint_hold_the_gathered_parameters(
        tmp_path: Path, gpt_baseline) -> None:
    # With overlap_param_gather the model holds the previous step's parameters between steps: the snapshot taken
    # before each step and the checkpoint after fit wait for the gather first. Every rank lost at step 3 resumes
    # from the memory snapshot: bit-identical to the unsharded fit only if that snapshot held the gathered
    # parameters; the checkpoint written after fit too.
    proc = fit(tmp_path, [fail_at(rank=r, step=3, micro_batch=r) for r in range(4)], *SHARDED,
               "--overlap-param-gather", "--snapshot-every", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len((tmp_path / "faults.log").read_text().splitlines()) == 4
    assert all(json.loads((tmp_path / f"rank{r}.json").read_text())["state_from"] == "memory" for r in range(4))
    for rank in range(4):
        assert all(torch.equal(a, b) for a, b in zip(_params(tmp_path, rank), _params(gpt_baseline, 0))), rank
    assert _same_optimizer_state(_optimizer_state(tmp_path / "final.ckpt"),
                                 _optimizer_state(gpt_baseline / "final.ckpt"))
    final = torch.load(tmp_path / "final.ckpt", weights_only=False)["state_dict"]
    reference = torch.load(gpt_baseline / "final.ckpt", weights_only=False)["state_dict"]
    assert final.keys() == reference.keys() and all(torch.equal(final[k], reference[k]) for k in reference)


@pytest.mark.e2e
@pytest.mark.matrix
@pytest.mark.timeout(300)
def test_lightning_overlapped_gather_a_rank_killed_in_it_rejoins_with_its_share(tmp_path: Path, gpt_baseline) -> None:
    proc = fit(tmp_path, [fail_at(rank=1, step=2, at="gather")], *SHARDED, "--overlap-param-gather",
               "--step-time", "0.3", "--hold-for-joiner", "6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len((tmp_path / "faults.log").read_text().splitlines()) == 1
    assert json.loads((tmp_path / "rank1.json").read_text())["state_from"] == "replica"
    for rank in range(4):
        assert all(torch.equal(a, b) for a, b in zip(_params(tmp_path, rank), _params(gpt_baseline, 0))), rank


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("victim", [1, 2], ids=["instance0", "instance1"])
def test_lightning_a_rank_killed_in_the_gather_rejoins_with_its_share(tmp_path: Path, gpt_baseline,
                                                                     victim: int) -> None:
    # Rank 1's share is the one the others gather from afterwards (the lowest holder): a rejoiner that lost
    # its optimizer state when Lightning restored it would make every rank diverge.
    proc = fit(tmp_path, [fail_at(rank=victim, step=2, at="gather")], *SHARDED, "--step-time", "0.3",
               "--hold-for-joiner", "6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len((tmp_path / "faults.log").read_text().splitlines()) == 1
    back = json.loads((tmp_path / f"rank{victim}.json").read_text())
    assert back["state_from"] == "replica" and 3 <= back["joined_at"] < 8
    for rank in range(4):  # survivors and the rejoiner: bit-identical to the failure-free unsharded fit
        assert all(torch.equal(a, b) for a, b in zip(_params(tmp_path, rank), _params(gpt_baseline, 0))), rank


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_lightning_every_rank_lost_resumes_the_sharded_state_from_the_memory_snapshot(tmp_path: Path,
                                                                                    gpt_baseline) -> None:
    proc = fit(tmp_path, [fail_at(rank=r, step=3, micro_batch=r) for r in range(4)], *SHARDED,
               "--snapshot-every", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len((tmp_path / "faults.log").read_text().splitlines()) == 4
    for rank in range(4):
        summary = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert summary["state_from"] == "memory" and summary["global_step"] == 8
        assert all(torch.equal(a, b) for a, b in zip(_params(tmp_path, rank), _params(gpt_baseline, 0))), rank


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_lightning_validation_after_a_failed_gather_sees_the_gathered_parameters(tmp_path: Path, gpt_baseline) -> None:
    # Validation runs between the optimizer step (whose gather failed: the parameters are stale) and the next
    # step's regroup: the members regroup and gather first.
    reference, faulty = tmp_path / "reference", tmp_path / "faulty"
    assert fit(reference, (), "--val-every", "1").returncode == 0
    proc = fit(faulty, [fail_at(rank=2, step=2, at="gather")], *SHARDED, "--val-every", "1", "--step-time", "0.3",
               "--hold-for-joiner", "6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len((faulty / "faults.log").read_text().splitlines()) == 1
    validated = json.loads((reference / "rank0.json").read_text())["validated"]
    assert sorted(validated, key=int) == [str(s) for s in range(1, 9)]
    for rank in (0, 1, 3):  # the survivors validated after every step with the failure-free run's parameters
        assert json.loads((faulty / f"rank{rank}.json").read_text())["validated"] == validated, rank
        assert all(torch.equal(a, b) for a, b in zip(_params(faulty, rank), _params(gpt_baseline, 0))), rank


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_lightning_one_instance_a_lost_rank_returns_every_rank_to_the_newest_snapshots_step(tmp_path: Path,
                                                                                         gpt_baseline) -> None:
    proc = fit(tmp_path, [fail_at(rank=3, step=5, micro_batch=3)], "--distributed-optimizer",
               "--optimizer-instances", "1", "--snapshot-every", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len((tmp_path / "faults.log").read_text().splitlines()) == 1
    log = proc.stdout + proc.stderr
    assert "optimizer_state_without_copy" in log and "a lost rank costs every rank a return to the newest " \
        "snapshot or checkpoint (in-memory snapshots every 2 steps; none saved in this run yet)" in log  # at fit
    assert "optimizer_state_lost" in log and "returns_to='step 4, the newest snapshot or checkpoint saved" in log
    for rank in range(4):  # every rank went back to step 4 and trained on: the failure-free fit's parameters
        summary = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert summary["state_from"] == "memory" and summary["joined_at"] == 4 and summary["global_step"] == 8
        assert all(torch.equal(a, b) for a, b in zip(_params(tmp_path, rank), _params(gpt_baseline, 0))), rank


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_a_checkpoint_written_at_dp4_i2_resumes_at_dp2_i1_with_equal_parameters_and_state(tmp_path: Path,
                                                                                      gpt_baseline) -> None:
    first, second = tmp_path / "dp4", tmp_path / "dp2"
    proc = fit(first, (), *SHARDED, steps=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = fit(second, (), "--distributed-optimizer", "--optimizer-instances", "1", "--ckpt-path",
               str(first / "final.ckpt"), world=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(2):  # the global batch is the same at DP 2: float64 sums make the trajectory exact
        assert all(torch.equal(a, b) for a, b in zip(_params(second, rank), _params(gpt_baseline, 0))), rank
    assert _same_optimizer_state(_optimizer_state(second / "final.ckpt"), _optimizer_state(gpt_baseline / "final.ckpt"))


def test_float64_parameters_are_refused_with_the_precision_to_use_and_half_ones_are_accepted() -> None:
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    from unicron_elastic.strategy.lightning.fit_checks import check_parameter_dtypes

    def plugin(precision: str):
        return _AcceleratorConnector(accelerator="cpu", precision=precision).precision_plugin

    with pytest.raises(ConfigError, match="use precision='bf16-true'.*'bf16-mixed' or '32-true'"):
        check_parameter_dtypes(torch.nn.Linear(2, 2), plugin("64-true"))  # (the plugin converts them later)
    with pytest.raises(ConfigError, match=r"weight is torch.float64"):
        check_parameter_dtypes(torch.nn.Linear(2, 2).double(), plugin("32-true"))
    for precision, dtype in (("bf16-true", torch.bfloat16), ("16-true", torch.float16), ("bf16-mixed", torch.float32)):
        check_parameter_dtypes(torch.nn.Linear(2, 2).to(dtype), plugin(precision))


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(optimizer_instances=2), "optimizer_instances needs distributed_optimizer=True"),
    (dict(distributed_optimizer=True, optimizer_instances=0), "optimizer_instances=0 must be >= 1"),
    (dict(overlap_param_gather=True), "overlap_param_gather needs distributed_optimizer=True"),
    (dict(distributed_optimizer=True, overlap_param_gather=True, tensor_model_parallel_size=2),
     r"pipeline_model_parallel_size = 1 \(got 2\)"),
])
def test_the_strategy_refuses_a_distributed_optimizer_it_cannot_train(kwargs: dict, message: str) -> None:
    from unicron_elastic.strategy.lightning import UnicronMegatronStrategy

    with pytest.raises(ConfigError, match=message):
        UnicronMegatronStrategy(**kwargs)


def test_the_engine_refuses_options_that_cannot_work_together() -> None:
    from unicron_elastic.strategy.engine import EngineOptions
    from unicron_elastic.strategy.engine.replicas import ModelParallel

    with pytest.raises(ConfigError, match="overlap_param_gather needs optimizer_instances"):
        EngineOptions(overlap_param_gather=True)
    with pytest.raises(ConfigError, match=r"TP x PP = 1 \(got 2\)"):
        EngineOptions(overlap_param_gather=True, optimizer_instances=1, model_parallel=ModelParallel(1, 2))
    assert EngineOptions(overlap_param_gather=True, optimizer_instances=2).overlap_param_gather
    with pytest.raises(ConfigError, match="reduce_dtype=torch.float16: None .* or torch.bfloat16"):
        EngineOptions(reduce_dtype=torch.float16)


def test_every_bucket_but_the_last_travels_in_the_wire_dtype() -> None:
    from unicron_elastic.strategy.engine.gradients import GradientBuffer

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (5, 7, 4)]
    buffer = GradientBuffer(params, torch.float32, 6, extras=2, wire_dtype=torch.bfloat16)
    local, _ = buffer.zeros(reuse=True)
    assert buffer.bounds == [(0, 6), (6, 12), (12, 18)]  # the extras are in the last bucket
    wires = [buffer.wire(k, local) for k in range(3)]
    assert [w.dtype for w in wires[:2]] == [torch.bfloat16] * 2 and [w.numel() for w in wires[:2]] == [6, 6]
    assert wires[2] is None  # the extras and the slots: exact
    assert GradientBuffer(params, torch.float32, 6, wire_dtype=torch.float32).wire(0, local) is None


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_lightning_sharded_clipping_by_norm_equals_the_unsharded_one(tmp_path: Path) -> None:
    # Lightning clips the optimizer's parameters; sharded, those are the shares, loaded after the clipping:
    # the strategy clips the model's reduced gradients by the whole norm instead.
    unsharded, sharded = tmp_path / "unsharded", tmp_path / "sharded"
    for out, extra in ((unsharded, ()), (sharded, SHARDED)):
        proc = fit(out, (), *extra, "--clip-grad", "0.05", steps=4)
        assert proc.returncode == 0, proc.stderr[-3000:]
    clipped_unclipped = fit(tmp_path / "free", (), steps=4)
    assert clipped_unclipped.returncode == 0
    assert not all(torch.equal(a, b) for a, b in zip(_params(unsharded, 0), _params(tmp_path / "free", 0)))  # it clips
    for rank in range(4):
        assert all(torch.equal(a, b) for a, b in zip(_params(sharded, rank), _params(unsharded, 0))), rank


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_every_rank_lost_and_nothing_saved_restarts_the_sharded_state_from_step_0(tmp_path: Path) -> None:
    steps = 6
    reference = _unsharded_reference(tmp_path / "reference", steps)
    result = _unicron_run(tmp_path, [fail_at(rank=r, step=2, micro_batch=r) for r in range(4)], steps,
                          "--step-time", "0.2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert len((tmp_path / "faults.log").read_text().splitlines()) == 4
    for rank in range(4):  # the lowest restarted rank holds all of the fresh state; its group reshards it
        back = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert back[0] == {"joined_at": 0, "state_from": "step0"}
        assert all(torch.equal(a, b) for a, b in zip(_params(tmp_path, rank), reference)), rank
