"""Losing an etcd member: seconds from its SIGKILL to the job's next completed step.

A three-member etcd on loopback (``EmbeddedEtcdCluster``) and one
``unicron-run`` node (2 ranks of ``examples/resilient_worker.py``, steps of
``--step-time``) pointed at all three; once it trains, one member is
SIGKILLed: the member the job uses (the first of the list), or the cluster's
leader (a new one is elected meanwhile). Measured, side by side in each run:
the step interval just before the kill, and the seconds from the kill to the
next completed step (the step file changing). Each run is a fresh cluster and
job, the two victims alternate; each line reports the median of ``--runs``
(target: at most the node TTL, 2 s).

    python benchmarks/etcd_failover.py [--runs 3] [--step-time 0.05]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from unicron_elastic.store.client import StatusStore
from unicron_elastic.store.embedded import EmbeddedEtcdCluster
from unicron_elastic.testing import kill_node

ROOT = Path(__file__).resolve().parent.parent
NODE_TTL_S = 2.0


def _step(path: Path) -> int:
    try:
        return int(path.read_text() or -1)
    except (OSError, ValueError):
        return -1


def _changed(path: Path, after: int, deadline_s: float) -> float:
    """Poll ``path`` until its step passes ``after``; the time it was seen (monotonic)."""
    deadline = time.monotonic() + deadline_s
    while _step(path) <= after:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no step after {after} in {deadline_s} s")
        time.sleep(0.001)
    return time.monotonic()


def _leader(cluster: EmbeddedEtcdCluster) -> int:
    """The index of the cluster's leader among its members."""
    with StatusStore(cluster.config) as store:
        leader = store.call(lambda c: c.status().leader, "status")
    return next(i for i, m in enumerate(cluster.members) if any(m.endpoint in url for url in leader.client_urls))


def one_run(step_time: float, victim: str) -> tuple[float, float, str]:
    """One fresh cluster and job; ``victim`` is "in use" or "leader".

    Returns:
        The step interval before the kill, kill -> next step, and what the lost member was.
    """
    with EmbeddedEtcdCluster(3, cluster="bench") as cluster, \
            tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        out = Path(tmp) / "out"
        bin_dir = os.path.dirname(sys.executable)
        cmd = [os.path.join(bin_dir, "unicron-run"), f"--rdzv-endpoint={cluster.endpoint}", "--rdzv-id=bench",
               "--nnodes=1", "--nproc-per-node=2", "--monitor-interval=0.05", "--log-format=json",
               "--rdzv-conf=cluster=bench", str(ROOT / "examples" / "resilient_worker.py"),
               "--steps", "100000", "--step-time", str(step_time), "--out", str(out)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PATH=bin_dir + os.pathsep + os.environ["PATH"])
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        try:
            step_file = out / "rank0.step"
            _changed(step_file, 20, 120)  # trains
            leader = _leader(cluster)
            lost = 0 if victim == "in use" else leader
            what = {(True, True): "in use, the leader", (True, False): "in use, not the leader",
                    (False, True): "the leader, not in use"}[(lost == 0, lost == leader)]
            seen = _step(step_file)
            before = _changed(step_file, seen, 30)
            interval = _changed(step_file, _step(step_file), 30) - before
            at = _step(step_file)
            cluster.members[lost].proc.kill()
            killed = time.monotonic()
            return interval, _changed(step_file, at, 60) - killed, what
        finally:
            kill_node(proc.pid)  # the launcher and its workers (torch starts them in sessions of their own)
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--step-time", type=float, default=0.05)
    args = parser.parse_args()
    results: dict[str, list[float]] = {"in use": [], "leader": []}
    for run in range(args.runs):
        for victim, times in results.items():
            interval, failover, what = one_run(args.step_time, victim)
            times.append(failover)
            print(f"run {run}: step interval before {interval:.3f} s; member SIGKILLed ({what}) -> next step "
                  f"{failover:.3f} s", flush=True)
    for victim, times in results.items():
        median = statistics.median(times)
        print(f"etcd member {victim} SIGKILLed -> next completed step: median {median:.3f} s of {args.runs} "
              f"(target <= node TTL {NODE_TTL_S:g} s: {'met' if median <= NODE_TTL_S else 'NOT met'})")


if __name__ == "__main__":
    main()
