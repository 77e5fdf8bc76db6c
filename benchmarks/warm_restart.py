"""Warm workers against plain subprocesses: kill -> the restarted rank's first completed step, and N workers' start.

``python benchmarks/warm_restart.py [--runs 3] [--nproc 2] [--start-nproc 4]``

Both sides run ``unicron-run --standalone`` on this machine, alternated run by run (warm, cold, warm, ...):
the warm side with the pool (``--preload auto``, one spare), the cold side with ``--no-preload`` (every
worker a plain subprocess, as torchrun starts it).

* **Kill -> first step**: ``examples/elastic_dp_worker.py`` (float64 sums, a step every 0.1 s) on
  ``--nproc`` ranks; rank 1 is SIGKILLed at step 5, right after its optimizer step (a fault); the figure is from the kill (its time in
  the fault log) to the end of the restarted process' first completed step (its report's
  ``finished_at``). Each run also checks that rank 0 was never restarted and that every rank's
  parameters equal a failure-free run's to the bit.
* **Start N workers**: ``examples/allreduce.py`` on ``--start-nproc`` ranks, the launcher's wall time.

Targets: kill -> restarted rank's first completed step <= 1 s warm (median); warm start of N workers
faster than cold (ratio < 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from _targets import Verdicts, at_most  # (benchmarks/ is on the path: this script's folder)
from unicron_elastic.faults import fail_at, faults_env

ROOT = Path(__file__).resolve().parent.parent
BIN = os.path.dirname(sys.executable)
WORKER = str(ROOT / "examples" / "elastic_dp_worker.py")
ALLREDUCE = str(ROOT / "examples" / "allreduce.py")
STEPS, KILLED_AT, STEP_TIME = 40, 5, 0.1
SIDES = {"warm": ("--preload", "auto", "--spares", "1"), "cold": ("--no-preload",)}


def _launch(side: str, nproc: int, script: str, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [os.path.join(BIN, "unicron-run"), "--standalone", f"--nproc-per-node={nproc}", "--monitor-interval=0.05",
           "--log-format=json", *SIDES[side], script, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def _params(out: Path, rank: int) -> list[torch.Tensor]:
    return torch.load(out / f"params{rank}.pt")


def kill_to_first_step(side: str, nproc: int, out: Path, reference: Path | None) -> float:
    """One run: seconds from rank 1's kill to its restarted process' first completed step.

    Raises:
        AssertionError: The run failed, rank 0 restarted, or the parameters differ from the failure-free run's.
    """
    env = dict(os.environ, OMP_NUM_THREADS="1")
    faults = [] if reference is None else [fail_at(rank=1, step=KILLED_AT, kind="kill", at="after_optimizer_step")]
    env.update(faults_env(faults, str(out / "faults.log")))
    result = _launch(side, nproc, WORKER, ["--steps", str(STEPS), "--step-time", str(STEP_TIME), "--out", str(out),
                                           "--grad-dtype", "float64"], env)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in range(nproc):
        if reference is not None:
            assert all(torch.equal(a, b) for a, b in zip(_params(out, rank), _params(reference, rank))), rank
    if reference is None:
        return float("nan")
    fired = [json.loads(line) for line in (out / "faults.log").read_text().splitlines()]
    assert len(fired) == 1, fired
    survivor = json.loads((out / "rank0.json").read_text())
    assert len({r["pid"] for r in survivor if "pid" in r}) == 1, "rank 0 restarted"
    restarted = [r for r in json.loads((out / "rank1.json").read_text()) if "finished_at" in r]
    assert restarted and restarted[0]["pid"] != fired[0]["pid"]
    return restarted[0]["finished_at"] - fired[0]["time"]


def start_time(side: str, nproc: int, out: Path) -> float:
    """One run: the launcher's wall time for ``allreduce.py`` on ``nproc`` workers."""
    began = time.monotonic()
    result = _launch(side, nproc, ALLREDUCE, ["--out", str(out)], dict(os.environ))
    assert result.returncode == 0, result.stderr[-3000:]
    return time.monotonic() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--start-nproc", type=int, default=4)
    args = parser.parse_args()
    verdicts = Verdicts()
    kill: dict[str, list[float]] = {"warm": [], "cold": []}
    start: dict[str, list[float]] = {"warm": [], "cold": []}
    with tempfile.TemporaryDirectory() as tmp:
        reference = Path(tmp) / "failure-free"
        kill_to_first_step("cold", args.nproc, reference, None)
        for run in range(args.runs):
            for side in ("warm", "cold") if run % 2 == 0 else ("cold", "warm"):
                seconds = kill_to_first_step(side, args.nproc, Path(tmp) / f"kill-{side}-{run}", reference)
                kill[side].append(seconds)
                print(f"run {run + 1} {side}: kill -> restarted rank's first completed step {seconds:6.2f} s")
        for run in range(args.runs):
            for side in ("warm", "cold") if run % 2 == 0 else ("cold", "warm"):
                seconds = start_time(side, args.start_nproc, Path(tmp) / f"start-{side}-{run}")
                start[side].append(seconds)
                print(f"run {run + 1} {side}: {args.start_nproc} workers, allreduce.py end to end {seconds:6.2f} s")
    warm_kill, cold_kill = statistics.median(kill["warm"]), statistics.median(kill["cold"])
    warm_start, cold_start = statistics.median(start["warm"]), statistics.median(start["cold"])
    print(f"== elastic_dp_worker.py on {args.nproc} ranks, rank 1 SIGKILLed at step {KILLED_AT}; "
          f"{args.runs} alternated run(s) per side; nobody else restarted, parameters equal to the failure-free run ==")
    print(f"kill -> restarted rank's first completed step, median: warm {warm_kill:.2f} s, cold {cold_kill:.2f} s, "
          f"ratio {warm_kill / cold_kill:.2f}  (target warm <= 1 s: "
          f"{verdicts.note('kill -> first step <= 1 s', at_most(warm_kill, 1.0))})")
    print(f"start {args.start_nproc} workers (allreduce.py end to end), median: warm {warm_start:.2f} s, "
          f"cold {cold_start:.2f} s, ratio {warm_start / cold_start:.2f}  (target < 1: "
          f"{verdicts.note('warm start faster', at_most(warm_start / cold_start, 0.999))})")
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return verdicts.exit_code()


if __name__ == "__main__":
    sys.exit(main())
