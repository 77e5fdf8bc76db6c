"""Healthy ranks under a noisy neighbour: no hang verdict, no restart, every rank trained.

Each run trains ``examples/lightning_gpt.py`` on 3 ranks for 30 steps under
``unicron-run --standalone`` with the agent's default detectors and
thresholds, ``OMP_NUM_THREADS=2`` (three workers of two threads each on the
machine's cores), and two CPU hogs (``while True`` processes): in even runs
from the start, in odd runs from the moment rank 0 has finished step 8. A run
passes when its agent logged no hang verdict (``task_hang``,
``collective_timeout``) and restarted no worker, and every rank ended at step
30 having trained every step in its first process. Straggler events (SEV3,
published only) are counted and shown.

    python benchmarks/noisy_neighbour.py [--runs 20]

Exits 1 when any run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _targets import at_most  # (benchmarks/ is on the path: this script's folder)
from unicron_elastic.testing import kill_node

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "lightning_gpt.py")
BIN = os.path.dirname(sys.executable)
RANKS, STEPS, HOG_AFTER = 3, 30, 8
VERDICTS = ("task_hang", "collective_timeout")


def _hogs(count: int = 2) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def _steps_done(out: Path) -> int:
    path = out / "times0.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def one_run(out: Path, hogs_from_start: bool) -> dict:
    """One run; its verdicts, restarts, straggler events, and whether every rank trained every step."""
    env = dict(os.environ, OMP_NUM_THREADS="2")
    cmd = [os.path.join(BIN, "unicron-run"), "--standalone", f"--nproc-per-node={RANKS}", "--log-format=json",
           GPT, "--steps", str(STEPS), "--out", str(out), "--record-times"]
    hogs = _hogs() if hogs_from_start else []
    began = time.monotonic()
    with (out / "agent.log").open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while not hogs and proc.poll() is None:
                if _steps_done(out) >= HOG_AFTER:
                    hogs = _hogs()
                time.sleep(0.05)
            code = proc.wait(timeout=900)
        finally:
            if proc.poll() is None:
                kill_node(proc.pid)
            for hog in hogs:
                hog.kill()
                hog.wait()
    events = [json.loads(line) for line in (out / "agent.log").read_text().splitlines() if line.startswith("{")]
    errors = [e for e in events if e.get("event") == "error_event"]
    trained = []
    for rank in range(RANKS):
        path = out / f"rank{rank}.json"
        done = json.loads(path.read_text()) if path.exists() else {}
        trained.append(done.get("global_step") == STEPS and done.get("joined_at") is None
                       and len(done.get("reports", [])) == STEPS)
    return {"code": code, "seconds": time.monotonic() - began,
            "verdicts": [f"{e['kind']}@{e['rank']}" for e in errors if e["kind"] in VERDICTS],
            "restarts": sum(e.get("event") == "worker_restarted" for e in events),
            "stragglers": [e["rank"] for e in errors if e["kind"] == "straggler"],
            "trained": all(trained)}


def passed(got: dict) -> bool:
    """A run passes: it exited 0 with no hang verdict and no restart, and every rank trained."""
    return got["code"] == 0 and not got["verdicts"] and not got["restarts"] and got["trained"]


def runs_verdict(failed: int) -> str:
    """The target: every run passed (``failed`` of them did not)."""
    return at_most(failed, 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    print(f"{'run':>3}  {'hogs':<12} {'exit':>4} {'seconds':>7}  {'verdicts':<10} {'restarts':>8}  "
          f"{'stragglers':<10} trained", flush=True)
    failed = 0
    for run in range(args.runs):
        from_start = run % 2 == 0
        with tempfile.TemporaryDirectory(prefix="unicron-noisy-") as tmp:
            got = one_run(Path(tmp), from_start)
        failed += not passed(got)
        print(f"{run:>3}  {'from start' if from_start else 'after step 8':<12} {got['code']:>4} "
              f"{got['seconds']:>7.1f}  {','.join(got['verdicts']) or '0':<10} {got['restarts']:>8}  "
              f"{','.join(map(str, got['stragglers'])) or '-':<10} {'yes' if got['trained'] else 'NO'}", flush=True)
    print(f"\n{args.runs - failed} of {args.runs} runs without a hang verdict or a restart, every rank trained; "
          f"target {args.runs}: {runs_verdict(failed)}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
