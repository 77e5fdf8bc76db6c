"""A resumable worker steered by files, for the channel fuzz test.

Each rank appends JSON lines to ``OUT/rank<R>.jsonl``: ``start`` (PID, the
agent's socket, restarts), ``reattempted`` (a step succeeded after the agent
said reattempt) and ``done``. ``OUT/rank<R>.step`` holds the last finished step
(a restarted worker continues from it). ``OUT/raise-<R>`` makes the next step
raise a connection reset once (SEV3: the agent must answer ``reattempt``
through the channel); ``OUT/stop`` ends the run.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from unicron_elastic.env import AGENT_SOCKET
from unicron_elastic.worker import get_worker


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--step-time", type=float, default=0.1)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    step_file = args.out / f"rank{rank}.step"

    def note(**fields: object) -> None:
        with (args.out / f"rank{rank}.jsonl").open("a") as f:
            f.write(json.dumps({"rank": rank, "pid": os.getpid(), **fields}) + "\n")

    worker = get_worker()
    worker.hello(resumable=True)
    step = int(step_file.read_text()) + 1 if step_file.exists() else 0
    note(event="start", step=step, socket=os.environ[AGENT_SOCKET.name],
         restarts=int(os.environ.get("UNICRON_WORKER_RESTARTS", "0")))
    attempts: list[int] = []

    def train_step() -> None:
        attempts.append(step)
        trigger = args.out / f"raise-{rank}"
        try:
            os.rename(trigger, args.out / f"raised-{rank}")  # claim the trigger once
        except FileNotFoundError:
            time.sleep(args.step_time)
            return
        raise ConnectionResetError("Connection reset by peer")

    while not (args.out / "stop").exists():
        began = time.monotonic()
        attempts.clear()
        worker.run_step(train_step, step)
        if len(attempts) > 1:
            note(event="reattempted", step=step)
        worker.heartbeat(step, time.monotonic() - began)
        tmp = step_file.with_suffix(".tmp")
        tmp.write_text(str(step))
        os.replace(tmp, step_file)
        step += 1
    note(event="done", step=step - 1)


if __name__ == "__main__":
    main()
