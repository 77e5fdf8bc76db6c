"""Warm workers against plain subprocesses: kill -> the restarted rank's first completed step, and N workers' start.

``python benchmarks/warm_restart.py [--runs 3] [--nproc 2] [--start-nproc 4]``

Both sides run ``unicron-run --standalone`` on this machine, alternated run by run (warm, cold, warm, ...):
the warm side with the pool (``--preload auto``, one spare), the cold side with ``--no-preload`` (every
worker a plain subprocess, as torchrun starts it).

* **Kill -> first step**, in two examples on ``--nproc`` ranks (float64 sums, 0.1 s more per step):
  ``examples/elastic_dp_worker.py`` (the engine; rank 1 SIGKILLed at step 5, right after its
  optimizer step) and ``examples/lightning_gpt.py`` (Lightning's Trainer with ``unicron_megatron``;
  rank 1 SIGKILLed at step 5, before its first bucket's all-reduce; the survivors wait for a joiner
  before step 35, so that a slow restart still rejoins), and the same with ``--megatron`` (its GPT built
  from megatron-core's parallel layers). The figure is from the kill (its time in
  the fault log) to the end of the restarted process' first completed step. Each run also checks
  that rank 0 was never restarted and that every rank's parameters equal a failure-free run's to the bit.
* **Start N workers**: ``examples/allreduce.py`` on ``--start-nproc`` ranks, the launcher's wall time.

Targets: kill -> restarted rank's first completed step <= 1 s warm (median, each example); warm start
of N workers faster than cold (ratio < 1).
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
ALLREDUCE = str(ROOT / "examples" / "allreduce.py")
KILLED_AT, STEP_TIME = 5, 0.1
SIDES = {"warm": ("--preload", "auto", "--spares", "1"), "cold": ("--no-preload",)}


def _engine_steps(out: Path, rank: int) -> list[tuple[int, float]]:
    """``(pid, end time)`` of each step ``elastic_dp_worker.py``'s rank completed (its last process' reports)."""
    return [(r["pid"], r["finished_at"]) for r in json.loads((out / f"rank{rank}.json").read_text())
            if "finished_at" in r]


def _lightning_steps(out: Path, rank: int) -> list[tuple[int, float]]:
    """``(pid, end time)`` of each step ``lightning_gpt.py``'s rank completed, every process (``--record-times``)."""
    return [(r["pid"], r["t"]) for r in map(json.loads, (out / f"times{rank}.jsonl").read_text().splitlines())]


#: name -> (script, its arguments, the fault, the steps a rank completed)
EXAMPLES = {
    "engine": (ROOT / "examples" / "elastic_dp_worker.py",
               ["--steps", "40", "--step-time", str(STEP_TIME), "--grad-dtype", "float64"],
               dict(at="after_optimizer_step"), _engine_steps),
    "lightning": (ROOT / "examples" / "lightning_gpt.py",
                  ["--steps", "40", "--step-time", str(STEP_TIME), "--record-times", "--snapshot-every", "1",
                   "--hold-for-joiner", "35"],
                  dict(bucket=0), _lightning_steps),
    "megatron": (ROOT / "examples" / "lightning_gpt.py",
                 ["--megatron", "--steps", "40", "--step-time", str(STEP_TIME), "--record-times", "--snapshot-every",
                  "1", "--hold-for-joiner", "35"],
                 dict(bucket=0), _lightning_steps),
}


