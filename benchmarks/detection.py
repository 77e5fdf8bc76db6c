"""Detection latency of each method, unicron vs plain torchrun, measured in one run.

For each fault (kill a worker, raise a classified exception, stall an
iteration, kill a node's agent) the fault is injected N times on CPU and the
median time from the fault to its detection is printed beside the paper's
figure (Table exp-detection) and beside plain torchrun on the same fault (time
until torchrun notices, or "not within bound"). Then a 200-iteration run with
+-10% jitter counts false alarms.

    python benchmarks/detection.py [--runs 3]
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
import time
from datetime import datetime, timezone
from pathlib import Path

from unicron_elastic.store import EmbeddedEtcd, StatusStore
from unicron_elastic.testing import fail_at, faults_env, kill_node

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "examples" / "resilient_worker.py")
BIN = os.path.dirname(sys.executable)
STEP = 0.1  # D_iter of the benchmark job
BOUND = 10.0  # seconds we wait for plain torchrun to notice


def _env(faults, log: Path) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=BIN + os.pathsep + os.environ["PATH"])
    env.update(faults_env(faults, str(log)))
    return env


def _fired(log: Path) -> float:
    return json.loads(log.read_text().splitlines()[0])["time"]


def unicron_once(fault, tmp: Path, *flags: str) -> float | None:
    log = tmp / "faults.log"
    cmd = [os.path.join(BIN, "unicron-run"), "--standalone", "--nproc-per-node=2", "--monitor-interval=0.05",
           "--log-format=json", *flags, WORKER, "--steps", "40", "--step-time", str(STEP), "--out", str(tmp / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env([fault], log), timeout=120)
    for line in proc.stderr.splitlines():
        if '"error_event"' in line:
            return json.loads(line)["detected_at"] - _fired(log)
    return None


def _torch_log_time(line: str) -> float:
    # glog prefix: E1121 05:17:33.312000 <pid> ...  (UTC on this machine)
    stamp = line[1:5] + " " + line[6:21]
    parsed = datetime.strptime(f"{datetime.now(timezone.utc).year}{stamp}", "%Y%m%d %H:%M:%S.%f")
    return parsed.replace(tzinfo=timezone.utc).timestamp()


def torchrun_once(fault, tmp: Path) -> float | None:
    """Plain torchrun (c10d standalone): when does it notice? None: not within BOUND."""
    log = tmp / "faults.log"
    cmd = [os.path.join(BIN, "torchrun"), "--standalone", "--nproc-per-node=2", WORKER, "--steps", "400",
           "--step-time", str(STEP), "--out", str(tmp / "out")]
    env = _env([fault], log)
    env.pop("UNICRON_AGENT_SOCKET", None)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _, err = proc.communicate(timeout=BOUND + 8)
    except subprocess.TimeoutExpired:
        kill_node(proc.pid)
        proc.communicate()
        return None
    for line in err.splitlines():
        if "failed (exitcode" in line:
            return _torch_log_time(line) - _fired(log)
    return None


def node_loss_once(etcd: EmbeddedEtcd, tmp: Path, run: int, ttl: int = 1) -> float | None:
    cluster = f"bench{run}"
    conf = f"--rdzv-conf=cluster={cluster},keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=1"
    cmd = [os.path.join(BIN, "unicron-run"), f"--rdzv-endpoint={etcd.endpoint}", f"--rdzv-id={cluster}",
           "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=2", f"--node-ttl={ttl}", conf,
           WORKER, "--steps", "400", "--step-time", str(STEP), "--out", str(tmp / "out")]
    env = _env([], tmp / "none.log")
    nodes = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env) for _ in range(2)]
    store = StatusStore(etcd.config.__class__(port=etcd.client_port, cluster=cluster))
    try:
        deadline = time.monotonic() + 60
        while len(store.get_prefix(store.keys.nodes())) < 2 or len(list((tmp / "out").glob("*.step"))) < 2:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)
        victim = next(iter(store.get_json_prefix(store.keys.nodes())))
        killed = time.time()
        kill_node(int(victim.rsplit("-", 1)[-1]))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            for kv in store.get_prefix(store.keys.events()):
                event = json.loads(kv.value)
                if event["kind"] == "lost_connection":
                    return event["detected_at"] - killed
            time.sleep(0.02)
        return None
    finally:
        for p in nodes:
            kill_node(p.pid)
            p.wait()


def false_alarms(tmp: Path) -> tuple[int, int]:
    cmd = [os.path.join(BIN, "unicron-run"), "--standalone", "--nproc-per-node=2", "--log-format=json",
           WORKER, "--steps", "200", "--step-time", "0.02", "--jitter", "0.1", "--out", str(tmp / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env([], tmp / "none.log"), timeout=300)
    alarms = sum('"error_event"' in line for line in proc.stderr.splitlines())
    beats = sum(1 for _ in (tmp / "out").glob("rank*.jsonl"))
    return alarms, proc.returncode if beats else -1


def fmt(values: list[float | None]) -> str:
    got = [v for v in values if v is not None]
    if not got:
        return "not within bound"
    text = f"{statistics.median(got):.3f} s"
    return text if len(got) == len(values) else f"{text} ({len(values) - len(got)} not within bound)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    cases = [
        ("process exit", fail_at(1, 8, kind="kill"), "1.8 s", 0.3),
        ("exception", fail_at(0, 8, kind="raise", message="Connection reset by peer"), "0.3 s", 0.1),
        ("hang (D_iter 0.1 s)", fail_at(1, 12, kind="hang"), "3 x D_iter", 3 * STEP + 0.5),
    ]
    rows = []
    for name, fault, paper, target in cases:
        ours, plain = [], []
        for _ in range(args.runs):
            tmp = Path(tempfile.mkdtemp(prefix="unicron-bench-"))
            ours.append(unicron_once(fault, tmp))
            shutil.rmtree(tmp, ignore_errors=True)
            tmp = Path(tempfile.mkdtemp(prefix="unicron-bench-"))
            plain.append(torchrun_once(fault, tmp))
            shutil.rmtree(tmp, ignore_errors=True)
        got = [v for v in ours if v is not None]
        met = bool(got) and len(got) == len(ours) and statistics.median(got) <= target
        rows.append((name, fmt(ours), paper, fmt(plain), f"<= {target:.1f} s", "met" if met else "NOT met"))
        print(f"measured {name}", file=sys.stderr, flush=True)
    with EmbeddedEtcd() as etcd:
        losses = []
        for run in range(args.runs):
            tmp = Path(tempfile.mkdtemp(prefix="unicron-bench-"))
            losses.append(node_loss_once(etcd, tmp, run))
            shutil.rmtree(tmp, ignore_errors=True)
    got = [v for v in losses if v is not None]
    met = bool(got) and len(got) == len(losses) and statistics.median(got) <= 2.0
    rows.append(("node loss (TTL 1 s)", fmt(losses), "5.6 s", "not within bound (no collective traffic)",
                 "<= 2.0 s", "met" if met else "NOT met"))

    print(f"\nDetection latency, median of {args.runs} (fault -> event)\n")
    header = ("method", "unicron", "paper", "plain torchrun", "target", "")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    tmp = Path(tempfile.mkdtemp(prefix="unicron-bench-"))
    alarms, code = false_alarms(tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nfalse alarms in a 200-iteration run with +-10% jitter: {alarms} (exit code {code}); "
          f"target 0: {'met' if alarms == 0 and code == 0 else 'NOT met'}")


if __name__ == "__main__":
    main()
