"""Megatron-LM's Llama 3 recipe at toy size under ``unicron_megatron``: the model trained is the model defined.

Each run trains ``examples/megatron_gpt.py --llama --qk-layernorm`` (megatron-core's ``GPTModel``: RMSNorm,
SwiGLU, RoPE, grouped-query attention, q/k layer norms, untied embeddings, no biases; sequence parallelism at
TP > 1, per-token loss, gradient-accumulation fusion through the CPU stand-in of Apex's kernel in
``tests/stand_ins``) under ``unicron-run --standalone`` on CPU/gloo, with a loss mask that masks about a third of
the tokens and every token of micro-batch 2 of step 1, float64 gradient sums.

* **The model defined** (dropout 0, SGD with momentum): each layout's replica, assembled from its shards,
  against the same model on one rank (TP = PP = 1, same global batch, same initial weights). ``ATOL``
  (absolute, per parameter) is 1e-6. Measured: 7.5e-9 at TP=2, TP=2 x PP=2 and TP=2 x PP=2 x DP=2, clipped by
  the global norm at 0.05 (below every step's norm); 3.7e-8 at TP=2 x DP=2 with a rank killed in a micro-batch,
  unclipped (float64 sums added in another order, tensor-parallel partial products). Two mistakes, each run
  unclipped by ``tests/workers/megatron_gpt_mutant.py``, end far outside it: the tensor group's sums of the
  sequence-parallel and q/k layer norms left out (1.4e-2), and the tokens of the micro-batches survivors
  recompute after a kill counted twice (1.3e-2). Clipping by the norm would hide the second (it scales a
  step's gradients as a whole; measured: 7.5e-9 with clipping on every step), hence unclipped.
* **The logged loss**: ``train_loss`` and ``lm loss`` on every rank equal the token-weighted mean of the step's
  micro-batches' ``(loss_sum, num_tokens)`` as the last stage recorded them (each micro-batch once), within 1e-6.
* **Recovery with dropout 0.1** (AdamW, the recipe's optimizer): a rank SIGKILLed in a micro-batch of each stage
  and before its optimizer step at TP=2 (SP) x PP=2 x DP=2: every rank ends bit-identical to the failure-free run.
* **A NaN in one rank's loss** without a loss scaler stops the run with an error naming the step and the rank,
  before any optimizer step of that step (the parameters written are finite); nobody is restarted.

The default tier runs TP=2 (the fastest layout with sequence parallelism and per-token loss) and the NaN stop;
the rest is ``-m e2e``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import BIN, EXAMPLES
from test_megatron_gpt import KILLS, MUTANT, summary, shards, whole_model  # (KILLS: the same places at TP2xPP2xDP2)
from unicron_elastic.strategy.engine.replicas import ModelParallel
from unicron_elastic.testing import Fault, fail_at, faults_env

GPT = os.path.join(EXAMPLES, "megatron_gpt.py")
STAND_INS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stand_ins")
STEPS, B, ATOL = 6, 6, 1e-6
TIMEOUT = 420
RECIPE = ["--llama", "--qk-layernorm", "--mask-fraction", "0.33", "--masked-micro-batch", "1", "2",
          "--bucket-numel", "3000", "--steps", str(STEPS)]
#: The model defined: SGD (Adam would magnify float32 rounding of tensor-parallel partial products into the
#: comparison with one rank), clipping on every step.
EXACT = [*RECIPE, "--optimizer", "sgd", "--lr", "0.1", "--clip-grad", "0.05"]
#: The same without clipping (a clip above every norm): clipping by the global norm would hide an error that
#: scales a step's gradients as a whole, such as a token count counted twice.
UNCLIPPED = [*RECIPE, "--optimizer", "sgd", "--lr", "0.1", "--clip-grad", "100"]
#: Recovery: the recipe's AdamW and clip 1.0, dropout on. A step of this model takes several seconds with 8 ranks on
#: 2 cores: the replica that survives a kill may compute its own micro-batches for longer than the default
#: check-in timeout (10 s) before its reduce fails and it checks in, and would then be left out as stuck (seen once:
#: every rank resumed from the in-memory snapshot, bit-identical but not from the replica). 60 s here.
SLOW = ["--checkin-timeout", "60"]
DROPOUT = [*RECIPE, "--dropout", "0.1", "--hold-for-joiner", "4", *SLOW]


def launch(out: Path, tp: int, pp: int, replicas: int, args: list[str], faults: list[Fault] = (),
           script: list[str] | None = None, expect_ok: bool = True) -> subprocess.CompletedProcess:
    """One run of ``megatron_gpt.py`` (or ``script``) on ``replicas`` x TP x PP ranks under ``unicron-run``."""
    out.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join([STAND_INS, *filter(None, [os.environ.get("PYTHONPATH")])])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, **faults_env(list(faults), str(out / "faults.log")))
    cmd = [os.path.join(BIN, "unicron-run"), "--standalone", f"--nproc-per-node={replicas * tp * pp}",
           "--monitor-interval=0.05", "--hang-factor=10", *(script or [GPT]), "--tensor-parallel", str(tp),
           "--pipeline-parallel", str(pp), "--out", str(out), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    if expect_ok:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def failure_free_run(out: Path, tp: int, pp: int, replicas: int, args: list[str]) -> Path:
    """A failure-free run: every rank trained from the start to the end, none restarted."""
    proc = launch(out, tp, pp, replicas, args)
    assert "worker_restarted" not in proc.stderr, proc.stderr[-4000:]
    for r in range(replicas * tp * pp):
        ran = summary(out, r)
        assert ran["trained"] and ran["joined_at"] is None and ran["global_step"] == STEPS, ran
    return out


@pytest.fixture(scope="session")
def single_rank_recipe(failure_free) -> Path:
    """The recipe's model on one rank, TP = PP = 1 (trained once per session)."""
    return failure_free("test_megatron_recipe.single_rank", lambda out: failure_free_run(out, 1, 1, 1, EXACT))


