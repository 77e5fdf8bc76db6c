"""A real SLURM cluster on one machine, for tests, demos and benchmarks (not for production).

One ``slurmctld``, one ``slurmd`` per emulated node (``slurmd -N NAME``, all
on 127.0.0.1, each with a port of its own) and a private ``munged``: Debian's
``slurmd slurmctld munge`` packages, started as root in a temp dir with free
ports and stopped (their processes, jobs and files) by :meth:`LoopbackSlurm.stop`.
Every emulated node is the same host: ``SLURMD_NODENAME`` tells them apart.

A node is lost as on a real cluster (:meth:`LoopbackSlurm.kill_node`): its
``slurmd`` and every process of its job steps (``slurmstepd``, the tasks and
all below them) are SIGKILLed, then SLURM is told it is down.
"""

from __future__ import annotations

import os
import pwd
import random
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import structlog

from unicron_elastic.api import UnicronError
from unicron_elastic.env import LOOPBACK_SLURM_NODE
from unicron_elastic.processes import process_tree
from unicron_elastic.slurm.api import parse_node_line, state_flags
from unicron_elastic.store.embedded import free_port

log = structlog.get_logger(__name__)

#: The environment variable that marks a loopback node's ``slurmd`` (and the ``slurmstepd`` it starts).
NODE_MARK_ENV = LOOPBACK_SLURM_NODE.name
#: Seconds a job credential lives, and so how long SLURM holds a requeued job back (its default is 120).
CRED_EXPIRE_S = 10
#: Seconds a preempted job of partition ``main`` gets between SLURM's SIGTERM and its SIGKILL (``GraceTime``).
GRACE_TIME_S = 60
#: What a loopback cluster needs on PATH (Debian: ``apt-get install slurmd slurmctld munge``).
BINARIES = ("slurmctld", "slurmd", "munged", "mungekey", "srun", "sbatch", "scontrol", "scancel", "sinfo", "squeue")


class SlurmStartError(UnicronError, RuntimeError):
    """The loopback SLURM cluster could not be started (missing packages, not root, a daemon that failed)."""


def _conf(directory: Path, nodes: list[str], ports: dict[str, int], cpus: int, first_job: int) -> str:
    lines = [
        "ClusterName=loopback", "SlurmctldHost=localhost", f"SlurmctldPort={ports['ctld']}",
        f"SlurmdPort={ports['slurmd']}", "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge",
        # a credential's lifetime is also how long a requeued job is held back (slurmd refuses to launch a job id
        # whose credential it revoked until then): 10 s instead of 120 s
        f"AuthInfo=socket={directory}/munge-run/munge.socket,cred_expire={CRED_EXPIRE_S}", "CredType=cred/munge",
        f"StateSaveLocation={directory}/state", f"SlurmdSpoolDir={directory}/spool/%n",
        f"SlurmctldPidFile={directory}/slurmctld.pid", f"SlurmdPidFile={directory}/slurmd-%n.pid",
        f"SlurmctldLogFile={directory}/log/slurmctld.log", f"SlurmdLogFile={directory}/log/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SchedulerType=sched/backfill",
        "SelectType=select/cons_tres", "ReturnToService=2", "MpiDefault=none", "KillWait=10",
        "SchedulerParameters=sched_interval=2,bf_interval=2",  # a requeued job starts within seconds once eligible
        f"FirstJobId={first_job}", "JobRequeue=1",
        # preemption as sites set it up: a job of partition `high` takes the nodes of jobs in `main`, which are
        # sent SIGTERM (their steps, not the batch shell), given GRACE_TIME_S, then requeued
        "PreemptType=preempt/partition_prio", "PreemptMode=REQUEUE",
    ]
    lines += [f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={ports[name]} CPUs={cpus} "
              "State=UNKNOWN" for name in nodes]
    lines.append(f"PartitionName=main Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO "
                 f"PriorityTier=1 GraceTime={GRACE_TIME_S}")
    lines.append(f"PartitionName=high Nodes={','.join(nodes)} MaxTime=INFINITE State=UP OverSubscribe=NO "
                 "PriorityTier=2 PreemptMode=OFF")
    return "\n".join(lines) + "\n"


