"""The distributed optimizer against the unsharded engine: optimizer memory per rank, step time, kill -> next step.

Four ranks (gloo, CPU) train the examples' MLP (``examples/elastic_dp_worker.py``) with AdamW and float64
gradient sums, the optimizer's state sharded over two instances (``--optimizer-instances 2``) or kept whole on
every rank. The two sides alternate, ``--runs`` times each:

* optimizer-state bytes per rank, read from the tensors each rank holds (fp32 main parameters and Adam's two
  moments when sharded; the two moments when not), against 12 x P / (DP / I);
* the median step time (wall time between a rank's consecutive steps, steps 2 and later);
* kill -> next step: rank 2 SIGKILLed in the gather of the parameters (sharded) or after the optimizer step
  (unsharded) of step 5; what the survivors' next step costs beyond a median step;
* megatron-core's own ``DistributedOptimizer`` in its ``DistributedDataParallel`` (``_megatron_do_worker.py``:
  the same MLP, data and global batch; reduce-scatter, AdamW on the shard, all-gather; one instance, as
  megatron-core needs einops for more), a third side in the same alternation: its state bytes and step time.

    python benchmarks/sharded.py --runs 3 --width 256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from _targets import Verdicts, at_most

REPO = Path(__file__).resolve().parent.parent
WORKER = str(REPO / "examples" / "elastic_dp_worker.py")
DP, INSTANCES, STEPS = 4, 2, 12


def _run(out: Path, sharded: bool, width: int, fault: dict | None = None) -> list[list[dict]]:
    """One run's per-rank step reports (a killed rank's are missing)."""
    from unicron_elastic.testing import fail_at, faults_env, run_workers

    args = ["--steps", str(STEPS), "--out", str(out), "--grad-dtype", "float64", "--optimizer", "adamw",
            "--width", str(width)] + (["--optimizer-instances", str(INSTANCES)] if sharded else [])
    env = faults_env([fail_at(**fault)] if fault else [], str(out / "faults.log"))
    results = run_workers(WORKER, DP, args, env, timeout=600)
    victim = fault["rank"] if fault else None
    bad = [r for r, res in enumerate(results) if res.returncode != 0 and r != victim]
    if bad:
        raise SystemExit(f"rank {bad[0]} failed:\n{results[bad[0]].stderr[-3000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) if r != victim else [] for r in range(DP)]


def _run_megatron(out: Path, width: int) -> list[list[dict]]:
    """megatron-core's DistributedOptimizer on the same MLP: per-rank step reports."""
    from unicron_elastic.testing import run_workers

    worker = str(REPO / "benchmarks" / "_megatron_do_worker.py")
    results = run_workers(worker, DP, ["--steps", str(STEPS), "--width", str(width), "--out", str(out)],
                          timeout=600)
    if any(res.returncode for res in results):
        raise SystemExit(f"megatron-core's DistributedOptimizer failed:\n{results[0].stderr[-3000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(DP)]


def _step_times(reports: list[list[dict]]) -> list[float]:
    times = []
    for rank in reports:
        ends = [rep["finished_at"] for rep in rank if "finished_at" in rep]
        times += [b - a for a, b in zip(ends[1:], ends[2:])]
    return times


def _kill_cost(reports: list[list[dict]], median: float) -> float:
    """The survivors' longest gap between step 5's end and step 6's end, less a median step."""
    gaps = []
    for rank in reports:
        ends = {rep["step"]: rep["finished_at"] for rep in rank if "finished_at" in rep}
        if 5 in ends and 6 in ends:
            gaps.append(ends[6] - ends[5])
    return max(gaps) - median


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--width", type=int, default=256, help="hidden width of the MLP")
    args = parser.parse_args()
    numel = 8 * args.width + args.width + args.width + 1
    times: dict[bool, list[float]] = {False: [], True: []}
    kills: dict[bool, list[float]] = {False: [], True: []}
    state: dict[bool, list[int]] = {}
    megatron_times: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            megatron = Path(tmp, f"{run}-megatron")
            if run % 2:  # the third side goes first on odd runs, last on even ones
                megatron_times += _step_times(_run_megatron(megatron, args.width))
            for sharded in (run % 2 == 0, run % 2 != 0):  # alternate which side goes first
                out = Path(tmp, f"{run}-{int(sharded)}")
                reports = _run(out, sharded, args.width)
                times[sharded] += _step_times(reports)
                state[sharded] = [json.loads((out / f"state{r}.json").read_text())["optimizer_state_bytes"]
                                  for r in range(DP)]
                fault = dict(rank=2, step=5, at="gather" if sharded else "after_optimizer_step")
                killed = _run(Path(tmp, f"{run}-{int(sharded)}-kill"), sharded, args.width, fault)
                kills[sharded].append(_kill_cost(killed, statistics.median(_step_times(reports))))
            if not run % 2:
                megatron_times += _step_times(_run_megatron(megatron, args.width))
            megatron_state = [json.loads((megatron / f"state{r}.json").read_text())["optimizer_state_bytes"]
                              for r in range(DP)]
    verdicts = Verdicts()
    share = 12 * numel / (DP / INSTANCES)
    print(f"== optimizer state per rank (DP {DP}, MLP width {args.width}: P = {numel} parameters, AdamW) ==")
    print(f"sharded, {INSTANCES} instances : {state[True]} bytes")
    print(f"unsharded           : {state[False]} bytes")
    print(f"megatron-core, 1 instance: {megatron_state} bytes (12 x P / DP = {12 * numel / DP:.0f})")
    worst = max(abs(b - share) / share for b in state[True])
    print(f"12 x P / (DP / I)   : {share:.0f} bytes; worst rank off by {100 * worst:.1f} %   target <= 5 %: "
          f"{verdicts.note('state bytes', at_most(worst, 0.05))}")
    step = {side: statistics.median(values) for side, values in times.items()}
    ratio = step[True] / step[False]
    print(f"\n== step time, median of {len(times[True])} steps a side ({args.runs} runs, alternated) ==")
    print(f"sharded   : {1000 * step[True]:8.2f} ms")
    print(f"unsharded : {1000 * step[False]:8.2f} ms")
    print(f"ratio     : {ratio:8.2f}x   target <= 1.5x: {verdicts.note('step time', at_most(ratio, 1.5))}")
    mega = statistics.median(megatron_times)
    print(f"megatron-core's DistributedOptimizer (its DDP, 1 instance): {1000 * mega:8.2f} ms "
          f"({len(megatron_times)} steps); sharded / megatron-core: {step[True] / mega:.2f}x (no target: "
          "megatron-core's step has no membership, recovery or float64 sums)")
    kill = {side: statistics.median(values) for side, values in kills.items()}
    print(f"\n== rank 2 killed at step 5, what the survivors' next step costs beyond a median step ({args.runs} runs) ==")
    print(f"sharded (killed in the gather)           : {1000 * kill[True]:8.1f} ms")
    print(f"unsharded (killed after the optimizer step): {1000 * kill[False]:8.1f} ms")
    print(f"sharded - unsharded                      : {1000 * (kill[True] - kill[False]):8.1f} ms   "
          f"target <= 500 ms: {verdicts.note('kill', at_most(kill[True] - kill[False], 0.5))}")
    return verdicts.exit_code()


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
