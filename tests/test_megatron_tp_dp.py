"""megatron-core tensor parallelism (TP=2) x resilient data parallelism (DP=2) on CPU/gloo."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import EXAMPLES
from unicron_elastic.testing import fail_at, faults_env, run_workers

pytestmark = pytest.mark.slow
WORKER = os.path.join(EXAMPLES, "megatron_tp_dp_worker.py")


def train(out: Path, faults) -> list[subprocess.CompletedProcess]:
    out.mkdir(parents=True, exist_ok=True)
    return run_workers(WORKER, 4, ["--out", str(out)], faults_env(faults, str(out / "faults.log")))


@pytest.mark.timeout(400)
def test_killing_one_rank_fails_its_replica_and_the_other_replica_finishes(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    base = train(reference, [])
    assert [r.returncode for r in base] == [0] * 4, base[0].stderr[-3000:]
    layout = {r: json.loads((reference / f"rank{r}.json").read_text()) for r in range(4)}
    assert {(v["tp"], v["dp"]) for v in layout.values()} == {(0, 0), (1, 0), (0, 1), (1, 1)}
    # kill the TP-rank-1 member of DP replica 1 in the middle of step 1
    victim = next(r for r, v in layout.items() if (v["tp"], v["dp"]) == (1, 1))
    partner = next(r for r, v in layout.items() if (v["tp"], v["dp"]) == (0, 1))
    survivors = [r for r, v in layout.items() if v["dp"] == 0]
    out = tmp_path / "faulty"
    results = train(out, [fail_at(rank=victim, step=1, micro_batch=1)])
    assert len((out / "faults.log").read_text().splitlines()) == 1  # the fault fired
    assert results[victim].returncode == -9, results[victim].stderr[-3000:]
    assert results[partner].returncode != 0, results[partner].stderr[-3000:]  # its replica is broken: it leaves too
    for r in survivors:
        assert results[r].returncode == 0, results[r].stderr[-3000:]
        reports = json.loads((out / f"rank{r}.json").read_text())["reports"]
        assert reports[1]["recoveries"] == 1 and sorted(reports[1]["micro_batches"]) == list(range(6))
        for ours, ref in zip(torch.load(out / f"params{r}.pt"), torch.load(reference / f"params{r}.pt")):
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