def _environ_of(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (entry.split(b"=", 1) for entry in raw.split(b"\0") if b"=" in entry)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def _pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


class LoopbackSlurm:
    """A SLURM cluster of ``nodes`` emulated nodes on this machine.

    Args:
        nodes: How many nodes (named ``n1``, ``n2`` ...).
        cpus: CPUs each node declares (steps that share a node need ``srun --overlap``).
        directory: Where its files go (default: a new temp dir, removed by :meth:`stop`).

    Raises:
        SlurmStartError: (at :meth:`start`) a package is missing, this is not
            root, or a daemon did not come up.
    """

    def __init__(self, nodes: int = 3, cpus: int = 1, directory: str | os.PathLike[str] | None = None) -> None:
        self.names = [f"n{i + 1}" for i in range(nodes)]
        self.cpus = cpus
        self._own_dir = directory is None
        self.directory = Path(directory) if directory is not None else None
        self._daemons: dict[str, subprocess.Popen[bytes]] = {}
        self._munged_pid: int | None = None
        self.killed_at: dict[str, float] = {}  # node -> time.time() right after its processes were SIGKILLed

    # -- start and stop ------------------------------------------------------------------------------
    @property
    def conf(self) -> str:
        assert self.directory is not None
        return str(self.directory / "slurm.conf")

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """An environment whose SLURM commands talk to this cluster (``SLURM_CONF``)."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = self.conf
        return env

    def start(self) -> LoopbackSlurm:
        """Start munged, slurmctld and every slurmd; wait until every node is idle.

        Raises:
            SlurmStartError: See the class.
        """
        missing = [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
        if missing:
            raise SlurmStartError(f"not installed: {', '.join(missing)} (Debian: apt-get install -y slurmd slurmctld "
                                  "munge; bash .ci/system-packages does it)")
        if os.geteuid() != 0:
            raise SlurmStartError("a loopback SLURM cluster runs slurmd as root: run as root")
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        if self.directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix="unicron-slurm-"))
        d = self.directory
        d.chmod(0o755)  # munged (its own user) must reach its socket below
        for sub in ("state", "log", *(f"spool/{n}" for n in self.names)):
            (d / sub).mkdir(parents=True, exist_ok=True)
        self._start_munge(d)
        ports = {"ctld": free_port(), "slurmd": free_port(), **{n: free_port() for n in self.names}}
        (d / "slurm.conf").write_text(_conf(d, self.names, ports, self.cpus, random.randrange(1000, 900000)))
        self._daemons["slurmctld"] = self._daemon(["slurmctld", "-D", "-i"], "slurmctld")
        for name in self.names:
            self.start_node(name, resume=False)
        self.wait_for(lambda: all(self.node_flags(n) == {"IDLE"} for n in self.names), 60,
                      "every node idle")
        log.info("loopback_slurm_started", directory=str(d), nodes=self.names, slurmctld_port=ports["ctld"])

    def _start_munge(self, d: Path) -> None:
        munge = pwd.getpwnam("munge")
        key_dir, run_dir = d / "munge", d / "munge-run"
        for path, mode in ((key_dir, 0o700), (run_dir, 0o755)):
            path.mkdir(exist_ok=True)
            os.chown(path, munge.pw_uid, munge.pw_gid)
            path.chmod(mode)
        as_munge = ["runuser", "-u", "munge", "--"]
        subprocess.run([*as_munge, "mungekey", "-c", "-k", str(key_dir / "munge.key")], check=True,
                       capture_output=True, timeout=30)
        done = subprocess.run([*as_munge, "munged", f"--socket={run_dir}/munge.socket",
                               f"--key-file={key_dir}/munge.key", f"--log-file={key_dir}/munged.log",
                               f"--pid-file={run_dir}/munged.pid", f"--seed-file={key_dir}/munged.seed"],
                              capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise SlurmStartError(f"munged did not start: {done.stderr.strip()[:300]}")
        self._munged_pid = int((run_dir / "munged.pid").read_text().strip())

    def _daemon(self, argv: list[str], name: str, mark: str | None = None) -> subprocess.Popen[bytes]:
        assert self.directory is not None
        env = self.env()
        if mark is not None:
            env[NODE_MARK_ENV] = f"{self.conf}:{mark}"
        out = open(self.directory / "log" / f"{name}.out", "ab")  # noqa: SIM115 - the daemon's for its life
        try:
            return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            out.close()

    def start_node(self, name: str, resume: bool = True) -> None:
        """Start node ``name``'s slurmd (again); ``resume``: then return the node to service."""
        self._daemons[name] = self._daemon(["slurmd", "-D", "-N", name], f"slurmd-{name}", mark=name)
        if resume:  # (refused until the new slurmd registered)
            self.wait_for(lambda: self.run("scontrol", "update", f"nodename={name}", "state=resume",
                                           check=False).returncode == 0, 60, f"node {name} back in service")
            self.wait_for(lambda: not self.node_flags(name) & {"DOWN", "NOT_RESPONDING", "DRAIN"}, 60,
                          f"node {name} up")

    def heal(self) -> None:
        """Cancel every job and bring every node back (its slurmd started again, returned to service)."""
        self.run("scancel", "--user=root", check=False)
        self.wait_for(lambda: not self.run("squeue", "-h", "-o", "%i").stdout.strip(), 60, "no job left")
        for name in self.names:
            proc = self._daemons.get(name)
            if proc is None or proc.poll() is not None:
                self.kill_node(name, mark_down=False)  # (what its steps left running)
                self.start_node(name)
            elif self.node_flags(name) & {"DOWN", "DRAIN", "NOT_RESPONDING"}:
                self.resume(name)
        self.wait_for(lambda: all(self.node_flags(n) == {"IDLE"} for n in self.names), 60, "every node idle")

    def stop(self) -> None:
        """Cancel every job, stop every daemon (and what their steps left running), remove the files."""
        if self.directory is None:
            return
        if "slurmctld" in self._daemons and self._daemons["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--full", "--user=root"], env=self.env(), capture_output=True, timeout=30)
        for name in self.names:
            self.kill_node(name, mark_down=False)
        for proc in self._daemons.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self._daemons.clear()
        if self._munged_pid is not None:
            try:
                os.kill(self._munged_pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            self._munged_pid = None
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    def __enter__(self) -> LoopbackSlurm:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- commands ------------------------------------------------------------------------------------
    def run(self, *argv: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a SLURM command against this cluster; its output as text.

        Raises:
            subprocess.CalledProcessError: ``check`` and a non-zero exit code.
        """
        return subprocess.run(list(argv), env=self.env(), capture_output=True, text=True, timeout=timeout,
                              check=check)

    def scontrol(self, *args: str) -> str:
        return self.run("scontrol", *args).stdout

    def sbatch(self, *args: str, env: dict[str, str] | None = None) -> str:
        """Submit a batch job (``sbatch --parsable ARGS``); its job id."""
        done = subprocess.run(["sbatch", "--parsable", *args], env=self.env(env), capture_output=True, text=True,
                              timeout=60, check=True)
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o``'s fields of a job (``JobState``, ``Restarts``, ``ExitCode`` ...)."""
        return parse_node_line(self.scontrol("show", "job", "-o", job_id))

    def node_flags(self, name: str) -> frozenset[str]:
        return state_flags(parse_node_line(self.scontrol("show", "node", "-o", name)).get("State", ""))

    @staticmethod
    def wait_for(condition, seconds: float, what: str) -> None:  # type: ignore[no-untyped-def]
        """Poll ``condition`` every 0.1 s until it holds.

        Raises:
            SlurmStartError: It did not hold within ``seconds``.
        """
        deadline = time.monotonic() + seconds
        while True:
            try:
                if condition():
                    return
            except subprocess.SubprocessError:
                pass
            if time.monotonic() > deadline:
                raise SlurmStartError(f"no {what} within {seconds:g}s")
            time.sleep(0.1)

    # -- faults --------------------------------------------------------------------------------------
    def node_processes(self, name: str) -> list[int]:
        """Node ``name``'s slurmd, its step daemons and every process of its job steps (and below them)."""
        mark = f"{self.conf}:{name}"
        daemons = [pid for pid in _pids() if _environ_of(pid).get(NODE_MARK_ENV) == mark]
        tasks = [pid for pid in _pids()
                 if (env := _environ_of(pid)).get("SLURMD_NODENAME") == name and env.get("SLURM_CONF") == self.conf]
        found: list[int] = []
        for pid in [*daemons, *tasks]:
            for member in process_tree(pid):
                if member not in found and member != os.getpid():
                    found.append(member)
        return found

    def kill_node(self, name: str, mark_down: bool = True) -> list[int]:
        """Lose node ``name``: SIGKILL its slurmd and every process of its steps; then mark it down.

        Returns:
            The PIDs that were killed.
        """
        pids = self.node_processes(name)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.killed_at[name] = time.time()
        if mark_down:
            self.scontrol("update", f"nodename={name}", "state=down", "reason=lost")
        log.warning("loopback_node_killed", node=name, pids=len(pids))
        return pids

    def etcd_leader(self, endpoint: str) -> str:
        """The name of the member that leads the etcd cluster at ``endpoint`` (members named after nodes)."""
        members = self._etcd_members(endpoint)
        client = self._etcd_client(endpoint)
        try:
            leader = client.status().leader.id
        finally:
            client.close()
        return next(name for name, member_id in members.items() if member_id == leader)

    def move_etcd_leader(self, endpoint: str, to: str) -> None:
        """Make member ``to`` the etcd cluster's leader (etcd's MoveLeader, sent to the leader)."""
        from etcd3.etcdrpc import rpc_pb2

        members = self._etcd_members(endpoint)
        leader = self.etcd_leader(endpoint)
        client = self._etcd_client(self._etcd_urls(endpoint)[leader])
        try:
            client.maintenancestub.MoveLeader(rpc_pb2.MoveLeaderRequest(targetID=members[to]), timeout=10)
        finally:
            client.close()
        self.wait_for(lambda: self.etcd_leader(endpoint) == to, 30, f"etcd leader {to}")

    @staticmethod
    def _etcd_client(endpoint: str):  # type: ignore[no-untyped-def]
        import etcd3

        host, port = endpoint.split(",")[0].rsplit(":", 1)
        return etcd3.client(host=host, port=int(port), timeout=5)

    def _etcd_members(self, endpoint: str) -> dict[str, int]:
        client = self._etcd_client(endpoint)
        try:
            return {m.name: m.id for m in client.members}
        finally:
            client.close()

    def _etcd_urls(self, endpoint: str) -> dict[str, str]:
        client = self._etcd_client(endpoint)
        try:
            return {m.name: m.client_urls[0].split("://", 1)[1] for m in client.members}
        finally:
            client.close()

    def drain(self, name: str) -> None:
        self.scontrol("update", f"nodename={name}", "state=drain", "reason=maintenance")

    def resume(self, name: str) -> None:
        self.scontrol("update", f"nodename={name}", "state=resume")