@pytest.fixture(scope="session")
def single_rank_unclipped(failure_free) -> Path:
    """The recipe's model on one rank without clipping (trained once per session)."""
    return failure_free("test_megatron_recipe.single_rank_unclipped",
                        lambda out: failure_free_run(out, 1, 1, 1, UNCLIPPED))


@pytest.fixture(scope="session")
def dropout_3d(failure_free) -> Path:
    """TP=2 (SP) x PP=2 x DP=2 with dropout 0.1, without failures (trained once per session)."""
    return failure_free("test_megatron_recipe.dropout_3d", lambda out: failure_free_run(out, 2, 2, 2, DROPOUT))


def largest_difference(out: Path, reference: Path, layout: ModelParallel, replica: int) -> float:
    """The largest absolute difference between a replica's whole model and the single rank's."""
    ours, theirs = whole_model(out, layout.ranks(replica)), whole_model(reference, [0])
    assert ours.keys() == theirs.keys()
    return max(float((ours[name] - theirs[name]).abs().max()) for name in theirs)


def trains_the_model_defined(out: Path, reference: Path, layout: ModelParallel, replicas: int) -> None:
    for replica in range(replicas):
        difference = largest_difference(out, reference, layout, replica)
        print(f"{out.name} replica {replica}: largest difference from the single rank {difference:.1e}")
        assert difference <= ATOL, replica


