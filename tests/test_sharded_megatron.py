"""The distributed optimizer with megatron-core's ``GPTModel`` over TP x PP x DP (``examples/megatron_gpt.py``).

Each shard group is one model-parallel position across the data-parallel ranks: the strategy shards that
position's optimizer state over its replicas, in ``optimizer_instances`` instances. Megatron-LM's Llama 3
recipe at toy size (sequence parallelism, per-token loss, gradient-accumulation fusion, q/k layer norms, AdamW,
clipping by the global norm at 1.0, which clips every step here), float64 sums: the sharded run's parameters equal
the replicated run's bit for bit, on every rank, also after a rank is killed in the gather and its replica rejoins.
With bfloat16 parameters (``bf16-true``: float32 main parameters in the shares) the recipe trains within 1 % of the
float32 run's loss at every step, and recovers bit-identical to the failure-free bfloat16 run.
"""

from __future__ import annotations

import pytest
import torch

from test_megatron_gpt import shards, summary
from test_megatron_recipe import RECIPE, SLOW, launch
from unicron_elastic.strategy.engine.replicas import ModelParallel
from unicron_elastic.testing import fail_at

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
STEPS = 6
LLAMA = [*RECIPE, "--grad-dtype", "float64", *SLOW]
SHARDED = ["--distributed-optimizer", "--optimizer-instances", "2"]
TIED = ["--optimizer", "adamw", "--lr", "0.01", "--clip-grad", "0.5", "--bucket-numel", "3000", "--steps", str(STEPS),
        "--grad-dtype", "float64", *SLOW]  # the GPT of tied embeddings, summed across the two stages


BF16 = ["--precision", "bf16-true"]


def same_parameters(ours, theirs, ranks: range) -> None:
    for r in ranks:
        a, b = shards(ours, r), shards(theirs, r)
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name]["tensor"], b[name]["tensor"]), (r, name)


@pytest.fixture(scope="session")
def tp2_dp4_replicated(failure_free):
    """The recipe at TP=2 x DP=4 with every rank keeping the whole optimizer state (trained once per session)."""
    def reference_run(out):
        launch(out, 2, 1, 4, LLAMA)
        return out

    return failure_free("test_sharded_megatron.tp2_dp4_replicated", reference_run)


def test_tp2_dp4_sharded_equals_the_replicated_engine_with_a_quarter_of_the_state_per_rank(tmp_path,
                                                                                          tp2_dp4_replicated) -> None:
    launch(tmp_path, 2, 1, 4, [*LLAMA, *SHARDED])
    same_parameters(tmp_path, tp2_dp4_replicated, range(8))
    for r in range(8):  # 12 bytes (fp32 main parameter, two moments) x P / (DP / I), P: the rank's shard of the model
        ran, replicated = summary(tmp_path, r), summary(tp2_dp4_replicated, r)
        target = 12 * ran["parameters"] / (4 / 2)
        print(f"rank {r}: P = {ran['parameters']}, sharded {ran['optimizer_state_bytes']} bytes, "
              f"12 x P / (DP / I) = {target:.0f}, replicated {replicated['optimizer_state_bytes']} bytes")
        assert abs(ran["optimizer_state_bytes"] - target) <= 0.05 * target
        assert set(ran["grad_norms"].values()) != {None} and max(ran["grad_norms"].values()) > 1.0  # it clipped


def test_tp2_dp4_a_rank_killed_in_the_gather_costs_its_replica_alone_and_every_rank_ends_bit_identical(
        tmp_path, tp2_dp4_replicated) -> None:
    layout = ModelParallel(2, 1)
    fault = fail_at(rank=5, step=2, at="gather")  # replica 2: instance 1 (replicas 2 and 3)
    launch(tmp_path, 2, 1, 4, [*LLAMA, *SHARDED, "--hold-for-joiner", "4"], [fault])
    assert len((tmp_path / "faults.log").read_text().splitlines()) == 1, "the fault did not fire"
    for r in range(8):
        ran = summary(tmp_path, r)
        rejoined = r in layout.ranks(2)
        assert ran["trained"] and (ran["joined_at"] is not None) == rejoined, (r, ran["joined_at"])
        if rejoined:  # its share from instance 0, its Lightning state from a replica
            assert ran["state_from"] == "replica", r
    same_parameters(tmp_path, tp2_dp4_replicated, range(8))


