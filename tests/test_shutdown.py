"""Clean shutdown of ``unicron-run`` and ``unicron etcd``: signals, failure paths, bad input.

Real launchers, real etcd, real workers (``examples/resilient_worker.py``).
After every stop: no process of the job is left, no ``unicron-*`` temp dir or
etcd data dir (``TMPDIR`` points at a folder of the test's own), and no worker
was restarted. ``UNICRON_SIGNAL_REPEAT=10`` repeats each signal case ten times.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import BIN, EXAMPLES, json_log_entries, wait_for_launcher
from unicron_elastic.agent.agent import AgentConfig
from unicron_elastic.api import ConfigError, EtcdConfig
from unicron_elastic.launcher import agent_config, get_parser
from unicron_elastic.rendezvous.options import parse_options
from unicron_elastic.store import EmbeddedEtcd, StatusStore, free_port
from unicron_elastic.testing import process_tree

WORKER = os.path.join(EXAMPLES, "resilient_worker.py")
REPEAT = int(os.environ.get("UNICRON_SIGNAL_REPEAT", "1"))
#: Steps of 20 ms jitter far beyond 3x on a loaded machine: these tests are about stopping, not
#: hang detection (tests/test_agent.py), so a false hang must not restart a worker here.
HANG = "--hang-factor=100"
#: A resumable worker that, like one saving a checkpoint, takes a moment (argv[2] s, default 0.3)
#: to exit on SIGTERM/SIGINT (exit code 1): the window in which the agent used to take the stop for
#: a crash and respawn it.
GRACEFUL_WORKER = """
import json, os, signal, sys, time
from pathlib import Path
from unicron_elastic.worker import get_worker

out, rank = Path(sys.argv[1]), int(os.environ["RANK"])
delay = float(sys.argv[2]) if len(sys.argv) > 2 else 0.3
out.mkdir(parents=True, exist_ok=True)

def leave(signum, frame):
    time.sleep(delay)
    sys.exit(1)

signal.signal(signal.SIGTERM, leave)
signal.signal(signal.SIGINT, leave)
worker = get_worker()
worker.hello(resumable=True)
with (out / f"rank{rank}.jsonl").open("a") as f:
    f.write(json.dumps({"event": "start", "pid": os.getpid()}) + "\\n")
step = 0
while True:
    began = time.monotonic()
    time.sleep(0.02)
    worker.heartbeat(step, time.monotonic() - began)
    (out / f"rank{rank}.step").write_text(str(step))
    step += 1
"""


# -- helpers ------------------------------------------------------------------------


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    return dict(os.environ, TMPDIR=str(tmp), OMP_NUM_THREADS="1",
                PATH=BIN + os.pathsep + os.environ.get("PATH", ""), **extra)


def _start_time(pid: int) -> str | None:
    """Start time of ``pid`` (None: gone or a zombie), to tell it from a reused PID."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else fields[19]


class Snapshot:
    """The processes of a job at one moment; tells which of them still run."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.started = {pid: _start_time(pid) for pid in process_tree(root)}

    def add(self, root: int) -> None:
        self.started.update({pid: _start_time(pid) for pid in process_tree(root)})

    def alive(self) -> list[int]:
        return [pid for pid, start in self.started.items() if start is not None and _start_time(pid) == start]

    def kill(self) -> None:
        if self.root in self.alive():
            self.add(self.root)  # what it started since the last look
        for pid in self.alive():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _leftovers(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("unicron"))


def _agent_dir_exists(tmp: Path) -> bool:
    return any(p.name.startswith("unicron-") and not p.name.startswith("unicron-etcd") for p in tmp.iterdir())


def _assert_clean(snapshot: Snapshot, tmp: Path, seconds: float = 15) -> None:
    """Every process of the snapshot ends and no unicron temp dir is left (within a deadline)."""
    deadline = time.monotonic() + seconds
    while (snapshot.alive() or _leftovers(tmp)) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:200] for pid in snapshot.alive()}
    assert not alive, f"processes of the job still running: {alive}"
    assert _leftovers(tmp) == [], "temp dirs left behind"


def _log_events(log: Path) -> list[dict]:
    return json_log_entries(log)


@pytest.fixture()
def job_tmp(tmp_path: Path) -> Path:
    """A TMPDIR of the test's own."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    return tmp


