"""``Trainer(strategy="unicron_megatron")`` with real killed processes under ``unicron-run``.

Each run trains ``examples/lightning_gpt.py`` (a small GPT LightningModule with
dropout and AdamW) on 3 ranks, B = 6 micro-batches per step. A rank is
SIGKILLed at one point of a step; the agent restarts it. The survivors must
end with exactly the parameters of the failure-free run, every micro-batch of
the failed step counted once; a restarted rank that rejoins gets its state
from a replica (or, with every replica gone, from the in-memory snapshot, then
from the disk checkpoint). The example sums gradients in float64 (its default
``--grad-dtype``; the strategy's default float32 is exact only to rounding that
AdamW amplifies, see docs/strategy.md), so "equal" is checked at float32
tolerance and holds to the last bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import BIN, EXAMPLES, resumed_from_newest_snapshot, snapshots_saved
from unicron_elastic.testing import Fault, fail_at, faults_env

GPT = os.path.join(EXAMPLES, "lightning_gpt.py")
WORLD, STEPS, B = 3, 8, 6  # global batch 24 in micro-batches of 4
BUCKET = 6560  # TinyGPT has 19680 parameters: 3 buckets


def launch(out: Path, faults: list[Fault], *args: str, step_time: float = 0.0,
           world: int = WORLD) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", **faults_env(faults, str(out / "faults.log")))
    cmd = [os.path.join(BIN, "unicron-run"), "--standalone", f"--nproc-per-node={world}", "--monitor-interval=0.05",
           GPT, "--steps", str(STEPS), "--out", str(out), "--step-time", str(step_time), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)


def summary(out: Path, rank: int) -> dict:
    return json.loads((out / f"rank{rank}.json").read_text())


def assert_params(out: Path, rank: int, reference: list[torch.Tensor]) -> None:
    for ours, ref in zip(torch.load(out / f"params{rank}.pt"), reference):
        torch.testing.assert_close(ours, ref)  # float32 tolerance


@pytest.fixture(scope="session")
def baseline(failure_free) -> list[torch.Tensor]:
    def reference_run(out: Path) -> list[torch.Tensor]:
        proc = launch(out, [])
        assert proc.returncode == 0, proc.stderr[-3000:]
        params = [torch.load(out / f"params{r}.pt") for r in range(WORLD)]
        for other in params[1:]:
            assert all(torch.equal(a, b) for a, b in zip(params[0], other))
        assert [summary(out, r)["global_step"] for r in range(WORLD)] == [STEPS] * WORLD
        return params[0]

    return failure_free("test_lightning_strategy.baseline", reference_run)


def check_survivors(out: Path, proc: subprocess.CompletedProcess, victim: int, baseline: list[torch.Tensor]) -> list[dict]:
    """The fault fired once, training completed, survivors equal the baseline; their reports of the failed step."""
    fired = [json.loads(line) for line in (out / "faults.log").read_text().splitlines()]
    assert len(fired) == 1 and fired[0]["rank"] == victim, "the fault did not fire"
    assert proc.returncode == 0, proc.stderr[-3000:]
    survivors = [r for r in range(WORLD) if r != victim]
    for r in survivors:
        assert summary(out, r)["global_step"] == STEPS
        assert_params(out, r, baseline)
    failed = fired[0]["step"]
    return [next(rep for rep in summary(out, r)["reports"] if rep["step"] == failed) for r in survivors]


def covered_once(reports: list[dict]) -> bool:
    return sorted(j for rep in reports for j in rep["micro_batches"]) == list(range(B))


@pytest.mark.matrix  # (the default tier's rejoin test kills rank 2 in its micro-batch 5)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("micro_batch", [2, 5])  # rank 2's first, second
def test_kill_at_each_micro_batch(tmp_path: Path, baseline, micro_batch: int) -> None:
    proc = launch(tmp_path, [fail_at(rank=2, step=2, micro_batch=micro_batch)])
    reports = check_survivors(tmp_path, proc, 2, baseline)
    assert all(rep["recoveries"] == 1 and rep["dead"] == [2] for rep in reports)
    assert covered_once(reports)  # scenario 1: the dead rank's micro-batches computed by survivors


@pytest.mark.timeout(300)
# -m matrix: the e2e tier's bucket kill through Lightning is test_lightning_matrix.py's w3-v2-bucket1 (the
# same point, with these assertions and more: no healthy rank restarted, the victim rejoins, the latency budget)
@pytest.mark.e2e
@pytest.mark.parametrize("bucket", [pytest.param(k, marks=pytest.mark.matrix) for k in range(3)])
def test_kill_during_each_gradient_bucket(tmp_path: Path, baseline, bucket: int) -> None:
    proc = launch(tmp_path, [fail_at(rank=1, step=3, bucket=bucket)], "--bucket-numel", str(BUCKET))
    reports = check_survivors(tmp_path, proc, 1, baseline)
    assert all(rep["recoveries"] == 1 and rep["dead"] == [1] for rep in reports)
    # scenario 2: the buckets the victim started before it died (right before bucket `bucket`), if reduced, kept
    assert len({rep["kept_buckets"] for rep in reports}) == 1 and all(rep["kept_buckets"] <= bucket for rep in reports)
    assert covered_once(reports)


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("at", [pytest.param("before_optimizer_step", marks=pytest.mark.matrix), "after_optimizer_step"])
def test_kill_before_and_after_the_optimizer_step(tmp_path: Path, baseline, at: str) -> None:
    proc = launch(tmp_path, [fail_at(rank=0, step=2, at=at)])
    check_survivors(tmp_path, proc, 0, baseline)
    # before the step: the gradients were complete, survivors notice at the next step; after: likewise
    noticed = [rep for r in (1, 2) for rep in summary(tmp_path, r)["reports"] if rep["dead"] == [0]]
    assert [rep["step"] for rep in noticed] == [3, 3]
    assert covered_once(noticed)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_the_dataloaders_workers_load_the_micro_batches_and_a_kill_keeps_the_trajectory(tmp_path: Path,
                                                                                        baseline) -> None:
    """Issue 12 item 6: ``DataLoader(num_workers=2, persistent_workers=True)`` is honoured: each rank's own
    micro-batches are loaded by its worker processes; the killed rank's micro-batches are materialised on
    demand by the survivors; the parameters equal the failure-free run without workers."""
    proc = launch(tmp_path, [fail_at(rank=2, step=2, micro_batch=2)], "--num-workers", "2", "--record-loads")
    reports = check_survivors(tmp_path, proc, 2, baseline)
    assert covered_once(reports)
    for r in (0, 1):
        done = summary(tmp_path, r)
        loads = [line.split() for line in (tmp_path / f"loads{r}.txt").read_text().splitlines()]
        by_workers = {int(pid) for pid, worker, _ in loads if int(worker) >= 0}
        assert len(by_workers) == 2 and done["pid"] not in by_workers  # the DataLoader's two worker processes
        assert done["fed"] >= STEPS  # its own micro-batches of every step came from the workers
        assert done["on_demand"] >= 1  # the killed rank's micro-batch moved here
        here = [int(i) for pid, worker, i in loads if int(worker) < 0]
        assert len(here) == done["on_demand"] * 4  # 4 samples per micro-batch, loaded by the rank itself


@pytest.mark.compat
@pytest.mark.timeout(300)
def test_restarted_rank_rejoins_with_state_from_a_replica(tmp_path: Path, baseline) -> None:
    # the survivors wait before step 4 (at most 120 s) until the restarted rank asks to join: a restart on a
    # loaded machine need not beat the end of the run
    proc = launch(tmp_path, [fail_at(rank=2, step=1, micro_batch=5)], "--hold-for-joiner", "4", step_time=0.5)
    check_survivors(tmp_path, proc, 2, baseline)
    joiner = summary(tmp_path, 2)
    assert joiner["state_from"] == "replica"  # no snapshot or checkpoint was read
    assert 1 < joiner["joined_at"] < STEPS
    assert [rep["step"] for rep in joiner["reports"]] == list(range(joiner["joined_at"], STEPS))
    assert_params(tmp_path, 2, baseline)
    assert not any(tmp_path.glob("**/step-*"))  # no disk checkpoint exists to read


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_snapshots_on_every_step_change_neither_the_losses_nor_the_parameters(tmp_path: Path, baseline) -> None:
    """Snapshots are read-only for training: every step's snapshot (one copy, sent by the writer process) against
    none, each step's losses and the parameters bit for bit (the baseline snapshots at step 0 only: every 50)."""
    runs = {}
    for every in (0, 1):
        out = tmp_path / f"every{every}"
        proc = launch(out, [], "--snapshot-every", str(every))
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[every] = out
        for r in range(WORLD):
            assert all(torch.equal(a, b) for a, b in zip(torch.load(out / f"params{r}.pt"), baseline))
    for r in range(WORLD):  # each rank's loss of each step, bit for bit
        assert summary(runs[0], r)["losses"] == summary(runs[1], r)["losses"]
        assert len(summary(runs[0], r)["losses"]) == STEPS
    output = proc.stdout + proc.stderr
    saved = snapshots_saved(output)[None]
    assert saved and len(saved) + output.count("snapshot_skipped") == STEPS  # (skipped: the writer was still busy)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_rank_that_crashes_rejoins_instead_of_taking_its_crash_for_the_end_of_training(tmp_path: Path,
                                                                                        baseline) -> None:
    """A Python exception in a rank runs Lightning's teardown too: it must not tell the restarted rank that
    training finished (it did, and the rank exited 0 having trained nothing, the run one rank short)."""
    proc = launch(tmp_path, [fail_at(rank=2, step=1, micro_batch=5, kind="raise", message="boom")], "--hold-for-joiner",
                  "3")
    check_survivors(tmp_path, proc, 2, baseline)
    joiner = summary(tmp_path, 2)
    assert joiner["joined_at"] is not None and joiner["global_step"] == STEPS
    assert_params(tmp_path, 2, baseline)


