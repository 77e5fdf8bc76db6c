"""A worker that talks to the unicron agent: heartbeats, resumable, fault injection.

    unicron-run --standalone --nproc-per-node=2 examples/resilient_worker.py --steps 50

Each rank appends JSON lines to ``OUT/rank<R>.jsonl`` (start with its PID, the
steps it finished, done) and keeps its last finished step in ``OUT/rank<R>.step``
so a restarted worker continues where the dead one stopped (a stand-in for the
strategy's state reload). Faults come from ``unicron_elastic.testing.fail_at``
through the environment. ``--plain`` does not declare the worker resumable
(torchrun's restart-all behaviour).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

from unicron_elastic.testing import maybe_fail
from unicron_elastic.worker import get_worker


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--jitter", type=float, default=0.0, help="step time varies by +- this fraction")
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    args.out.mkdir(parents=True, exist_ok=True)
    record = args.out / f"rank{rank}.jsonl"
    step_file = args.out / f"rank{rank}.step"

    def note(**fields) -> None:
        with record.open("a") as f:
            f.write(json.dumps({"rank": rank, "pid": os.getpid(), **fields}) + "\n")

    worker = get_worker()
    worker.hello(resumable=not args.plain)
    start = int(step_file.read_text()) + 1 if step_file.exists() else 0
    note(event="start", step=start, restarts=int(os.environ.get("UNICRON_WORKER_RESTARTS", "0")))

    def train_step(step: int) -> None:
        maybe_fail(rank, step)
        time.sleep(args.step_time * (1 + random.uniform(-args.jitter, args.jitter)))

    for step in range(start, args.steps):
        began = time.monotonic()
        worker.run_step(lambda: train_step(step), step)
        worker.heartbeat(step, time.monotonic() - began)
        tmp = step_file.with_suffix(".tmp")
        tmp.write_text(str(step))
        os.replace(tmp, step_file)  # atomic: a kill never leaves a half-written file
    note(event="done", step=args.steps - 1)


if __name__ == "__main__":
    main()