@pytest.fixture()
def snapshots() -> Iterator[list[Snapshot]]:
    """Snapshots of the test's jobs: whatever a failed test leaves running is killed afterwards."""
    taken: list[Snapshot] = []
    yield taken
    for snapshot in taken:
        snapshot.kill()


def _worker(tmp_path: Path) -> str:
    path = tmp_path / "graceful_worker.py"
    path.write_text(GRACEFUL_WORKER)
    return str(path)


def _launch(tmp_path: Path, tmp: Path, *flags: str, nproc: int = 1,
            exit_delay: float = 0.3) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / "launcher.log"
    cmd = [os.path.join(BIN, "unicron-run"), "--standalone", f"--nproc-per-node={nproc}", "--monitor-interval=0.05",
           HANG, "--log-format=json", *flags, _worker(tmp_path), str(tmp_path / "out"), str(exit_delay)]
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(tmp))
    return proc, log


def _training(out: Path, nproc: int) -> bool:
    return all((out / f"rank{r}.step").exists() for r in range(nproc))


# -- item 1, 5, 13: signals to unicron-run ------------------------------------------------


def _signal_cases() -> list:
    """Every signal x world x phase; the default tier runs SIGTERM to a training job of 2 (the rest: -m e2e).

    The compat selection runs SIGTERM and SIGINT (Ctrl-C) to a training job of 2.
    """
    return [pytest.param(sig, nproc, phase, repeat, id=f"{sig.name}-{nproc}-{phase}-{repeat}",
                         marks=(() if (sig, nproc, phase, repeat) == (signal.SIGTERM, 2, "training", 0)
                                else (pytest.mark.e2e,))
                         + ((pytest.mark.compat,) if (nproc, phase, repeat) == (2, "training", 0) else ()))
            for sig in (signal.SIGINT, signal.SIGTERM) for nproc in (1, 2) for phase in ("rendezvous", "training")
            for repeat in range(REPEAT)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("sig", "nproc", "phase", "repeat"), _signal_cases())
def test_signal_stops_the_whole_job_and_leaves_nothing(sig: signal.Signals, nproc: int, phase: str, repeat: int,
                                                      tmp_path: Path, job_tmp: Path,
                                                      snapshots: list[Snapshot]) -> None:
    # one launcher of --nnodes=2 waits in the rendezvous for ever; --nnodes=1 trains
    proc, log = _launch(tmp_path, job_tmp, "--nnodes=2" if phase == "rendezvous" else "--nnodes=1", nproc=nproc)
    snapshot = Snapshot(proc.pid)
    snapshots.append(snapshot)
    out = tmp_path / "out"
    if phase == "rendezvous":
        wait_for_launcher(lambda: _agent_dir_exists(job_tmp), 60, "agent temp dir", log, proc)
    else:
        wait_for_launcher(lambda: _training(out, nproc), 60, "training steps", log, proc)
    snapshot.add(proc.pid)  # etcd, its guard and the workers
    if phase == "training":
        assert len(snapshot.started) >= 2 + nproc, snapshot.started
    signalled = time.time()
    proc.send_signal(sig)
    code = proc.wait(timeout=60)
    text = log.read_text()
    _assert_clean(snapshot, job_tmp)
    entries = _log_events(log)
    assert [e for e in entries if e.get("event") == "worker_restarted"] == [], text[-3000:]
    assert [e for e in entries if e.get("event") == "error_event" and e.get("detected_at", 0) >= signalled] == [], \
        text[-3000:]
    assert code == 128 + sig, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    for rank in range(nproc):
        path = out / f"rank{rank}.jsonl"
        starts = [r for r in map(json.loads, path.read_text().splitlines())] if path.exists() else []
        assert len([r for r in starts if r["event"] == "start"]) == (1 if phase == "training" else 0), starts


