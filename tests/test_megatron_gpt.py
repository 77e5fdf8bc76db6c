"""A Megatron-LM user's ``GPTModel`` under ``unicron_megatron``: the model trained is the model defined.

Each run trains ``examples/megatron_gpt.py`` (megatron-core's ``GPTModel`` with the local layer spec, the CPU
core attention, dropout 0, tied word embeddings, a step in Megatron-LM's ``forward_step`` shape, SGD with
momentum, float64 gradient sums) under ``unicron-run --standalone`` on CPU/gloo, clipped by the global gradient
norm at a value below every step's norm, so clipping acts on every step. Every shard starts as its part of one
whole model, so each layout's replica, assembled from its shards, is compared with the same model trained on
one rank (TP = PP = 1) with the same global batch.

The tolerance, ``ATOL`` (absolute, per parameter), is about 270 times the largest difference measured between
a correct layout and the single rank (3.7e-9 after 6 steps: float64 sums added in another order,
tensor-parallel partial products), and over two thousand times smaller than the error of a strategy that leaves
the tied embedding's gradients unsummed across stages or clips each shard by its own norm (3.5e-3 and 2.5e-3);
``test_the_tolerance_catches_an_unsummed_tied_embedding_and_a_norm_per_shard`` runs both mistakes
(``tests/workers/megatron_gpt_mutant.py``) and shows they fail it.

The default tier runs PP=2 x DP=2 with a kill; the other layouts, the mistakes and the kills at
TP=2 x PP=2 x DP=2 run with ``-m e2e``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import BIN, EXAMPLES
from unicron_elastic.strategy.engine.replicas import ModelParallel
from unicron_elastic.testing import Fault, fail_at, faults_env

GPT = os.path.join(EXAMPLES, "megatron_gpt.py")
MUTANT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "megatron_gpt_mutant.py")
STEPS, CLIP, B = 6, 0.05, 6  # global batch 24 in micro-batches of 4
ATOL = 1e-6
TIMEOUT = 420
LAYOUTS = {"tp2-dp2": (2, 1), "pp2-dp2": (1, 2), "tp2-pp2-dp2": (2, 2)}


def launch(out: Path, tp: int, pp: int, replicas: int, faults: list[Fault] = (), *args: str,
           script: list[str] | None = None) -> subprocess.CompletedProcess:
    """One run of ``megatron_gpt.py`` (or ``script``) on ``replicas`` x TP x PP ranks under ``unicron-run``."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", **faults_env(list(faults), str(out / "faults.log")))
    cmd = [os.path.join(BIN, "unicron-run"), "--standalone", f"--nproc-per-node={replicas * tp * pp}",
           "--monitor-interval=0.05", "--hang-factor=10", *(script or [GPT]), "--tensor-parallel", str(tp),
           "--pipeline-parallel", str(pp), "--steps", str(STEPS), "--clip-grad", str(CLIP), "--bucket-numel", "3000",
           "--out", str(out), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def summary(out: Path, rank: int) -> dict:
    return json.loads((out / f"rank{rank}.json").read_text())


def shards(out: Path, rank: int) -> dict[str, dict]:
    return torch.load(out / f"shards{rank}.pt")


def whole_model(out: Path, ranks: list[int]) -> dict[str, torch.Tensor]:
    """A replica's parameters assembled from its ranks' shards (by their name in the whole model)."""
    parts: dict[str, list[dict]] = {}
    for r in ranks:
        for name, value in shards(out, r).items():
            parts.setdefault(name, []).append(value)
    model = {}
    for name, values in parts.items():
        values.sort(key=lambda v: v["tp_rank"])
        dim, chunks = values[0]["partition_dim"], values[0].get("chunks", 1)
        if dim < 0:
            model[name] = values[0]["tensor"]
            continue
        pieces = [v["tensor"].chunk(chunks, dim) for v in values]  # (SwiGLU: each rank holds a piece of each half)
        model[name] = torch.cat([piece[c] for c in range(chunks) for piece in pieces], dim)
    return model


def tied_copies_equal(out: Path, layout: ModelParallel, replica: int) -> None:
    """The first stage's word embedding equals the last stage's output weight, bit for bit, on every tensor rank."""
    for t in range(layout.tensor):
        first = shards(out, layout.rank(replica, t))
        last = shards(out, layout.rank(replica, (layout.pipeline - 1) * layout.tensor + t))
        assert torch.equal(first["embedding.word_embeddings.weight"]["tensor"], last["output_layer.weight"]["tensor"]), \
            (replica, t)


def largest_difference(out: Path, reference: Path, layout: ModelParallel, replica: int) -> float:
    """The largest absolute difference between a replica's whole model and the single rank's."""
    ours, theirs = whole_model(out, layout.ranks(replica)), whole_model(reference, [0])
    if layout.pipeline > 1:
        ours.pop("output_layer.weight")  # (the last stage's copy of the tied embedding: compared above)
    assert ours.keys() == theirs.keys()
    return max(float((ours[name] - theirs[name]).abs().max()) for name in theirs)


def trains_the_model_defined(out: Path, reference: Path, layout: ModelParallel, replicas: int = 2) -> None:
    for replica in range(replicas):
        if layout.pipeline > 1:
            tied_copies_equal(out, layout, replica)
        difference = largest_difference(out, reference, layout, replica)
        print(f"{out.name} replica {replica}: largest difference from the single rank {difference:.1e}")
        assert difference <= ATOL, replica


def clipped_by_the_whole_models_norm(out: Path, reference: Path, ranks: list[int]) -> None:
    """Every rank clipped by the single rank's gradient norm (relative 1e-5), and clipping acted on every step."""
    expected = summary(reference, 0)["grad_norms"]
    assert len(expected) == STEPS and all(norm > CLIP for norm in expected.values())
    for r in ranks:
        norms = summary(out, r)["grad_norms"]
        for step, norm in expected.items():
            if step in norms:  # (a rank that rejoined took no norm before its first step)
                assert norms[step] == pytest.approx(norm, rel=1e-5), (r, step)


def reference(out: Path, tp: int, pp: int, replicas: int, *args: str) -> Path:
    """A failure-free run: every rank trained from the start to the end, none restarted."""
    proc = launch(out, tp, pp, replicas, [], *args)
    assert "worker_restarted" not in proc.stderr, proc.stderr[-4000:]
    for r in range(replicas * tp * pp):
        ran = summary(out, r)
        assert ran["trained"] and ran["joined_at"] is None, ran
    return out


@pytest.fixture(scope="session")
def single_rank(failure_free) -> Path:
    """The model on one rank, TP = PP = 1 (trained once per session)."""
    return failure_free("test_megatron_gpt.single_rank", lambda out: reference(out, 1, 1, 1))


@pytest.fixture(scope="session")
def failure_free_3d(failure_free) -> Path:
    """TP=2 x PP=2 x DP=2 without failures (trained once per session)."""
    return failure_free("test_megatron_gpt.tp2-pp2-dp2", lambda out: reference(out, 2, 2, 2, "--hold-for-joiner", "4"))


def the_fault_fired(out: Path, victim: int) -> dict:
    fired = [json.loads(line) for line in (out / "faults.log").read_text().splitlines()]
    assert len(fired) == 1 and fired[0]["rank"] == victim, "the fault did not fire"
    return fired[0]


def the_lost_replica_rejoined(out: Path, layout: ModelParallel, fired: dict) -> None:
    """Replica 0 computed the failed step's micro-batches; every rank of replica 1 came back from replica 0."""
    for r in layout.ranks(0):
        lost = [report for report in summary(out, r)["reports"] if report["dead"]]
        assert len(lost) == 1 and lost[0]["dead"] == [1] and sorted(lost[0]["micro_batches"]) == list(range(B)), r
    for r in layout.ranks(1):
        s = summary(out, r)
        assert s["trained"] and s["state_from"] == "replica" and s["joined_at"] is not None and s["joined_at"] > fired["step"], r


@pytest.mark.compat  # (megatron-core's GPTModel, its marks and groups, on the oldest releases too)
@pytest.mark.timeout(3 * TIMEOUT)
def test_pp2_dp2_gptmodel_clipped_and_killed_trains_the_model_defined(tmp_path: Path, single_rank: Path) -> None:
    """PP=2 x DP=2, tied embeddings, clipping on every step, the last stage of replica 1 SIGKILLed in a micro-batch.

    Both replicas, the one that lost a rank and rejoined included, end equal to the model trained on one rank,
    with the tied copies equal bit for bit, clipped by the whole model's norm.
    """
    layout = ModelParallel(1, 2)
    victim = layout.rank(1, 1)
    launch(tmp_path, 1, 2, 2, [fail_at(rank=victim, step=2, micro_batch=3)], "--hold-for-joiner", "3")
    fired = the_fault_fired(tmp_path, victim)
    assert summary(tmp_path, 0)["global_step"] == STEPS
    the_lost_replica_rejoined(tmp_path, layout, fired)
    trains_the_model_defined(tmp_path, single_rank, layout)
    clipped_by_the_whole_models_norm(tmp_path, single_rank, layout.ranks(0))


@pytest.mark.e2e
@pytest.mark.timeout(3 * TIMEOUT)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.matrix if n == "pp2-dp2" else ())
                                  for n in sorted(LAYOUTS)])  # (pp2-dp2: the default tier's clipped and killed run)