def logs_the_token_weighted_loss(out: Path, layout: ModelParallel, replicas: int,
                                 recomputed_at: int | None = None) -> None:
    """Every rank logged, for every step, the token-weighted mean of the step's micro-batches (each once).

    ``recomputed_at``: the step replica 1 was lost in. Only the steps after it are compared: the records of
    replica 1's lost incarnation are gone, and that step's micro-batches were computed more than once.
    Replica 1's rejoined ranks log from the step they joined at.
    """
    per_step: dict[str, list[list[float]]] = {}
    for replica in range(replicas):
        last = layout.rank(replica, (layout.pipeline - 1) * layout.tensor)  # (the last stage's tensor rank 0)
        for step, records in summary(out, last)["micro_batch_losses"].items():
            if recomputed_at is None or int(step) > recomputed_at:
                per_step.setdefault(step, []).extend(records)
    first = 0 if recomputed_at is None else recomputed_at + 1
    assert sorted(per_step, key=int) == [str(s) for s in range(first, STEPS)]
    if recomputed_at is None:
        assert [0.0, 0] in per_step["1"]  # the masked micro-batch: nothing, not NaN
    for step, records in per_step.items():
        assert len(records) == B, step
        expected = sum(loss for loss, _ in records) / sum(tokens for _, tokens in records)
        for r in range(replicas * layout.size):
            ran = summary(out, r)
            if ran["joined_at"] is not None and int(step) < ran["joined_at"]:  # (it logs from the step it joined at)
                continue
            logged = ran["logged"][step]
            assert logged["train_loss"] == pytest.approx(expected, abs=1e-6), (r, step)
            assert logged["lm loss"] == pytest.approx(expected, abs=1e-6), (r, step)


@pytest.mark.timeout(3 * TIMEOUT)
def test_tp2_with_sequence_parallelism_and_per_token_loss_trains_the_model_defined(tmp_path: Path,
                                                                                  single_rank_recipe: Path) -> None:
    """TP=2 with SP, q/k norms, per-token loss, fusion: the single rank's model, the token-weighted loss logged."""
    layout = ModelParallel(2, 1)
    failure_free_run(tmp_path, 2, 1, 1, EXACT)
    trains_the_model_defined(tmp_path, single_rank_recipe, layout, 1)
    logs_the_token_weighted_loss(tmp_path, layout, 1)
    logs_the_token_weighted_loss(single_rank_recipe, ModelParallel(), 1)


@pytest.mark.e2e
@pytest.mark.timeout(3 * TIMEOUT)
@pytest.mark.parametrize("pp, replicas, extra", [pytest.param(2, 1, [], marks=pytest.mark.matrix),  # (in tp2-pp2-dp2)
                                                 (2, 2, []), (1, 1, ["--no-sequence-parallel"])],
                         ids=["tp2-pp2", "tp2-pp2-dp2", "tp2-qk-layernorm-without-sp"])
def test_each_layout_trains_the_model_defined(tmp_path: Path, single_rank_recipe: Path, pp: int, replicas: int,
                                              extra: list[str]) -> None:
    """TP=2 x PP=2 and TP=2 x PP=2 x DP=2 with sequence parallelism; TP=2 with q/k layer norms and without it
    (their gradients are still partial on each tensor rank: each holds its own heads)."""
    layout = ModelParallel(2, pp)
    failure_free_run(tmp_path, 2, pp, replicas, [*EXACT, *extra])
    trains_the_model_defined(tmp_path, single_rank_recipe, layout, replicas)
    logs_the_token_weighted_loss(tmp_path, layout, replicas)


#: TP=2 x DP=2: replica 1 (ranks 2 and 3) computes micro-batches 1, 3 and 5; rank 3 is killed in micro-batch 3 of
#: step 2, so replica 0 recomputes 1, 3 and 5 (replica 1 rejoins before step 4).
KILL_TP2_DP2 = fail_at(rank=3, step=2, micro_batch=3)


def the_fault_fired(out: Path, victim: int) -> None:
    fired = [json.loads(line) for line in (out / "faults.log").read_text().splitlines()]
    assert len(fired) == 1 and fired[0]["rank"] == victim, "the fault did not fire"