@pytest.mark.e2e
@pytest.mark.timeout(90)
def test_a_second_signal_does_not_break_off_the_stop(tmp_path: Path, job_tmp: Path,
                                                     snapshots: list[Snapshot]) -> None:
    proc, log = _launch(tmp_path, job_tmp, nproc=2, exit_delay=1.0)
    snapshot = Snapshot(proc.pid)
    snapshots.append(snapshot)
    wait_for_launcher(lambda: _training(tmp_path / "out", 2), 60, "training steps", log, proc)
    snapshot.add(proc.pid)
    proc.send_signal(signal.SIGTERM)
    wait_for_launcher(lambda: "agent_stopping" in log.read_text(), 30, "agent_stopping", log, proc)
    proc.send_signal(signal.SIGINT)  # impatient operator: the workers are still saving
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM, log.read_text()[-3000:]
    _assert_clean(snapshot, job_tmp)
    text = log.read_text()
    assert "stop_signal_ignored" in text and "worker_restarted" not in text, text[-3000:]


@pytest.mark.compat
@pytest.mark.e2e
@pytest.mark.timeout(90)
def test_stop_takes_no_longer_than_the_shutdown_timeout(tmp_path: Path, job_tmp: Path,
                                                        snapshots: list[Snapshot]) -> None:
    """Workers that ignore SIGTERM are killed after --shutdown-timeout; nothing is respawned meanwhile."""
    proc, log = _launch(tmp_path, job_tmp, "--shutdown-timeout=2", nproc=2, exit_delay=3600)
    snapshot = Snapshot(proc.pid)
    snapshots.append(snapshot)
    wait_for_launcher(lambda: _training(tmp_path / "out", 2), 60, "training steps", log, proc)
    snapshot.add(proc.pid)
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM, log.read_text()[-3000:]
    assert time.monotonic() - signalled < 2 + 8  # the timeout, then SIGKILL, etcd stop and clean-up
    _assert_clean(snapshot, job_tmp)
    assert "worker_restarted" not in log.read_text()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("repeat", range(REPEAT))