def test_each_layout_trains_the_model_defined_and_clips_by_its_norm(tmp_path: Path, single_rank: Path,
                                                                   failure_free_3d: Path, name: str) -> None:
    """TP=2 x DP=2, PP=2 x DP=2 and TP=2 x PP=2 x DP=2 without failures: the single rank's model and norm."""
    tp, pp = LAYOUTS[name]
    out = failure_free_3d if (tp, pp) == (2, 2) else tmp_path
    if out is tmp_path:
        reference(tmp_path, tp, pp, 2)
    layout = ModelParallel(tp, pp)
    trains_the_model_defined(out, single_rank, layout)
    clipped_by_the_whole_models_norm(out, single_rank, list(range(2 * layout.size)))


@pytest.mark.e2e
@pytest.mark.timeout(3 * TIMEOUT)
@pytest.mark.parametrize("mutation, tp, pp", [pytest.param("untied-sum", 1, 2, marks=pytest.mark.matrix),
                                               ("shard-norm", 2, 2)])
def test_the_tolerance_catches_an_unsummed_tied_embedding_and_a_norm_per_shard(tmp_path: Path, single_rank: Path,
                                                                              mutation: str, tp: int, pp: int) -> None:
    """The strategy's two duties undone, one at a time: the replica ends far outside ``ATOL``, and untied."""
    launch(tmp_path, tp, pp, 1, script=[MUTANT, mutation])
    layout = ModelParallel(tp, pp)
    difference = largest_difference(tmp_path, single_rank, layout, 0)
    print(f"{mutation}: largest difference from the single rank {difference:.1e}")
    assert difference > 100 * ATOL
    with pytest.raises(AssertionError):
        tied_copies_equal(tmp_path, layout, 0)


