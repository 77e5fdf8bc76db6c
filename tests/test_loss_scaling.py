"""``16-mixed`` (a loss scaler) under ``unicron-run``: every rank skips the same steps, and a joiner gets the scale.

``examples/lightning_gpt.py --precision 16-mixed`` trains with Lightning's
``MixedPrecision`` and a CPU ``GradScaler``; ``--inf-at R:S:M`` makes rank R's
gradients infinite in micro-batch M of step S (recorded in ``OUT/inf.log``).
The scaler must skip that step and halve its scale on *every* rank, or the
replicas (and, with pipeline parallelism, the stages) would drift apart.
The Inf case is in the default tier; the NaN, pipeline-stage and rejoin cases in e2e.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import BIN, EXAMPLES
from unicron_elastic.testing import fail_at, faults_env

GPT = os.path.join(EXAMPLES, "lightning_gpt.py")
STEPS, SCALE = 6, 1024.0


def launch(out: Path, world: int, *args: str, faults: list | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", **faults_env(faults or [], str(out / "faults.log")))
    cmd = [os.path.join(BIN, "unicron-run"), "--standalone", f"--nproc-per-node={world}", "--monitor-interval=0.05",
           "--hang-factor=10", GPT, "--steps", str(STEPS), "--out", str(out), "--init-scale", str(SCALE), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)


def summary(out: Path, rank: int) -> dict:
    return json.loads((out / f"rank{rank}.json").read_text())


def planted(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "inf.log").read_text().splitlines()]


def params(out: Path, rank: int) -> list[torch.Tensor]:
    return torch.load(out / f"params{rank}.pt")


SKIPPED_AT_2 = {str(s): SCALE if s < 2 else SCALE / 2 for s in range(STEPS)}  # the scale after each step


@pytest.fixture(scope="session")
def inf_run(failure_free) -> Path:
    """3 data-parallel ranks, rank 1's second micro-batch of step 2 infinite: the run the faulted one must equal."""
    def run(out: Path) -> Path:
        proc = launch(out, 3, "--precision", "16-mixed", "--inf-at", "1:2:1")
        assert proc.returncode == 0, proc.stderr[-3000:]
        return out

    return failure_free("test_loss_scaling.inf_run", run)


@pytest.mark.timeout(300)
def test_an_inf_in_one_ranks_micro_batch_makes_every_rank_skip_the_step_and_lower_the_scale(inf_run: Path) -> None:
    assert [(p["rank"], p["step"], p["micro_batch"]) for p in planted(inf_run)] == [(1, 2, 1)]
    for rank in range(3):
        s = summary(inf_run, rank)
        assert s["global_step"] == STEPS
        assert s["scales"] == SKIPPED_AT_2
        assert s["precision_state"]["scale"] == SCALE / 2 and s["precision_state"]["_growth_tracker"] == STEPS - 3
        assert all(torch.equal(a, b) for a, b in zip(params(inf_run, 0), params(inf_run, rank)))
        assert all(torch.isfinite(p).all() for p in params(inf_run, rank))


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_nan_in_one_ranks_loss_makes_every_rank_skip_the_step_and_training_goes_on(tmp_path: Path) -> None:
    """With a loss scaler a NaN is an overflow like an Inf: skipped on every rank, no error, the scale halved."""
    proc = launch(tmp_path, 2, "--precision", "16-mixed", "--inf-at", "1:2:1", "--poison", "nan")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [(p["rank"], p["step"]) for p in planted(tmp_path)] == [(1, 2)]
    for rank in range(2):
        s = summary(tmp_path, rank)
        assert s["global_step"] == STEPS and s["scales"] == SKIPPED_AT_2
        assert all(torch.isfinite(p).all() for p in params(tmp_path, rank))
        assert all(torch.equal(a, b) for a, b in zip(params(tmp_path, 0), params(tmp_path, rank)))


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_rank_killed_after_the_skip_rejoins_with_the_same_scaler_state(tmp_path: Path, inf_run: Path) -> None:
    proc = launch(tmp_path, 3, "--precision", "16-mixed", "--inf-at", "1:2:1", "--hold-for-joiner", "4",
                  faults=[fail_at(rank=2, step=3, micro_batch=5)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    fired = [json.loads(line) for line in (tmp_path / "faults.log").read_text().splitlines()]
    assert [(f["rank"], f["step"]) for f in fired] == [(2, 3)]
    joiner = summary(tmp_path, 2)
    assert joiner["state_from"] == "replica" and 3 < joiner["joined_at"] < STEPS
    for rank in range(3):
        s = summary(tmp_path, rank)
        assert s["global_step"] == STEPS
        assert s["precision_state"] == summary(inf_run, 0)["precision_state"]  # the joiner's scale and tracker too
        assert all(torch.equal(a, b) for a, b in zip(params(inf_run, 0), params(tmp_path, rank)))
    assert joiner["scales"] == {str(s): SCALE / 2 for s in range(joiner["joined_at"], STEPS)}


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_an_overflow_in_one_pipeline_stage_makes_every_stage_skip_the_step(tmp_path: Path) -> None:
    """Stage 0's gradients only are infinite (a hook on its activations' gradient): stage 1's are finite, and it
    must skip because the step's commit carries stage 0's verdict. (A loss scaler without autocast: megatron-core's
    layers re-enter autocast in their backward on GPUs only.)"""
    proc = launch(tmp_path, 2, "--precision", "16-mixed-no-autocast", "--inf-at", "0:2:0", "--pipeline-parallel", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {(p["rank"], p["step"]) for p in planted(tmp_path)} == {(0, 2)}  # stage 0 only
    for rank in range(2):
        s = summary(tmp_path, rank)
        assert s["global_step"] == STEPS and s["scales"] == SKIPPED_AT_2
        assert all(torch.isfinite(p).all() for p in params(tmp_path, rank))