def test_sigterm_during_etcd_start_up_leaves_no_etcd(repeat: int, tmp_path: Path, job_tmp: Path,
                                                    snapshots: list[Snapshot]) -> None:
    """A signal during etcd's start-up (before any agent exists) unwinds too."""
    proc, log = _launch(tmp_path, job_tmp, "--nnodes=2")
    snapshot = Snapshot(proc.pid)
    snapshots.append(snapshot)

    def etcd_started() -> bool:
        snapshot.add(proc.pid)
        return len(snapshot.started) > 1

    wait_for_launcher(etcd_started, 60, "etcd process", log, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM, log.read_text()[-3000:]
    _assert_clean(snapshot, job_tmp)


@pytest.mark.timeout(60)
def test_sigkill_of_the_launcher_takes_its_private_etcd_along(tmp_path: Path, job_tmp: Path,
                                                             snapshots: list[Snapshot]) -> None:
    proc, log = _launch(tmp_path, job_tmp, "--nnodes=2")
    snapshot = Snapshot(proc.pid)
    snapshots.append(snapshot)
    wait_for_launcher(lambda: _agent_dir_exists(job_tmp), 60, "agent temp dir", log, proc)
    snapshot.add(proc.pid)
    proc.kill()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 15
    while snapshot.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert snapshot.alive() == []
    wait_for_launcher(lambda: not [n for n in _leftovers(job_tmp) if n.startswith("unicron-etcd")], 15,
                      "etcd data dir removal")


# -- item 1: agent failure paths stop everything, never respawn -------------------------------


def _start_training(cmd: list[str], log: Path, out: Path, job_tmp: Path,
                    snapshots: list[Snapshot]) -> tuple[subprocess.Popen, Snapshot]:
    """Start ``cmd`` logging to ``log``, wait until both workers train; its process tree is recorded."""
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(job_tmp))
    snapshot = Snapshot(proc.pid)
    snapshots.append(snapshot)
    wait_for_launcher(lambda: _training(out, 2), 60, "training steps", log, proc)
    snapshot.add(proc.pid)
    return proc, snapshot


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_corrupt_rendezvous_state_stops_the_workers_without_respawn(etcd: EmbeddedEtcd, tmp_path: Path,
                                                                   job_tmp: Path, snapshots: list[Snapshot]) -> None:
    run_id, cluster = "corrupt-state", "shutdown-corrupt"
    log = tmp_path / "launcher.log"
    out = tmp_path / "out"
    cmd = [os.path.join(BIN, "unicron-run"), f"--rdzv-endpoint={etcd.endpoint}", f"--rdzv-id={run_id}",
           f"--rdzv-conf=cluster={cluster}", "--nproc-per-node=2", "--monitor-interval=0.05", HANG, "--log-format=json",
           _worker(tmp_path), str(out)]
    proc, snapshot = _start_training(cmd, log, out, job_tmp, snapshots)
    with StatusStore(EtcdConfig(host="127.0.0.1", port=etcd.client_port, cluster=cluster)) as store:
        store.put(store.keys.rdzv(run_id), b"not a rendezvous state")
    code = proc.wait(timeout=60)
    text = log.read_text()
    assert code != 0, text[-3000:]
    assert "corrupt" in text
    _assert_clean(snapshot, job_tmp)
    assert [e for e in _log_events(log) if e.get("event") == "worker_restarted"] == [], text[-3000:]


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_etcd_outage_past_the_reconnect_timeout_stops_the_workers_without_respawn(
        private_etcd: EmbeddedEtcd, tmp_path: Path, job_tmp: Path, snapshots: list[Snapshot]) -> None:
    log = tmp_path / "launcher.log"
    out = tmp_path / "out"
    cmd = [os.path.join(BIN, "unicron-run"), f"--rdzv-endpoint={private_etcd.endpoint}", "--rdzv-id=outage",
           "--rdzv-conf=cluster=shutdown-outage,reconnect_timeout=2,request_timeout=1", "--nproc-per-node=2",
           "--monitor-interval=0.05", HANG, "--log-format=json", _worker(tmp_path), str(out)]
    proc, snapshot = _start_training(cmd, log, out, job_tmp, snapshots)
    private_etcd.kill()  # and it stays down
    code = proc.wait(timeout=90)
    text = log.read_text()
    assert code != 0, text[-3000:]
    _assert_clean(snapshot, job_tmp)
    assert [e for e in _log_events(log) if e.get("event") == "worker_restarted"] == [], text[-3000:]


# -- item 5: unicron etcd ----------------------------------------------------------------------


def _unicron_etcd(tmp_path: Path, tmp: Path, snapshots: list[Snapshot]) -> tuple[subprocess.Popen, Snapshot]:
    proc = subprocess.Popen([os.path.join(BIN, "unicron"), "etcd"], stdout=subprocess.PIPE,
                            stderr=(tmp_path / "etcd.log").open("w"), text=True, env=_env(tmp))
    snapshot = Snapshot(proc.pid)
    snapshots.append(snapshot)  # killed after the test whatever happens
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("etcd ready"), (tmp_path / "etcd.log").read_text()
    snapshot.add(proc.pid)
    assert len(snapshot.started) >= 3  # the CLI, etcd and its guard
    return proc, snapshot


@pytest.mark.timeout(60)
@pytest.mark.parametrize("repeat", range(REPEAT))
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_unicron_etcd_stops_cleanly_on_signal(sig: signal.Signals, repeat: int, tmp_path: Path,
                                             job_tmp: Path, snapshots: list[Snapshot]) -> None:
    proc, snapshot = _unicron_etcd(tmp_path, job_tmp, snapshots)
    proc.send_signal(sig)
    assert proc.wait(timeout=30) == 0, (tmp_path / "etcd.log").read_text()
    _assert_clean(snapshot, job_tmp)