@pytest.mark.matrix
def test_tp2_pp2_dp2_tied_embeddings_sharded_equals_the_replicated_engine(tmp_path) -> None:
    replicated, sharded = tmp_path / "replicated", tmp_path / "sharded"
    launch(replicated, 2, 2, 2, TIED)
    launch(sharded, 2, 2, 2, [*TIED, *SHARDED])
    same_parameters(sharded, replicated, range(8))


@pytest.fixture(scope="session")
def tp2_dp2_bf16(failure_free):
    """The recipe at TP=2 (sequence parallel) x DP=2, bfloat16 parameters, the optimizer sharded in two instances."""
    def reference_run(out):
        launch(out, 2, 1, 2, [*LLAMA, *SHARDED, *BF16])
        return out

    return failure_free("test_sharded_megatron.tp2_dp2_bf16", reference_run)


def test_tp2_sp_dp2_bf16_parameters_train_within_1_percent_of_the_float32_losses(tmp_path, tp2_dp2_bf16) -> None:
    # Megatron-LM's mixed precision: bfloat16 model, float32 main parameters and gradients in the shares. Parameters
    # are not compared element-wise: AdamW's first steps move a weight by about lr whatever its gradient's size, so
    # a gradient near zero that rounding flips moves it by 2 lr.
    launch(tmp_path, 2, 1, 2, [*LLAMA, *SHARDED])
    for r in range(4):
        assert {t["tensor"].dtype for t in shards(tp2_dp2_bf16, r).values()} == {torch.bfloat16}, r
        ours, theirs = summary(tp2_dp2_bf16, r)["losses"], summary(tmp_path, r)["losses"]
        assert ours.keys() == theirs.keys() and len(ours) == STEPS
        worst = max(abs(ours[k] - theirs[k]) / abs(theirs[k]) for k in theirs)
        print(f"rank {r}: largest relative loss difference, bf16 against float32 parameters: {worst:.2e}")
        assert worst <= 0.01, (r, ours, theirs)


@pytest.mark.matrix
def test_tp2_sp_dp2_bf16_a_rank_killed_in_the_gather_ends_bit_identical_to_the_failure_free_bf16_run(
        tmp_path, tp2_dp2_bf16) -> None:
    layout = ModelParallel(2, 1)
    fault = fail_at(rank=3, step=2, at="gather")  # replica 1 (instance 1): its share comes back from instance 0
    launch(tmp_path, 2, 1, 2, [*LLAMA, *SHARDED, *BF16, "--hold-for-joiner", "4"], [fault])
    assert len((tmp_path / "faults.log").read_text().splitlines()) == 1, "the fault did not fire"
    for r in range(4):
        ran = summary(tmp_path, r)
        assert ran["trained"] and (ran["joined_at"] is not None) == (r in layout.ranks(1)), (r, ran["joined_at"])
    same_parameters(tmp_path, tp2_dp2_bf16, range(4))


def test_tp2_sp_dp2_bf16_every_replica_lost_resumes_the_float32_main_parameters_from_the_memory_snapshot(
        tmp_path, tp2_dp2_bf16) -> None:
    # The snapshot's optimizer state holds the float32 main parameters: resumed from the bfloat16 model alone, the
    # main parameters would be rounded and the run would leave the failure-free one's trajectory.
    layout = ModelParallel(2, 1)
    both = [fail_at(rank=layout.rank(replica, 0), step=3, micro_batch=replica) for replica in (0, 1)]
    launch(tmp_path, 2, 1, 2, [*LLAMA, *SHARDED, *BF16, "--snapshot-every", "1"], both)
    assert len((tmp_path / "faults.log").read_text().splitlines()) == 2, "the faults did not fire"
    for r in range(4):
        assert summary(tmp_path, r)["state_from"] == "memory", r
    same_parameters(tmp_path, tp2_dp2_bf16, range(4))