def kill_everyone(step: int) -> list[Fault]:
    return [fail_at(rank=r, step=step, micro_batch=r) for r in range(WORLD)]


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_all_replicas_lost_resumes_from_the_memory_snapshot(tmp_path: Path, baseline) -> None:
    proc = launch(tmp_path, kill_everyone(3), "--snapshot-every", "1")
    assert len((tmp_path / "faults.log").read_text().splitlines()) == WORLD
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in range(WORLD):
        s = summary(tmp_path, r)
        # the newest snapshot that landed (one due while the writer still sends the previous one is skipped)
        assert (s["state_from"], s["global_step"]) == ("memory", STEPS)
        assert resumed_from_newest_snapshot(proc.stdout + proc.stderr, s["joined_at"])
        assert_params(tmp_path, r, baseline)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_without_a_snapshot_the_disk_checkpoint_is_used(tmp_path: Path, baseline) -> None:
    ckpt = tmp_path / "ckpt"
    proc = launch(tmp_path, kill_everyone(4), "--snapshot-every", "0", "--checkpoint-dir", str(ckpt))
    assert len((tmp_path / "faults.log").read_text().splitlines()) == WORLD
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in range(WORLD):
        s = summary(tmp_path, r)
        assert s["state_from"] == "disk" and s["joined_at"] in (3, 4)  # the save of step 4 may be in flight
        assert_params(tmp_path, r, baseline)  # the steps after the checkpoint were recomputed
    assert len(list(ckpt.glob("step-*"))) <= 2  # older checkpoints are deleted