@pytest.mark.timeout(60)
def test_sigkill_of_unicron_etcd_takes_etcd_along(tmp_path: Path, job_tmp: Path,
                                                 snapshots: list[Snapshot]) -> None:
    proc, snapshot = _unicron_etcd(tmp_path, job_tmp, snapshots)
    proc.kill()
    proc.wait(timeout=10)
    _assert_clean(snapshot, job_tmp)


GUARDED_OWNER = """
import sys, threading, time
from unicron_elastic.store import EmbeddedEtcd
holder = []
thread = threading.Thread(target=lambda: holder.append(EmbeddedEtcd().start()))
thread.start()
thread.join()
print("etcd-pid", holder[0].proc.pid, flush=True)
time.sleep(3600)
"""


@pytest.mark.timeout(60)
def test_guard_stops_etcd_started_by_a_thread_of_a_killed_owner(tmp_path: Path, job_tmp: Path,
                                                                snapshots: list[Snapshot]) -> None:
    """An owner killed outright: the guard process stops etcd and removes its data."""
    import sys

    proc = subprocess.Popen([sys.executable, "-c", GUARDED_OWNER], stdout=subprocess.PIPE, text=True,
                            env=_env(job_tmp))
    assert proc.stdout is not None
    snapshot = Snapshot(proc.pid)
    snapshots.append(snapshot)  # killed after the test whatever happens
    line = ""
    while not line.startswith("etcd-pid "):  # structlog prints to stdout in a bare process
        line = proc.stdout.readline()
        assert line, "the owner ended early"
    etcd_pid = int(line.split()[1])
    snapshot.add(proc.pid)
    assert etcd_pid in snapshot.started and len(snapshot.started) >= 3  # owner, etcd, guard
    assert [n for n in _leftovers(job_tmp) if not n.endswith(".log")]  # the data dir exists
    proc.kill()
    proc.wait(timeout=10)
    _assert_clean(snapshot, job_tmp)


def test_embedded_etcd_started_from_a_thread_outlives_the_thread() -> None:
    """A server started by a short-lived thread keeps running (nothing ties it to that thread)."""
    import threading

    holder: list[EmbeddedEtcd] = []
    thread = threading.Thread(target=lambda: holder.append(EmbeddedEtcd().start()))
    thread.start()
    thread.join(timeout=60)
    server = holder[0]
    try:
        time.sleep(0.3)
        assert server.proc is not None and server.proc.poll() is None
        with StatusStore(server.config) as store:
            assert store.healthy()
    finally:
        server.stop()


# -- item 11: one clear line, exit 2 -----------------------------------------------------------


def _busy_port() -> tuple[socket.socket, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock, sock.getsockname()[1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["rdzv_conf_key", "endpoint", "ca_cert", "metrics_port", "etcd_binary",
                                  "node_ttl", "detectors"])
def test_unicron_run_bad_input_is_one_line_and_exit_2(case: str, tmp_path: Path, job_tmp: Path) -> None:
    endpoint = f"--rdzv-endpoint=127.0.0.1:{free_port()}"
    env = _env(job_tmp)
    sock = None
    flags, expected = {
        "rdzv_conf_key": ([endpoint, "--rdzv-conf=bogus=1"], "unknown --rdzv-conf key(s) bogus"),
        "endpoint": (["--rdzv-endpoint=127.0.0.1:notaport"], "port 'notaport' is not a number"),
        "ca_cert": ([endpoint, "--rdzv-conf=ca_cert=/nonexistent/ca.pem"], "ca_cert"),
        "metrics_port": (["--standalone"], "--metrics-port"),
        "etcd_binary": (["--standalone"], "UNICRON_ETCD_BINARY"),
        "node_ttl": (["--standalone", "--node-ttl=0"], "--node-ttl"),
        "detectors": (["--standalone", "--detectors=process,bogus"], "bogus"),
    }[case]
    if case == "metrics_port":
        sock, port = _busy_port()
        flags = [*flags, f"--metrics-port={port}"]
    if case == "etcd_binary":
        env["UNICRON_ETCD_BINARY"] = "/nonexistent/etcd"
    cmd = [os.path.join(BIN, "unicron-run"), *flags, "--nproc-per-node=1", WORKER, "--steps", "1",
           "--out", str(tmp_path / "out")]
    started = time.monotonic()
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=50)
    finally:
        if sock is not None:
            sock.close()
    elapsed = time.monotonic() - started
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("unicron-run: error: ")]
    assert len(errors) == 1 and expected in errors[0], result.stderr[-3000:]
    assert elapsed < 12, elapsed  # before any retry loop (a missing ca_cert used to take 13 s)
    assert _leftovers(job_tmp) == []


