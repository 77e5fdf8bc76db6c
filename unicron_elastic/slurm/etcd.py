"""etcd inside a SLURM allocation: one member on each of the job's first N nodes (``unicron slurm etcd``).

Run as a step of its own over the allocation (``srun --ntasks-per-node=1
--overlap --no-kill --kill-on-bad-exit=0 unicron slurm etcd &``): the task on
each of the job's first ``--members`` nodes runs one member, the others end at
once. Every member's name is its node's name, its address the node's
``NodeAddr``, its ports ``--port-base + i`` (clients) and ``--port-base + 5 + i``
(peers), so nodes that share a host (the loopback test cluster) do not
collide; the default base is derived from the job id. The layout is decided
once, by one process (``unicron slurm layout`` in the batch script, from
SLURM's ``NodeAddr`` of each node resolved there), and handed to every member
and to ``unicron slurm endpoint`` in ``$UNICRON_ETCD_LAYOUT`` (:data:`~unicron_elastic.env.ETCD_LAYOUT`): nodes whose
resolvers disagree (a name that resolves to ``127.0.1.1`` on its own node) still
give every member the same ``--initial-cluster``. Losing one of three members'
nodes leaves a quorum: the store fails over (docs/rendezvous.md, "On an etcd cluster").

Each member is an :class:`~unicron_elastic.store.embedded.EmbeddedEtcd` on
the node's address instead of loopback: the same fast raft settings, no
fsync (the store lives as long as the job), a temp data dir removed at exit,
and a guard that kills the member if its owner dies.
"""

from __future__ import annotations

import signal
import threading
import time

import structlog

from unicron_elastic.api import ConfigError, EtcdConfig
from unicron_elastic.env import ETCD_LAYOUT
from unicron_elastic.slurm.api import (
    EtcdMember,
    SlurmJob,
    default_port_base,
    endpoint_list,
    etcd_layout,
    layout_from_json,
)
from unicron_elastic.store.client import StatusStore
from unicron_elastic.store.embedded import EmbeddedEtcd

log = structlog.get_logger(__name__)

#: Seconds a member outlives the SIGTERM SLURM sends every step at the end of a job (walltime, requeue,
#: scancel): the launchers need the store while their workers finish the step and stop.
STOP_GRACE_S = 60.0


class MemberEtcd(EmbeddedEtcd):
    """An :class:`EmbeddedEtcd` on a SLURM node's address and the layout's ports.

    Args:
        member: This member (name, address, ports).
        layout: Every member of the cluster.
        token: The cluster token (the job id: members of two jobs never join each other).
        cluster: unicron cluster name for :attr:`config`.
        startup_timeout: Seconds to wait for the cluster's quorum.
    """

    def __init__(self, member: EtcdMember, layout: list[EtcdMember], token: str, cluster: str = "default",
                 startup_timeout: float = 120.0) -> None:
        super().__init__(cluster=cluster, startup_timeout=startup_timeout, name=member.name)
        self.member, self.layout, self.token = member, layout, token
        self.client_port, self.peer_port = member.client_port, member.peer_port
        self.initial_cluster = ",".join(f"{m.name}={m.peer_url}" for m in layout)

    @property
    def config(self) -> EtcdConfig:
        return EtcdConfig(host=self.member.host, port=self.member.client_port, cluster=self.cluster)

    @property
    def endpoint(self) -> str:
        return self.member.endpoint

    @property
    def peer(self) -> str:
        return f"{self.member.name}={self.member.peer_url}"

    def _command(self) -> list[str]:
        command = super()._command()
        urls = {"--listen-client-urls": self.member.client_url, "--advertise-client-urls": self.member.client_url,
                "--listen-peer-urls": self.member.peer_url, "--initial-advertise-peer-urls": self.member.peer_url}
        for flag, url in urls.items():
            command[command.index(flag) + 1] = url
        return [*command, "--initial-cluster-token", f"unicron-slurm-{self.token}"]

    def _start(self) -> EmbeddedEtcd:
        return self._start_once()  # the ports are the layout's: fresh ones would split the cluster


def layout_of(job: SlurmJob, members: int, port_base: int | None) -> list[EtcdMember]:
    """The job's etcd members (its first ``members`` nodes).

    Raises:
        ConfigError: A bad ``members`` or ``port_base``, or a job id that gives no default base.
        SlurmCommandError: scontrol could not say the nodes' addresses.
    """
    from unicron_elastic.slurm.job import node_addresses

    base = default_port_base(job.job_id) if port_base is None else port_base
    etcd_layout(job.nodes, dict.fromkeys(job.nodes, "-"), members, base)  # a bad count or base fails before scontrol
    return etcd_layout(job.nodes, node_addresses(job.nodes[:members]), members, base)


def given_layout(text: str | None) -> list[EtcdMember]:
    """The layout decided once for the job (:data:`~unicron_elastic.env.ETCD_LAYOUT`, or ``--layout``).

    Raises:
        ConfigError: None given (each member would decide its own), or malformed.
    """
    if not text:
        raise ConfigError(f"no etcd layout: decide it once in the batch script, before the step: "
                          f"export {ETCD_LAYOUT.name}=$(unicron slurm layout)")
    return layout_from_json(text)


