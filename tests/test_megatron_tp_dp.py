"""megatron-core tensor x pipeline parallelism x resilient data parallelism at the torch level (CPU/gloo).

``examples/megatron_parallel_worker.py`` runs ``ElasticDataParallel`` with
``model_parallel`` for each shard of a small MLP of megatron-core's
tensor-parallel layers, 2 replicas, no agent: the killed rank stays dead and
its replica's other ranks leave (exit code 3); the other replica finishes
with parameters bit-identical (float64 sums) to the failure-free run.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import EXAMPLES
from unicron_elastic.strategy.engine.replicas import ModelParallel
from unicron_elastic.testing import Fault, fail_at, faults_env, run_workers

pytestmark = pytest.mark.e2e
WORKER = os.path.join(EXAMPLES, "megatron_parallel_worker.py")
BUCKET = 100  # 6 buckets per stage of 2 blocks


def train(out: Path, tp: int, pp: int, faults: list[Fault]) -> list[subprocess.CompletedProcess]:
    out.mkdir(parents=True, exist_ok=True)
    args = ["--out", str(out), "--tp", str(tp), "--pp", str(pp), "--bucket-numel", str(BUCKET)]
    return run_workers(WORKER, 2 * tp * pp, args, faults_env(faults, str(out / "faults.log")), timeout=150)


def run(tmp_path: Path, failure_free, tp: int, pp: int, victim: int, fault: Fault) -> dict[int, dict]:
    """A faulty run against the failure-free one (trained once per session); checks the replica of ``victim`` left and replica 0 is exact.

    Returns:
        Replica 0's rank -> its report of step 1 (the failed step) and its ``forward_only`` steps.
    """
    layout = ModelParallel(tp, pp)
    def reference_run(out: Path) -> Path:
        base = train(out, tp, pp, [])
        assert [r.returncode for r in base] == [0] * len(base), base[0].stderr[-3000:]
        return out

    reference = failure_free(f"test_megatron_tp_dp.reference-tp{tp}-pp{pp}", reference_run)
    results = train(tmp_path / "faulty", tp, pp, [fault])
    assert len((tmp_path / "faulty" / "faults.log").read_text().splitlines()) == 1  # the fault fired
    assert results[victim].returncode == -9, results[victim].stderr[-3000:]
    for r in layout.ranks(1):
        if r != victim:  # its replica is lost: left out (under unicron-run it would rejoin)
            assert results[r].returncode == 3, results[r].stderr[-3000:]
    reports = {}
    for r in layout.ranks(0):
        assert results[r].returncode == 0, results[r].stderr[-3000:]
        done = json.loads((tmp_path / "faulty" / f"rank{r}.json").read_text())
        assert done["members"] == [0]
        for ours, ref in zip(torch.load(tmp_path / "faulty" / f"params{r}.pt"),
                             torch.load(reference / f"params{r}.pt")):
            assert torch.equal(ours, ref), r
        report = done["reports"][1]
        assert report["recoveries"] == 1 and report["dead"] == [1] and sorted(report["micro_batches"]) == list(range(6))
        reports[r] = {**report, "forward_only": done["forward_only"]}
    return reports


@pytest.mark.compat
@pytest.mark.matrix  # (the Lightning tests cover TP2xDP2; this one runs with -m matrix)
@pytest.mark.timeout(400)
def test_tp2_killing_one_rank_loses_its_replica_and_the_other_replica_finishes(tmp_path: Path, failure_free) -> None:
    reports = run(tmp_path, failure_free, 2, 1, victim=3, fault=fail_at(rank=3, step=1, micro_batch=1))
    assert all(rep["kept_buckets"] == 0 for rep in reports.values())  # scenario 1


@pytest.mark.timeout(400)
def test_pp2_a_kill_in_the_last_stages_reduction_keeps_the_first_stage_which_runs_forward_only(tmp_path: Path,
                                                                                             failure_free) -> None:
    reports = run(tmp_path, failure_free, 1, 2, victim=3, fault=fail_at(rank=3, step=1, bucket=1))
    # the stage that lost a rank, right before the victim started bucket 1: what completed of bucket 0 is kept
    assert reports[1]["kept_buckets"] <= 1 and reports[1]["forward_only"] == []
    assert reports[0]["kept_buckets"] == 6 and reports[0]["forward_only"] == [1]  # reduced before: kept, no backward


@pytest.mark.matrix
@pytest.mark.timeout(400)
def test_pp2_a_kill_in_the_first_stages_reduction_recomputes_both_stages_keeping_the_last(tmp_path: Path,
                                                                                         failure_free) -> None:
    reports = run(tmp_path, failure_free, 1, 2, victim=2, fault=fail_at(rank=2, step=1, bucket=1))
    assert reports[0]["kept_buckets"] <= 1  # the first stage lost its reduction before its second bucket
    assert reports[1]["kept_buckets"] == 6  # the last stage reduced with replica 1's part: kept ...
    assert reports[0]["forward_only"] == reports[1]["forward_only"] == []  # ... but runs backward for stage 0