# -- item 12: detection silently off ----------------------------------------------------------------


def test_node_ttl_below_one_is_refused() -> None:
    for ttl in (0, -1):
        with pytest.raises(ConfigError, match="node_ttl"):
            AgentConfig(node_ttl=ttl)


def test_unknown_detector_is_refused_with_the_known_names() -> None:
    args = get_parser().parse_args(["--detectors=process,bogus", "train.py"])
    with pytest.raises(ConfigError, match=r"bogus.*hang"):
        agent_config(args)
    args = get_parser().parse_args(["--detectors=,", "train.py"])
    with pytest.raises(ConfigError, match="--detectors"):
        agent_config(args)
    assert agent_config(get_parser().parse_args(["train.py"])).detectors == ("node", "process", "exception", "hang",
                                                                             "straggler", "nvml")


@pytest.mark.parametrize("raw", ["-1", "nan", "inf", "1e9"])
def test_a_bad_peer_failure_grace_is_refused_naming_the_flag(raw: str) -> None:
    args = get_parser().parse_args([f"--peer-failure-grace={raw}", "train.py"])
    with pytest.raises(ConfigError, match="--peer-failure-grace"):
        agent_config(args)
    assert agent_config(get_parser().parse_args(["train.py"])).hang.peer_failure_grace == 5.0


@pytest.mark.parametrize("raw", ["-1", "nan", "inf", "1e9"])
def test_a_bad_hang_min_silence_is_refused_naming_the_flag(raw: str) -> None:
    args = get_parser().parse_args([f"--hang-min-silence={raw}", "train.py"])
    with pytest.raises(ConfigError, match="--hang-min-silence"):
        agent_config(args)
    assert agent_config(get_parser().parse_args(["train.py"])).hang.min_silence == 3.0


@pytest.mark.parametrize(("flag", "raw"), [("--hang-max-wait", "0.5"), ("--hang-max-wait", "nan"),
                                           ("--hang-gap-window", "0"), ("--hang-factor", "1"),
                                           ("--straggler-factor", "1"), ("--straggler-window", "2")])
def test_a_bad_hang_or_straggler_setting_is_refused_naming_the_flag(flag: str, raw: str) -> None:
    args = get_parser().parse_args([f"{flag}={raw}", "train.py"])
    with pytest.raises(ConfigError, match=flag):
        agent_config(args)
    config = agent_config(get_parser().parse_args(["train.py"]))
    assert (config.hang.hang_factor, config.hang.gap_window, config.hang.max_wait) == (5.0, 100, 90.0)
    assert (config.straggler.factor, config.straggler.window) == (1.5, 10)


def test_missing_tls_files_are_refused_before_any_connection(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    with pytest.raises(ConfigError, match="ca_cert.*nonexistent"):
        parse_options("127.0.0.1:2379", "r", {"ca_cert": "/nonexistent/ca.pem"})
    with pytest.raises(ConfigError, match="cert_key"):
        parse_options("127.0.0.1:2379", "r", {"ca_cert": str(ca), "cert_key": str(tmp_path / "no.key"),
                                              "cert_cert": str(ca)})
    assert parse_options("127.0.0.1:2379", "r", {"ca_cert": str(ca)}).etcd.ca_cert == str(ca)

