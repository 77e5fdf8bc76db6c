"""Step time with a slow ``__getitem__``: the user's DataLoader workers honoured, side by side in one run.

``examples/lightning_gpt.py`` (2 ranks, ``strategy="unicron_megatron"``, B = 6
micro-batches of 4 samples: 12 samples per rank and step) under
``unicron-run --standalone``, each sample taking ``--delay`` seconds to load
(a sleep: decoding, augmentation), with ``DataLoader(num_workers=N,
persistent_workers=True)`` for N in ``--workers`` (default 0 and 2), runs
alternated. Printed: the median step time of each and its ratio to
``num_workers=0`` (expected: falling with the workers, towards the compute
time once loading is hidden).

    python benchmarks/dataloader.py [--runs 2] [--steps 20] [--delay 0.01] [--workers 0 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
GPT = str(ROOT.parent / "examples" / "lightning_gpt.py")
BIN = os.path.dirname(sys.executable)


def run(workers: int, steps: int, delay: float) -> list[float]:
    """One run; the step times of rank 0 (the first 3 steps dropped: start-up)."""
    tmp = Path(tempfile.mkdtemp(prefix="unicron-bench-data-"))
    try:
        cmd = [os.path.join(BIN, "unicron-run"), "--standalone", "--nproc-per-node=2", "--hang-factor=20", GPT,
               "--steps", str(steps), "--out", str(tmp), "--record-times", "--num-workers", str(workers),
               "--load-delay", str(delay)]
        proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                              timeout=900)
        if proc.returncode != 0:
            raise SystemExit(f"num_workers={workers}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
        t = [json.loads(line)["t"] for line in (tmp / "times0.jsonl").read_text().splitlines()]
        return [b - a for a, b in zip(t[3:], t[4:])]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--delay", type=float, default=0.01, help="seconds per sample loaded")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    args = parser.parse_args()
    times: dict[int, list[float]] = {w: [] for w in args.workers}
    for _ in range(args.runs):
        for w in args.workers:  # alternated: drift of the machine hits every setting alike
            times[w].extend(run(w, args.steps, args.delay))
    base = statistics.median(times[args.workers[0]])
    print(f"== DataLoader workers, slow __getitem__ ({args.delay * 1000:.0f} ms per sample, 12 samples per rank "
          f"and step), unicron_megatron, 2 ranks, {args.runs} runs x {args.steps} steps ==")
    for w in args.workers:
        median = statistics.median(times[w])
        print(f"num_workers={w}: median step {median * 1000:8.1f} ms   ratio to num_workers={args.workers[0]}: "
              f"{median / base:5.2f}")


if __name__ == "__main__":
    main()