@pytest.mark.e2e
@pytest.mark.timeout(3 * TIMEOUT)
def test_the_tokens_of_recomputed_micro_batches_count_once(tmp_path: Path, single_rank_unclipped: Path) -> None:
    """A rank killed at TP=2 x DP=2: survivors recompute its micro-batches and the step divides by its tokens once."""
    launch(tmp_path, 2, 1, 2, [*UNCLIPPED, "--hold-for-joiner", "4", *SLOW], [KILL_TP2_DP2])
    the_fault_fired(tmp_path, KILL_TP2_DP2.rank)
    recomputed = [report for report in summary(tmp_path, 0)["reports"] if report["dead"]]
    assert len(recomputed) == 1 and recomputed[0]["dead"] == [1] and sorted(recomputed[0]["micro_batches"]) == \
        list(range(B))
    trains_the_model_defined(tmp_path, single_rank_unclipped, ModelParallel(2, 1), 2)
    logs_the_token_weighted_loss(tmp_path, ModelParallel(2, 1), 2, recomputed_at=2)


@pytest.mark.e2e
@pytest.mark.timeout(3 * TIMEOUT)
@pytest.mark.parametrize("mutation, replicas, faults", [("tensor-unsummed", 1, []),
                                                         pytest.param("tokens-twice", 2, [KILL_TP2_DP2],
                                                                      marks=pytest.mark.matrix)])
def test_the_tolerance_catches_unsummed_tensor_gradients_and_tokens_counted_twice(
        tmp_path: Path, single_rank_unclipped: Path, mutation: str, replicas: int, faults: list[Fault]) -> None:
    """Each mistake, undone in the strategy alone, ends far outside ``ATOL`` (without clipping, which would
    hide a step whose gradients are scaled as a whole)."""
    args = [*UNCLIPPED, "--hold-for-joiner", "4", *SLOW] if faults else UNCLIPPED
    launch(tmp_path, 2, 1, replicas, args, faults, script=[MUTANT, mutation])
    if faults:
        the_fault_fired(tmp_path, faults[0].rank)
    difference = largest_difference(tmp_path, single_rank_unclipped, ModelParallel(2, 1), 0)
    print(f"{mutation}: largest difference from the single rank {difference:.1e}")
    assert difference > 100 * ATOL


@pytest.mark.e2e
@pytest.mark.timeout(3 * TIMEOUT)
@pytest.mark.parametrize("kill", [pytest.param(k, marks=() if k == "last-stage-micro-batch" else pytest.mark.matrix)
                                  for k in sorted(KILLS)])  # (one place in the e2e tier, the three with -m matrix)
def test_with_dropout_a_kill_at_tp2_sp_pp2_dp2_ends_bit_identical_to_the_failure_free_run(
        tmp_path: Path, dropout_3d: Path, kill: str) -> None:
    """Survivors and rejoiners end with the failure-free run's shards, bit for bit (dropout 0.1, per-token loss)."""
    layout, fault = ModelParallel(2, 2), KILLS[kill]
    launch(tmp_path, 2, 2, 2, DROPOUT, [fault])
    the_fault_fired(tmp_path, fault.rank)
    for r in layout.ranks(1):
        s = summary(tmp_path, r)
        assert s["trained"] and s["state_from"] == "replica" and s["joined_at"] is not None, r
    for r in range(2 * layout.size):
        ours, theirs = shards(tmp_path, r), shards(dropout_3d, r)
        assert ours.keys() == theirs.keys()
        for name in ours:
            assert torch.equal(ours[name]["tensor"], theirs[name]["tensor"]), (r, name)


@pytest.mark.e2e
@pytest.mark.timeout(3 * TIMEOUT)
def test_a_nan_in_one_ranks_loss_stops_the_run_naming_the_step_and_the_rank(tmp_path: Path) -> None:
    """DP=2 without a loss scaler, rank 1's loss NaN in step 2: every rank stops before that step's update."""
    proc = launch(tmp_path, 1, 1, 2, RECIPE, script=[MUTANT, "nan-loss:2:1"], expect_ok=False)
    message = "non-finite loss or gradients in step 2, first produced by rank 1"
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-4000:]
    assert "worker_restarted" not in proc.stderr  # (a restart would only compute the same NaN)
    for r in range(2):
        s = summary(tmp_path, r)
        assert message in s["error"] and s["global_step"] == 2, s
        assert all(torch.isfinite(v["tensor"]).all() for v in shards(tmp_path, r).values()), r
