"""Detection latency of each method, unicron vs plain torchrun; hang verdicts' false alarms and real hangs.

For each fault (kill a worker, raise a classified exception, stall an
iteration, kill a node's agent) the fault is injected N times on CPU and the
median time from the fault to its detection is printed beside the paper's
figure (Table exp-detection) and beside plain torchrun on the same fault (time
until torchrun notices, or "not within bound"). Then a 200-iteration run with
+-10% jitter counts false alarms.

Then the hang verdict from progress against the rule it replaced (silence
after the last iteration longer than 3 x the mean iteration, at least 0.5 s):

* **false alarms**, in-process: both rules fed the same signs of life, runs x
  steps under step-time distributions a cluster shows (log-normal jitter of
  each gap with sigma 0.3 and 0.6; with the sigma-0.3 jitter besides: every
  10th step 6x longer, one rank throttled to a third of its speed for 20
  steps, the whole machine oversubscribed 3x from step 50), each at two
  scales (1 s steps with a progress message every 1/8 of it; 0.1 s steps
  with two); the steps with a verdict counted (a healthy rank declared hung:
  each one a needless restart);
* **real hangs**, measured under ``unicron-run`` (examples/lightning_gpt.py, 3
  ranks, steps of ~0.35 s): a SIGSTOPped rank, a Python infinite loop inside a
  micro-batch, a collective that never completes (``--hang-max-wait=20``,
  collective timeout 10 s), a deadlocked DataLoader worker; the time from the
  fault to the verdict, beside the old rule's, computed from the same run
  (its last iteration's end + max(3 x its mean iteration, 0.5 s)).

The script exits 1 when a target is not met.

    python benchmarks/detection.py [--runs 3] [--only-hangs]
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

from _targets import Verdicts, at_most, verdict  # (benchmarks/ is on the path: this script's folder)
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


# -- hang verdicts: false alarms (in-process) --------------------------------------------------------------


class OldRule:
    """The rule replaced: after 5 iterations, silence since the last iteration's end > max(3 x mean, 0.5 s)."""

    def __init__(self) -> None:
        self.count, self.mean, self.last = 0, 0.0, 0.0

    def beat(self, now: float, duration: float) -> None:
        self.count += 1
        self.mean += (duration - self.mean) / self.count
        self.last = now

    def sign(self, now: float) -> None:  # the strategy sent no progress then: only iterations counted
        pass

    def deadline(self) -> float | None:
        return None if self.count < 5 else self.last + max(3 * self.mean, 0.5)


class NewRule:
    """The hang verdict from progress (unicron_elastic.detection.hang, default thresholds)."""

    def __init__(self) -> None:
        from unicron_elastic.detection.hang import IterationMonitor

        self.monitor = IterationMonitor()

    def beat(self, now: float, duration: float) -> None:
        self.monitor.heartbeat(now, duration)

    def sign(self, now: float) -> None:
        self.monitor.sign(now)

    def deadline(self) -> float | None:
        return self.monitor.deadline()


def _gap_factor(row: str, step: int, rng) -> float:
    """How much longer than nominal each gap of ``step`` is under the distribution ``row``."""
    if row == "log-normal sigma 0.3":
        return rng.lognormvariate(0.0, 0.3)
    if row == "log-normal sigma 0.6":
        return rng.lognormvariate(0.0, 0.6)
    jitter = rng.lognormvariate(0.0, 0.3)  # (under each of the other rows too)
    if row == "every 10th step 6x":
        return jitter * (6.0 if step % 10 == 9 else 1.0)
    if row == "throttled 3x for 20 steps":
        return jitter * (3.0 if 50 <= step < 70 else 1.0)
    if row == "oversubscribed 3x":
        return jitter * (3.0 if step >= 50 else 1.0)
    return jitter


ROWS = ("log-normal sigma 0.3", "log-normal sigma 0.6", "every 10th step 6x", "throttled 3x for 20 steps",
        "oversubscribed 3x")


def false_verdicts(rule_cls, row: str, step_s: float, signs: int, steps: int, seed: int) -> int:
    """Verdicts of one rule on one healthy rank's run: the steps in which a gap passed the rule's deadline
    (each such step a needless restart)."""
    import random

    rng, rule, now, verdicts = random.Random(seed), rule_cls(), 0.0, 0
    for step in range(steps):
        began, hung = now, False
        for part in range(signs):
            gap = step_s / signs * _gap_factor(row, step, rng)
            deadline = rule.deadline()
            hung = hung or (deadline is not None and now + gap > deadline)
            now += gap
            if part < signs - 1:
                rule.sign(now)
        rule.beat(now, now - began)
        verdicts += hung
    return verdicts


def false_alarm_table(runs: int = 20, steps: int = 500) -> str:
    """The hang verdicts of both rules on healthy ranks, per distribution; returns the progress rule's verdict."""
    print(f"\nHang verdicts on healthy ranks, {runs} runs x {steps} steps per cell (in-process, same signs for both)\n")
    scales = ((1.0, 8), (0.1, 2))
    header = ["distribution"] + [f"{rule} ({s:g} s steps)" for s, _ in scales for rule in ("old rule", "progress")]
    rows, total = [], 0
    for row in ROWS:
        cells = [row]
        for step_s, signs in scales:
            for rule in (OldRule, NewRule):
                count = sum(false_verdicts(rule, row, step_s, signs, steps, seed) for seed in range(runs))
                total += count if rule is NewRule else 0
                cells.append(str(count))
        rows.append(cells)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    said = at_most(total, 0)
    print(f"\nfalse verdicts of the progress rule: {total}; target 0: {said}")
    return said