@pytest.fixture(scope="session")
def baseline4(failure_free) -> list[torch.Tensor]:
    def reference_run(out: Path) -> list[torch.Tensor]:
        proc = launch(out, [], world=4)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return torch.load(out / "params0.pt")

    return failure_free("test_lightning_strategy.baseline4", reference_run)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_scale_in_4_3_2_keeps_the_global_batch_and_trajectory(tmp_path: Path, baseline4) -> None:
    proc = launch(tmp_path, [], "--member-schedule", json.dumps({2: [0, 1, 2], 5: [0, 1]}), world=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [summary(tmp_path, r)["retired_at"] for r in range(4)] == [None, None, 5, 2]
    for r in (0, 1):
        assert summary(tmp_path, r)["global_step"] == STEPS
        assert_params(tmp_path, r, baseline4)
    last = summary(tmp_path, 0)["reports"][-1]
    assert last["micro_batches"] == [0, 2, 4]  # B = 6 over 2 ranks: the global batch is unchanged


@pytest.mark.matrix  # (the e2e tier grows a task by a node: tests/test_node_loss.py)
@pytest.mark.timeout(300)
def test_scale_out_2_to_4_new_ranks_get_the_state_from_a_replica(tmp_path: Path, baseline4) -> None:
    proc = launch(tmp_path, [], "--members", "0,1", "--member-schedule", json.dumps({3: [0, 1, 2, 3]}), world=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in range(4):
        assert summary(tmp_path, r)["global_step"] == STEPS
        assert_params(tmp_path, r, baseline4)
    for r in (2, 3):
        joined = summary(tmp_path, r)
        assert (joined["joined_at"], joined["state_from"]) == (3, "replica")
        assert [rep["step"] for rep in joined["reports"]] == list(range(3, STEPS))
    assert summary(tmp_path, 0)["reports"][0]["micro_batches"] == [0, 2, 4]  # 2 ranks before the scale-out


# -- in-process: registry, Lightning features, bad input ------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("first, then", [
    ("import unicron_elastic", "import lightning.pytorch as pl"),  # unicron first: registered when Lightning comes
    ("import unicron_elastic", "from lightning import Trainer"),
    ("import unicron_elastic", "import lightning.pytorch.strategies"),
    ("import lightning.pytorch", "import unicron_elastic"),  # Lightning first: registered at once
], ids=["unicron-then-lightning.pytorch", "unicron-then-lightning", "unicron-then-strategies", "lightning-first"])
def test_trainer_finds_the_strategy_whatever_the_import_order(first: str, then: str) -> None:
    """Issue 12 item 7: ``Trainer(strategy="unicron_megatron")`` works in any import order, and
    ``import unicron_elastic`` alone imports no Lightning (agents and CLIs do not pay for it)."""
    code = (f"import sys; {first}; lightning_loaded = 'lightning.pytorch' in sys.modules; {then};"
            "import lightning.pytorch as pl;"
            "from lightning.pytorch.strategies import StrategyRegistry; assert 'unicron_megatron' in StrategyRegistry;"
            "t = pl.Trainer(strategy='unicron_megatron', accelerator='cpu', devices=1, logger=False,"
            " enable_progress_bar=False, enable_model_summary=False);"
            "assert type(t.strategy).__name__ == 'UnicronMegatronStrategy';"
            "assert type(sys.modules['lightning.pytorch'].__loader__).__name__ == 'SourceFileLoader';"
            "print('eager' if lightning_loaded else 'lazy')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = "eager" if first.startswith("import lightning") else "lazy"
    assert result.stdout.strip().splitlines()[-1] == expected


@pytest.mark.e2e
def test_import_registers_the_strategy_without_importing_lightning_eagerly() -> None:
    code = ("import sys, unicron_elastic; assert 'lightning.pytorch' not in sys.modules;"
            "import lightning.pytorch as pl, unicron_elastic.strategy;"
            "from lightning.pytorch.strategies import StrategyRegistry; assert 'unicron_megatron' in StrategyRegistry;"
            "import importlib; importlib.reload(unicron_elastic)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    code = ("import lightning.pytorch, unicron_elastic;"
            "from lightning.pytorch.strategies import StrategyRegistry; assert 'unicron_megatron' in StrategyRegistry")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