def _launch(side: str, nproc: int, script: str, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [os.path.join(BIN, "unicron-run"), "--standalone", f"--nproc-per-node={nproc}", "--monitor-interval=0.05",
           "--log-format=json", *SIDES[side], script, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def _params(out: Path, rank: int) -> list[torch.Tensor]:
    return torch.load(out / f"params{rank}.pt")


def kill_to_first_step(example: str, side: str, nproc: int, out: Path, reference: Path | None) -> float:
    """One run (``reference`` None: the failure-free one): seconds from rank 1's kill to its restarted process'
    first completed step.

    Raises:
        AssertionError: The run failed, rank 0 restarted, or the parameters differ from the failure-free run's.
    """
    script, args, where, steps = EXAMPLES[example]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    faults = [] if reference is None else [fail_at(rank=1, step=KILLED_AT, kind="kill", **where)]
    env.update(faults_env(faults, str(out / "faults.log")))
    result = _launch(side, nproc, str(script), [*args, "--out", str(out)], env)
    assert result.returncode == 0, result.stderr[-3000:]
    if reference is None:
        return float("nan")
    for rank in range(nproc):
        assert all(torch.equal(a, b) for a, b in zip(_params(out, rank), _params(reference, rank))), rank
    fired = [json.loads(line) for line in (out / "faults.log").read_text().splitlines()]
    assert len(fired) == 1, fired
    assert len({pid for pid, _ in steps(out, 0)}) == 1, "rank 0 restarted"
    restarted = [end for pid, end in steps(out, 1) if pid != fired[0]["pid"]]
    assert restarted, "the restarted rank completed no step"
    return restarted[0] - fired[0]["time"]


def start_time(side: str, nproc: int, out: Path) -> float:
    """One run: the launcher's wall time for ``allreduce.py`` on ``nproc`` workers."""
    began = time.monotonic()
    result = _launch(side, nproc, ALLREDUCE, ["--out", str(out)], dict(os.environ))
    assert result.returncode == 0, result.stderr[-3000:]
    return time.monotonic() - began


def _alternated(runs: int) -> list[str]:
    """warm, cold, cold, warm, warm, cold, ...: each side first in every other run."""
    return [side for run in range(runs) for side in (("warm", "cold") if run % 2 == 0 else ("cold", "warm"))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--start-nproc", type=int, default=4)
    parser.add_argument("--examples", default=",".join(EXAMPLES), help="of: " + ", ".join(EXAMPLES))
    args = parser.parse_args()
    verdicts = Verdicts()
    kill = {(example, side): [] for example in EXAMPLES for side in SIDES}
    start: dict[str, list[float]] = {"warm": [], "cold": []}
    examples = [e.strip() for e in args.examples.split(",") if e.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        for example in examples:
            reference = Path(tmp) / f"{example}-failure-free"
            kill_to_first_step(example, "cold", args.nproc, reference, None)
            for index, side in enumerate(_alternated(args.runs)):
                seconds = kill_to_first_step(example, side, args.nproc, Path(tmp) / f"{example}-{index}", reference)
                kill[(example, side)].append(seconds)
                print(f"{example} run {index // 2 + 1} {side}: kill -> restarted rank's first completed step "
                      f"{seconds:6.2f} s", flush=True)
        for index, side in enumerate(_alternated(args.runs)):
            seconds = start_time(side, args.start_nproc, Path(tmp) / f"start-{index}")
            start[side].append(seconds)
            print(f"run {index // 2 + 1} {side}: {args.start_nproc} workers, allreduce.py end to end {seconds:6.2f} s",
                  flush=True)
    print(f"== {args.nproc} ranks, rank 1 SIGKILLed at step {KILLED_AT}; {args.runs} alternated run(s) per side; "
          f"nobody else restarted, parameters equal to the failure-free run ==")
    for example in examples:
        warm, cold = (statistics.median(kill[(example, side)]) for side in ("warm", "cold"))
        print(f"{example:9s} kill -> restarted rank's first completed step, median: warm {warm:.2f} s, "
              f"cold {cold:.2f} s, ratio {warm / cold:.2f}  (target warm <= 1 s: "
              f"{verdicts.note(f'{example}: kill -> first step <= 1 s', at_most(warm, 1.0))})")
    warm_start, cold_start = statistics.median(start["warm"]), statistics.median(start["cold"])
    print(f"start {args.start_nproc} workers (allreduce.py end to end), median: warm {warm_start:.2f} s, "
          f"cold {cold_start:.2f} s, ratio {warm_start / cold_start:.2f}  (target < 1: "
          f"{verdicts.note('warm start faster', at_most(warm_start / cold_start, 0.999))})")
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return verdicts.exit_code()


if __name__ == "__main__":
    sys.exit(main())