def wait_for_cluster(layout: list[EtcdMember], timeout: float) -> bool:
    """Whether a majority of the members answers within ``timeout`` seconds (the cluster has its quorum)."""
    deadline = time.monotonic() + timeout
    while True:
        answering = 0
        for member in layout:
            with StatusStore(EtcdConfig(host=member.host, port=member.client_port, request_timeout=2.0)) as store:
                answering += store.healthy()
        if answering > len(layout) // 2:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)


def serve(job: SlurmJob, layout: list[EtcdMember], grace: float = STOP_GRACE_S) -> int:
    """Run this node's member until stopped (the body of ``unicron slurm etcd``).

    SIGINT, SIGHUP or SIGUSR2 stop it at once (``srun`` forwards SIGUSR2 to
    its tasks: the batch script ends the step with ``kill -USR2``; a SIGTERM
    to ``srun`` would kill them); SIGTERM (what SLURM sends every process of
    every step when the job is preempted, cancelled or ends) after ``grace``
    seconds, or at once when a second one comes; SIGUSR1 (SLURM's warning
    before the end of the allocation) is for the launchers, and ignored.
    SLURM's SIGTERM reaches the etcd process too, and etcd exits on it: the
    member is then started again from its data dir (every member does the
    same, and the store is back with its keys within seconds), so that the
    launchers' stop and checkpoint find a store.

    Returns:
        0 after a stop (or on a node that holds no member), 1 if the member exited by itself.

    Args:
        job: This job step.
        layout: The members, decided once for the job (:func:`given_layout`).
        grace: Seconds a member outlives SLURM's SIGTERM.

    Raises:
        EtcdStartError: The member did not start (or start again) or the cluster found no quorum in time.
    """
    mine = next((m for m in layout if m.name == job.node), None)
    if mine is None:
        log.info("slurm_etcd_no_member_here", node=job.node, members=[m.name for m in layout])
        return 0
    stop = _StopSignals.install()
    etcd = MemberEtcd(mine, layout, token=job.requeue_id + f"-{job.restart_count}")
    with etcd:
        log.info("slurm_etcd_member_ready", node=job.node, endpoint=etcd.endpoint, cluster=endpoint_list(layout))
        print(f"etcd member {mine.name} ready: --rdzv-endpoint={endpoint_list(layout)}", flush=True)
        code = _run_member(etcd, stop, grace)
        log.info("slurm_etcd_member_stopping", node=job.node, code=code)
    return code


#: Seconds a member's SIGTERM may come after its etcd process exited, for the exit to count as SLURM's
#: SIGTERM to the step (both get it at once) rather than a failure of the member.
SAME_SIGNAL_S = 2.0


class _StopSignals:
    """The member's stop signals: ``now`` (SIGINT, SIGHUP, SIGUSR2, a second SIGTERM), ``soon`` (a SIGTERM)."""

    def __init__(self) -> None:
        self.now, self.soon = threading.Event(), threading.Event()

    @classmethod
    def install(cls) -> _StopSignals:
        stop = cls()
        for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGUSR2):
            signal.signal(sig, lambda *_: stop.now.set())
        signal.signal(signal.SIGTERM, lambda *_: (stop.now if stop.soon.is_set() else stop.soon).set())
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        return stop


def _run_member(etcd: MemberEtcd, stop: _StopSignals, grace: float) -> int:
    """Keep the member up until a stop: ``grace`` seconds after a SIGTERM, at once on the others.

    Returns:
        0 after a stop, 1 if the etcd process exited with no SIGTERM to the step.

    Raises:
        EtcdStartError: The member did not start again.
    """
    soon_since: float | None = None
    while not stop.now.wait(0.5):
        if etcd.proc is not None and etcd.proc.poll() is not None:
            if not stop.soon.wait(SAME_SIGNAL_S):
                log.error("slurm_etcd_member_exited", node=etcd.member.name, code=etcd.proc.returncode)
                return 1
            _start_again(etcd)
        if stop.soon.is_set():
            soon_since = soon_since or time.monotonic()
            if time.monotonic() - soon_since >= grace:
                break
    return 0


def _start_again(etcd: MemberEtcd) -> None:
    """Start the member's etcd process again on its data dir (it keeps its place in the cluster and its keys).

    Raises:
        EtcdStartError: It did not answer within its start-up timeout (no quorum came back).
    """
    code = etcd.proc.returncode if etcd.proc is not None else None
    etcd.kill()  # (its log file and guard; the data dir stays)
    started = time.monotonic()
    etcd.start()  # (on the data dir it keeps)
    log.warning("slurm_etcd_member_restarted", node=etcd.member.name, exit_code=code,
                seconds=round(time.monotonic() - started, 2),
                why="SLURM's SIGTERM to the step reached the etcd process: kept up for the launchers' stop")