KILLS = {  # TP=2 x PP=2 x DP=2; replica 1 is ranks 4-7 and computes micro-batches 1, 3 and 5
    "first-stage-micro-batch": fail_at(rank=5, step=2, micro_batch=3),
    "last-stage-micro-batch": fail_at(rank=6, step=2, micro_batch=1),
    "optimizer-step": fail_at(rank=7, step=2, at="before_optimizer_step"),
}


@pytest.mark.matrix  # (the e2e tier kills at TP2 x PP2 x DP2 with sequence parallelism and dropout:
@pytest.mark.timeout(3 * TIMEOUT)  # tests/test_megatron_recipe.py)
@pytest.mark.parametrize("kill", sorted(KILLS))
def test_a_kill_at_tp2_pp2_dp2_ends_bit_identical_to_the_failure_free_run(tmp_path: Path, failure_free_3d: Path,
                                                                          kill: str) -> None:
    """Survivors and rejoiners end with the failure-free run's shards, bit for bit, tied copies equal."""
    layout, fault = ModelParallel(2, 2), KILLS[kill]
    launch(tmp_path, 2, 2, 2, [fault], "--hold-for-joiner", "4")  # (killed before its optimizer step in step 2,
    # replica 1 is lost in step 3, asks to join before step 4 and trains from step 5)
    the_lost_replica_rejoined(tmp_path, layout, the_fault_fired(tmp_path, fault.rank))
    for r in range(2 * layout.size):
        ours, theirs = shards(tmp_path, r), shards(failure_free_3d, r)
        assert ours.keys() == theirs.keys()
        for name in ours:
            assert torch.equal(ours[name]["tensor"], theirs[name]["tensor"]), (r, name)
    for replica in range(2):
        tied_copies_equal(tmp_path, layout, replica)