# -- hang verdicts: real hangs (unicron-run) ------------------------------------------------------------------

GPT = str(ROOT / "examples" / "lightning_gpt.py")


def real_hang_once(tmp: Path, fault, *extra: str, launcher: tuple[str, ...] = ()) -> tuple[float | None, float | None]:
    """One run with a real hang of rank 2: (seconds fault -> verdict, the old rule's computed seconds)."""
    log = tmp / "faults.log"
    cmd = [os.path.join(BIN, "unicron-run"), "--standalone", "--nproc-per-node=3", "--monitor-interval=0.05",
           "--log-format=json", *launcher, GPT, "--steps", "20", "--step-time", "0.3", "--record-times",
           "--hold-for-joiner", "15", "--out", str(tmp / "out"), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env([fault] if fault else [], log), timeout=300)
    fired = _fired(log) if log.exists() else None
    verdict = next((json.loads(line) for line in proc.stderr.splitlines() if '"error_event"' in line
                    and json.loads(line).get("kind") in ("task_hang", "collective_timeout")), None)
    if fired is None or verdict is None:
        return None, None
    ends = [json.loads(line)["t"] for line in (tmp / "out" / "times2.jsonl").read_text().splitlines()]
    before = [t for t in ends if t <= fired]
    durations = [b - a for a, b in zip(before, before[1:])]
    old = None
    if len(before) >= 6 and durations:
        old = before[-1] + max(3 * statistics.fmean(durations), 0.5) - fired
    return verdict["detected_at"] - fired, old


def real_hangs_table(runs: int) -> None:
    cases = [
        ("SIGSTOP in a micro-batch", fail_at(2, 7, micro_batch=5, kind="stop"), (), ()),
        ("infinite loop in a micro-batch", fail_at(2, 7, micro_batch=5, kind="spin"), (), ()),
        ("collective never completes", fail_at(2, 7, bucket=1, kind="stuck_collective"),
         ("--bucket-numel", "6560", "--collective-timeout", "10"), ("--hang-max-wait=20",)),
        ("DataLoader worker deadlock", None, ("--num-workers", "2", "--deadlock-load", "2", "40"), ()),
    ]
    rows = []
    for name, fault, extra, launcher in cases:
        ours, old = [], []
        for _ in range(runs):
            tmp = Path(tempfile.mkdtemp(prefix="unicron-bench-"))
            got, computed = real_hang_once(tmp, fault, *extra, launcher=launcher)
            ours.append(got)
            old.append(computed)
            shutil.rmtree(tmp, ignore_errors=True)
        old_text = ("never (its peers' waits are reported, and so is its own)" if fault is not None
                    and fault.kind == "stuck_collective" else fmt(old))
        rows.append((name, fmt(ours), old_text))
        print(f"measured {name}", file=sys.stderr, flush=True)
    print(f"\nReal hangs, median of {runs} (fault -> verdict), 3 ranks, steps of ~0.35 s\n")
    header = ("hang", "progress rule", "old rule (computed from the same run)")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
    for row in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--only-hangs", action="store_true", help="only the hang verdicts' two tables")
    args = parser.parse_args()
    verdicts = Verdicts()
    verdicts.note("false verdicts of the progress rule", false_alarm_table())
    real_hangs_table(args.runs)
    if args.only_hangs:
        return verdicts.exit_code()
    cases = [
        ("process exit", fail_at(1, 8, kind="kill"), "1.8 s", 0.3),
        ("exception", fail_at(0, 8, kind="raise", message="Connection reset by peer"), "0.3 s", 0.1),
        ("hang (D_iter 0.1 s)", fail_at(1, 12, kind="hang"), "3 x D_iter", 3.0 + 0.5),  # the 3 s floor
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
        said = verdicts.note(name, latency_verdict(ours, target))
        rows.append((name, fmt(ours), paper, fmt(plain), f"<= {target:.1f} s", said))
        print(f"measured {name}", file=sys.stderr, flush=True)
    with EmbeddedEtcd() as etcd:
        losses = []
        for run in range(args.runs):
            tmp = Path(tempfile.mkdtemp(prefix="unicron-bench-"))
            losses.append(node_loss_once(etcd, tmp, run))
            shutil.rmtree(tmp, ignore_errors=True)
    said = verdicts.note("node loss", latency_verdict(losses, 2.0))
    rows.append(("node loss (TTL 1 s)", fmt(losses), "5.6 s", "not within bound (no collective traffic)",
                 "<= 2.0 s", said))

    print(f"\nDetection latency, median of {args.runs} (fault -> event)\n")
    header = ("method", "unicron", "paper", "plain torchrun", "target", "")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    tmp = Path(tempfile.mkdtemp(prefix="unicron-bench-"))
    alarms, code = false_alarms(tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    said = verdicts.note("false alarms", alarms_verdict(alarms, code))
    print(f"\nfalse alarms in a 200-iteration run with +-10% jitter: {alarms} (exit code {code}); target 0: {said}")
    return verdicts.exit_code()


def latency_verdict(values: list[float | None], target: float) -> str:
    """Met when every run detected the fault (no None) and the median is within ``target`` seconds."""
    got = [v for v in values if v is not None]
    return verdict(bool(got) and len(got) == len(values) and statistics.median(got) <= target)


def alarms_verdict(alarms: int, code: int) -> str:
    """Met when the jittered run raised no alarm and exited 0."""
    return verdict(alarms == 0 and code == 0)


if __name__ == "__main__":
    sys.exit(main())
