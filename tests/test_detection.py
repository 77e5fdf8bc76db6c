"""Pure detection logic: the severity table, events, hang verdicts from progress, the detectors in-process."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time

import pytest

from unicron_elastic.agent.detectors import ExceptionDetector, HangDetector, ProcessDetector
from unicron_elastic.api import ConfigError, MalformedValueError
from unicron_elastic.detection.hang import HangThresholds, IterationMonitor
from unicron_elastic.detection.severity import SEVERITY_TABLE, classify
from unicron_elastic.events import Classification, ErrorEvent, Severity

# Table 1 of the paper, row by row, with messages as torch/CUDA/gloo print them.
TABLE_1 = [
    ("RuntimeError", "Connection refused by peer 10.0.0.2:29500", Severity.SEV3, "connection_reset"),
    ("RuntimeError", "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:8588", Severity.SEV3, "connection_reset"),
    ("RuntimeError", "ECONNRESET while receiving", Severity.SEV3, "connection_reset"),
    ("RuntimeError", "CUDA error: an illegal memory access was encountered", Severity.SEV2, "illegal_memory_access"),
    ("RuntimeError", "CUDA error: uncorrectable ECC error encountered", Severity.SEV1, "ecc"),
    ("RuntimeError", "NCCL WARN Invalid DMA mapping", Severity.SEV1, "invalid_dma_mapping"),
    ("RuntimeError", "CUDA error: out of memory", Severity.SEV2, "cuda"),
    ("RuntimeError", "NVLink error on link 3", Severity.SEV1, "nvlink"),
    ("RuntimeError", "CUDA driver version is insufficient for CUDA runtime version", Severity.SEV1, "gpu_driver"),
    ("RuntimeError", "GPU has fallen off the bus", Severity.SEV1, "gpu_driver"),
    ("RuntimeError", "NCCL error: unhandled system error, socket timed out", Severity.SEV3, "network"),
    ("ConnectionError", "host unreachable", Severity.SEV3, "network"),
    ("ValueError", "shapes (3,4) and (5,) not aligned", Severity.SEV2, "software"),
    ("KeyError", "'lr'", Severity.SEV2, "software"),
    ("NonFiniteError", "non-finite loss or gradients in step 3, first produced by rank 1: training stops",
     Severity.SEV1, "non_finite"),
    ("ForeignCheckpoint", "the checkpoint /o/preempted.ckpt was written by SLURM job 500_0 (run 500_0-0), not by "
     "this job 500_1", Severity.SEV1, "foreign_checkpoint"),
]


@pytest.mark.parametrize(("exc_type", "message", "severity", "kind"), TABLE_1)
def test_severity_table(exc_type: str, message: str, severity: Severity, kind: str) -> None:
    assert classify(exc_type, message) == Classification(severity, kind)


def test_every_table_row_is_exercised() -> None:
    kinds = {row[3] for row in TABLE_1}
    assert {rule.kind for rule in SEVERITY_TABLE} <= kinds


def test_event_json_round_trip_and_malformed() -> None:
    event = ErrorEvent(Severity.SEV2, "exited_abnormally", "process", "node-a", rank=3, task="t",
                       message="exit -9", occurred_at=10.0, detected_at=10.25)
    back = ErrorEvent.from_json(event.to_json())
    assert back == event and back.latency == pytest.approx(0.25)
    assert '"severity": "SEV2"' in event.to_json()
    for raw in (b"{}", b"nope", b'{"severity": "SEV9"}'):
        with pytest.raises(MalformedValueError):
            ErrorEvent.from_json(raw)


# -- hang verdicts from progress ------------------------------------------------
# The monitor's defaults: a hang is no sign of life for 5 x the largest gap between signs in the last 100
# iterations, and at least 3 s; no alarm until an iteration after the first 5 of a configuration has ended.


def _run(monitor: IterationMonitor, durations: list[float], start: float = 0.0, signs: int = 1) -> tuple[float, list]:
    """Feed iterations of ``durations``, each in ``signs`` equal parts: a progress sign after each part but the
    last, a heartbeat at its end; the hang findings that a check at each sign would make, in order."""
    now, findings = start, []
    for d in durations:
        for part in range(signs):
            deadline = monitor.deadline()
            if deadline is not None and now + d / signs > deadline:
                findings.append(monitor.check(now + d / signs))
            now += d / signs
            if part < signs - 1:
                monitor.sign(now)
        finding = monitor.heartbeat(now, d)
        if finding:
            findings.append(finding)
    return now, [f for f in findings if f is not None]


def _hangs(findings: list) -> list:
    return [f for f in findings if f.kind != "link_flapping"]


def test_no_false_alarm_over_200_iterations_with_10_percent_jitter() -> None:
    rng = random.Random(7)
    monitor = IterationMonitor()
    _, findings = _run(monitor, [0.1 * rng.uniform(0.9, 1.1) for _ in range(200)])
    assert findings == []
    assert monitor.count == 200 and monitor.mean == pytest.approx(0.1, rel=0.05)


def test_hang_is_reported_after_the_safety_factor_times_the_largest_recent_gap() -> None:
    monitor = IterationMonitor(HangThresholds(min_silence=1.0))
    now, _ = _run(monitor, [1.0] * 20, signs=4)  # signs every 0.25 s, one gap of 0.5 s in the last iteration
    monitor.sign(now + 0.5)
    now += 0.5
    assert monitor.largest_gap == pytest.approx(0.5)
    assert monitor.check(now + 2.49) is None  # 5 x 0.5 s
    finding = monitor.check(now + 2.51)
    assert (finding.severity, finding.kind) == (Severity.SEV2, "task_hang")
    assert finding.since == now and "5x the largest recent gap 0.500s" in finding.message
    assert monitor.check(now + 50) is None  # reported once
    monitor.heartbeat(now + 60, 60.0)
    assert monitor.deadline() is not None  # armed again after recovery


def test_silence_counts_from_the_last_progress_not_the_last_iteration() -> None:
    # iterations of 4 s with progress every 0.4 s: the old rule (3 x mean) waited 12 s; progress decides now
    monitor = IterationMonitor(HangThresholds(min_silence=1.0))
    now, _ = _run(monitor, [4.0] * 10, signs=10)
    for k in range(1, 6):
        monitor.sign(now + 0.4 * k)
    assert monitor.check(now + 2.0 + 1.99) is None  # 5 x 0.4 s after the last sign
    assert monitor.check(now + 2.0 + 2.01).kind == "task_hang"


def test_a_rank_slowing_down_gradually_is_never_hung() -> None:
    # each iteration 10 % slower than the one before, for 100 iterations (x 13,780 in all): progress keeps coming
    monitor = IterationMonitor(HangThresholds(min_silence=0.0))
    _, findings = _run(monitor, [0.1 * 1.1**k for k in range(100)], signs=5)
    assert _hangs(findings) == []


def test_a_sudden_stall_far_beyond_any_gap_seen_is_a_hang() -> None:
    monitor = IterationMonitor(HangThresholds(min_silence=0.0))
    _, findings = _run(monitor, [0.1] * 20 + [10.0], signs=5)  # gaps of 0.02 s, then one of 2 s
    assert [f.kind for f in _hangs(findings)] == ["task_hang"]


def test_gaps_of_the_warmup_iterations_do_not_calibrate_the_bound() -> None:
    monitor = IterationMonitor(HangThresholds(warmup=5, min_silence=0.0))
    now, _ = _run(monitor, [30.0] + [0.1] * 9, signs=2)  # a slow first step (start-up, a regroup)
    assert monitor.largest_gap == pytest.approx(0.05)
    assert monitor.check(now + 0.3).kind == "task_hang"


def test_the_bound_forgets_gaps_older_than_the_window() -> None:
    monitor = IterationMonitor(HangThresholds(gap_window=10, min_silence=0.0))
    now, _ = _run(monitor, [0.1] * 6 + [1.0] + [0.1] * 9)
    assert monitor.largest_gap == pytest.approx(1.0)
    now, _ = _run(monitor, [0.1], start=now)
    assert monitor.largest_gap == pytest.approx(0.1)


def test_stall_inside_a_collective_is_sev3() -> None:
    monitor = IterationMonitor()
    now, _ = _run(monitor, [0.2] * 10)
    monitor.set_state(now, in_collective=True)
    finding = monitor.check(now + 3.1)
    assert (finding.severity, finding.kind) == (Severity.SEV3, "collective_timeout")


def test_a_rank_waiting_on_its_group_is_spared_until_the_longest_wait() -> None:
    monitor = IterationMonitor(HangThresholds(max_wait=30.0))
    now, _ = _run(monitor, [0.2] * 10)
    for k in range(200):  # "still waiting", every 0.15 s, for 30 s
        monitor.set_state(now + 0.15 * k, waiting=True)
        assert monitor.check(now + 0.15 * k + 0.01) is None
    finding = monitor.check(now + 30.01)
    assert (finding.severity, finding.kind) == (Severity.SEV3, "collective_timeout")
    assert finding.since == now and "never completes" in finding.message
    monitor.set_state(now + 30.1, waiting=True)  # its watch thread goes on saying so: reported once
    assert monitor.check(now + 30.2) is None


def test_a_new_wait_restarts_the_wait_clock() -> None:
    monitor = IterationMonitor(HangThresholds(max_wait=30.0))
    now, _ = _run(monitor, [0.2] * 10)
    for k in range(150):  # 22.5 s waiting, then the wait ends and another starts
        monitor.set_state(now + 0.15 * k, waiting=True)
    monitor.set_state(now + 22.5, waiting=False)
    for k in range(150):
        monitor.set_state(now + 22.6 + 0.15 * k, waiting=True)
    assert monitor.check(now + 22.6 + 0.15 * 149 + 0.01) is None


def test_no_alarm_during_warmup_or_checkpoint_pause() -> None:
    monitor = IterationMonitor(HangThresholds(warmup=5))
    now, _ = _run(monitor, [0.2] * 4)
    assert monitor.check(now + 100) is None  # still warming up
    now, _ = _run(monitor, [0.2] * 6, start=now)
    monitor.set_state(now, paused=True)  # checkpoint
    assert monitor.check(now + 100) is None
    monitor.set_state(now + 100, paused=False)
    assert monitor.largest_gap == pytest.approx(0.2)  # the pause is no gap
    assert monitor.check(now + 102.9) is None  # the pause does not count; the floor (3 s) does
    assert monitor.check(now + 103.1).kind == "task_hang"


def test_a_bounded_pause_protects_only_until_its_bound() -> None:
    # a regroup is a declared pause; a rank stuck in it past its bound is still found
    monitor = IterationMonitor(HangThresholds(warmup=5))
    now, _ = _run(monitor, [0.2] * 6)
    monitor.set_state(now, paused=True, pause_for=10.0)
    assert monitor.check(now + 12.9) is None  # within the bound (+ the allowed silence)
    assert monitor.check(now + 13.1).kind == "task_hang"  # stuck past it


def test_a_regroup_that_ends_in_time_is_no_hang() -> None:
    monitor = IterationMonitor(HangThresholds(warmup=5))
    now, _ = _run(monitor, [0.2] * 6)
    monitor.set_state(now, paused=True, pause_for=10.0)
    monitor.set_state(now + 5, paused=False)
    assert monitor.check(now + 6.5) is None
    monitor.set_state(now + 6.5, paused=True)  # an unbounded pause (checkpoint) after it is unbounded again
    assert monitor.check(now + 1000) is None


def test_a_peer_failure_delays_the_silence_count_by_the_grace() -> None:
    # a survivor waits in a collective until it notices the failure: not a hang, but a stuck one is still found
    monitor = IterationMonitor(HangThresholds(warmup=5, peer_failure_grace=2.0))
    now, _ = _run(monitor, [0.2] * 6)
    monitor.peer_failed(now + 0.1)
    assert monitor.check(now + 2.1 + 2.99) is None
    assert monitor.check(now + 2.1 + 3.01).kind == "task_hang"


def test_a_heartbeat_ends_the_peer_failure_grace() -> None:
    monitor = IterationMonitor(HangThresholds(warmup=5, peer_failure_grace=10.0))
    now, _ = _run(monitor, [0.2] * 6)
    monitor.peer_failed(now)
    monitor.heartbeat(now + 0.3, 0.3)
    assert monitor.check(now + 0.3 + 3.01).kind == "task_hang"  # counted from the beat again


def test_the_hang_detector_gives_the_grace_to_the_other_workers_only() -> None:
    detector, ctx = HangDetector(HangThresholds(warmup=1, peer_failure_grace=4.0, min_silence=0.3)), _Context()
    detector.ctx = ctx
    detector.on_workers_started([0, 1], "g0")
    t0 = time.monotonic()
    for rank in (4, 5):
        detector.on_message({"t": "beat", "rank": rank, "step": 0, "dur": 0.1}, t0 + 1.0)
        detector.on_message({"t": "beat", "rank": rank, "step": 1, "dur": 0.1}, t0 + 1.0)
    detector.on_rank_failed(4, t0 + 1.0)
    assert detector.monitors[5].deadline() == pytest.approx(t0 + 5.0 + 0.3)
    assert detector.monitors[4].deadline() == pytest.approx(t0 + 1.0 + 0.3)


def test_silence_shorter_than_the_floor_is_never_a_hang_however_short_the_gaps() -> None:
    # gaps of 0.05 s: 5 x 0.05 s is 0.25 s, which a busy host's scheduling stall exceeds; the floor is 3 s
    monitor = IterationMonitor()
    now, _ = _run(monitor, [0.05] * 10)
    assert monitor.check(now + 2.99) is None
    finding = monitor.check(now + 3.01)
    assert finding.kind == "task_hang" and "at least 3s" in finding.message
    slow = IterationMonitor()  # gaps of 1 s: the factor decides, not the floor
    now, _ = _run(slow, [1.0] * 10)
    assert slow.check(now + 4.9) is None and slow.check(now + 5.1).kind == "task_hang"


def test_statistics_reset_per_configuration() -> None:
    monitor = IterationMonitor()
    now, _ = _run(monitor, [0.1] * 20)
    monitor.reset("dp=3", now)  # reconfigured: iterations now take 0.4 s
    now, findings = _run(monitor, [0.4] * 20, start=now)
    assert findings == [] and monitor.mean == pytest.approx(0.4) and monitor.largest_gap == pytest.approx(0.4)


def test_link_flapping_after_a_run_of_slow_iterations() -> None:
    monitor = IterationMonitor(HangThresholds(flap_window=4))
    now, _ = _run(monitor, [0.1] * 20)
    _, findings = _run(monitor, [0.1, 0.2, 0.2, 0.2, 0.1, 0.2, 0.2, 0.2, 0.2], start=now)
    assert [(f.severity, f.kind) for f in findings] == [(Severity.SEV3, "link_flapping")]
    assert monitor.noise >= 7


@pytest.mark.parametrize("kwargs", [{"noise_factor": 1.0}, {"hang_factor": 1.0}, {"warmup": 0}, {"flap_window": 0},
                                    {"hang_factor": float("inf")}, {"hang_factor": float("nan")},
                                    {"noise_factor": 1.6}, {"gap_window": 0},
                                    {"peer_failure_grace": -1.0}, {"peer_failure_grace": float("nan")},
                                    {"peer_failure_grace": 1e9}, {"min_silence": -0.1},
                                    {"min_silence": float("inf")}, {"min_silence": "1"},
                                    {"max_wait": 0.5}, {"max_wait": float("inf")}])
def test_bad_thresholds_are_rejected(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        HangThresholds(**kwargs)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), -0.5])
def test_a_non_finite_or_negative_duration_never_reaches_the_mean(bad: float) -> None:
    monitor = IterationMonitor()
    now, _ = _run(monitor, [0.2] * 10)
    mean, count = monitor.mean, monitor.count
    assert monitor.heartbeat(now + 0.2, bad) is None
    assert monitor.check(now + 0.21) is None  # a healthy worker is not declared hung
    assert (monitor.mean, monitor.count, monitor.rejected) == (mean, count, 1)
    assert monitor.check(now + 3.01).kind == "task_hang"  # the bad beat proves nothing: a real hang still counts


class _Context:
    """A detector context with two local workers, global ranks 4 and 5."""

    def __init__(self) -> None:
        self.hangs: list = []
        self.exceptions: list = []

    def workers(self) -> dict:
        return {0: (4, None), 1: (5, None)}

    def hang(self, rank, finding) -> None:
        self.hangs.append((rank, finding))

    def exception(self, rank, msg, classification, received) -> None:
        self.exceptions.append(rank)

    def classify(self, exc_type, message, traceback):
        return classify(exc_type, message)


def test_the_hang_detector_keeps_monitors_only_for_its_own_workers() -> None:
    detector, ctx = HangDetector(), _Context()
    detector.ctx = ctx
    detector.on_workers_started([0, 1], "g0")
    for rank in range(20_000):
        detector.on_message({"t": "beat", "rank": rank, "step": 0, "dur": 0.1}, 1.0)
    assert sorted(detector.monitors) == [4, 5]
    assert detector.dropped == 20_000 - 2
    detector.on_message({"t": "beat", "rank": 4, "step": 1, "dur": float("nan")}, 1.1)
    assert detector.monitors[4].mean == pytest.approx(0.1) and ctx.hangs == []


def test_the_exception_detector_ignores_ranks_that_are_not_its_workers() -> None:
    detector, ctx = ExceptionDetector(), _Context()
    detector.ctx = ctx
    for rank in (4, 7, 1000):
        report = {"t": "exc", "rank": rank, "type": "ValueError", "msg": "m", "step": 1, "fatal": False}
        detector.on_message(report, 1.0)
    assert ctx.exceptions == [4] and detector.dropped == 2


class _ProcessContext:
    """Two real child processes as local workers 0 and 1 (global ranks 4, 5); exits are recorded."""

    def __init__(self, procs: list[subprocess.Popen]) -> None:
        self.procs, self.exited, self.seen = procs, [], threading.Event()

    def workers(self) -> dict:
        return {i: (4 + i, p) for i, p in enumerate(self.procs)}

    def worker_exited(self, local_rank, pid, exitcode, detected_at) -> None:
        self.exited.append((local_rank, pid, exitcode))
        self.seen.set()


def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def test_the_process_detector_is_woken_by_an_exit_and_follows_restarted_workers() -> None:
    healthy, failing = _child("import time; time.sleep(60)"), _child("import sys, time; time.sleep(0.3); sys.exit(3)")
    ctx, detector = _ProcessContext([healthy, failing]), ProcessDetector()
    detector.start(ctx)
    try:
        detector.on_workers_started([0, 1], "g0")
        assert ctx.seen.wait(30), "the exit was not reported"
        assert ctx.exited == [(1, failing.pid, 3)]
        ctx.seen.clear()
        restarted = _child("import sys; sys.exit(7)")  # a restart: a new process for local rank 1
        ctx.procs[1] = restarted
        detector.on_workers_started([1], "g1")
        assert ctx.seen.wait(30), "the restarted worker's exit was not reported"
        assert ctx.exited[1:] == [(1, restarted.pid, 7)] and healthy.poll() is None
        healthy.terminate()  # SIGTERM: exit code -15, reported too (every non-zero code is)
        deadline = time.monotonic() + 30
        while len(ctx.exited) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ctx.exited[2:] == [(0, healthy.pid, -15)]
    finally:
        detector.stop()
        for p in ctx.procs + [healthy, failing]:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_the_process_detector_polls_where_there_are_no_pidfds() -> None:
    failing = _child("import sys; sys.exit(2)")
    ctx, detector = _ProcessContext([failing]), ProcessDetector(interval=0.01)
    detector.pidfds = False
    detector.start(ctx)
    try:
        detector.on_workers_started([0], "g0")
        assert ctx.seen.wait(30) and ctx.exited == [(0, failing.pid, 2)]
    finally:
        detector.stop()


def test_the_hang_detector_wakes_at_the_deadline_not_on_a_tick() -> None:
    # interval 60 s: only the deadline (no gap seen, floor 0) can wake it in time
    detector = HangDetector(HangThresholds(warmup=1, min_silence=0.0), interval=60.0)
    ctx = _Context()
    detector.start(ctx)
    try:
        detector.on_workers_started([0, 1], "g0")
        now = time.monotonic()
        for step in (0, 1):  # rank 5 never beats: no alarm
            detector.on_message({"t": "beat", "rank": 4, "step": step, "dur": 0.1}, now)
        deadline = time.monotonic() + 30
        while not ctx.hangs and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [(rank, f.kind) for rank, f in ctx.hangs] == [(4, "task_hang")]
        assert time.monotonic() - now < 20  # long before the 60 s interval
    finally:
        detector.stop()
