"""What the SLURM integration shares: its errors, the job as SLURM describes it, the etcd members' layout.

Leaf module: no I/O. :mod:`unicron_elastic.slurm.job` reads the job from the
environment and asks ``scontrol``; :mod:`unicron_elastic.slurm.etcd` runs the
members; :mod:`unicron_elastic.slurm.drain_watch` follows the node's state.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from unicron_elastic.api import ConfigError, UnicronError
from unicron_elastic.env import ETCD_LAYOUT

#: Exit code of ``unicron-run --slurm`` (and of the recipe's batch script) when training finished: do not requeue.
FINISHED_EXIT_CODE = 0
#: Highest number of etcd members started inside an allocation (a cluster of 2N+1 survives losing N).
MAX_MEMBERS = 5
#: Ports of one job's etcd members: client ports ``base .. base+4``, peer ports ``base+5 .. base+9``.
PORTS_PER_JOB = 2 * MAX_MEMBERS
#: The default port range of the members: ``PORT_RANGE[0] + (job id % jobs) * PORTS_PER_JOB`` (below Linux's
#: ephemeral ports, 32768 and up, which the OS hands out to outgoing connections).
PORT_RANGE = (20000, 32760)


class NotUnderSlurm(ConfigError):
    """A SLURM mode was asked for outside a SLURM job step (``SLURM_JOB_ID``/``SLURMD_NODENAME`` missing)."""


class ForeignCheckpoint(ConfigError):
    """A preemption checkpoint written by another SLURM job or array task than the one resuming it."""


def job_of_environment(environ: Mapping[str, str]) -> str | None:
    """The SLURM job a process belongs to, as ``scontrol requeue`` names it; None outside SLURM.

    ``<SLURM_ARRAY_JOB_ID>_<SLURM_ARRAY_TASK_ID>`` for an array task (each task
    is a job of its own: ``%A_%a``), else ``SLURM_JOB_ID``. A requeued job
    keeps it.
    """
    array_job, array_task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and array_task:
        return f"{array_job}_{array_task}"
    return environ.get("SLURM_JOB_ID") or None


class SlurmCommandError(UnicronError):
    """A SLURM command (``scontrol``) failed, timed out or is not installed."""


@dataclass(frozen=True)
class SlurmJob:
    """The job step this process runs in, as SLURM's environment says.

    Attributes:
        job_id: ``SLURM_JOB_ID``.
        node: ``SLURMD_NODENAME``: this node's name in SLURM's node list.
        nodes: The job's nodes in SLURM's order (``SLURM_JOB_NODELIST`` expanded).
        restart_count: ``SLURM_RESTART_COUNT``: how often the job was requeued (0 on its first run).
        array_job_id: ``SLURM_ARRAY_JOB_ID`` of an array task (None otherwise).
        array_task_id: ``SLURM_ARRAY_TASK_ID`` of an array task (None otherwise).
    """

    job_id: str
    node: str
    nodes: tuple[str, ...]
    restart_count: int = 0
    array_job_id: str | None = None
    array_task_id: str | None = None

    @property
    def requeue_id(self) -> str:
        """What ``scontrol requeue`` takes: ``ARRAYJOB_TASK`` for an array task, else the job id."""
        if self.array_job_id is not None and self.array_task_id is not None:
            return f"{self.array_job_id}_{self.array_task_id}"
        return self.job_id

    @property
    def run_id(self) -> str:
        """The rendezvous run id: ``<job>-<restart count>``.

        A requeued job keeps its job id; its new run must not meet the old
        run's stale rounds (whose nodes were stopped, not finished), so the
        restart count is part of the id.
        """
        return f"{self.requeue_id}-{self.restart_count}"

    @property
    def node_index(self) -> int:
        """This node's position in the job's node list.

        Raises:
            ConfigError: ``SLURMD_NODENAME`` is not in the job's node list.
        """
        try:
            return self.nodes.index(self.node)
        except ValueError:
            raise ConfigError(f"SLURMD_NODENAME={self.node!r} is not in the job's node list "
                              f"{','.join(self.nodes)}") from None


@dataclass(frozen=True)
class EtcdMember:
    """One etcd member inside the allocation.

    Attributes:
        name: The member's name: its SLURM node's name.
        host: The address it listens on and advertises (the node's ``NodeAddr``, resolved).
        client_port: Its client port.
        peer_port: Its peer port.
    """

    name: str
    host: str
    client_port: int
    peer_port: int

    @property
    def endpoint(self) -> str:
        """``host:client_port`` (an entry of ``--rdzv-endpoint``)."""
        return f"[{self.host}]:{self.client_port}" if ":" in self.host else f"{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.peer_port}"

    @property
    def client_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.client_port}"


def default_port_base(job_id: str) -> int:
    """The first port of a job's etcd members, derived from its job id (jobs sharing a host differ).

    Raises:
        ConfigError: The job id is not a number.
    """
    digits = job_id.split("_", 1)[0]
    if not digits.isdigit():
        raise ConfigError(f"SLURM job id {job_id!r} is not a number: give --port-base")
    slots = (PORT_RANGE[1] - PORT_RANGE[0]) // PORTS_PER_JOB
    return PORT_RANGE[0] + (int(digits) % slots) * PORTS_PER_JOB


def etcd_layout(nodes: tuple[str, ...], addresses: dict[str, str], members: int, port_base: int) -> list[EtcdMember]:
    """The etcd members of a job: its first ``members`` nodes, each with ports of its own.

    Every member has distinct ports (``port_base + i`` for clients,
    ``port_base + MAX_MEMBERS + i`` for peers), so members whose nodes share
    a host (a loopback test cluster, or nodes that are containers of one
    machine) do not collide; on separate hosts it costs nothing.

    Args:
        nodes: The job's nodes, in SLURM's order.
        addresses: Each node's address.
        members: How many members (odd, 1..``MAX_MEMBERS``).
        port_base: The first port.

    Returns:
        The members, in node order.

    Raises:
        ConfigError: ``members`` is even, out of range or more than the job's
            nodes, a port is out of range, or a member's node has no address.
    """
    if not 1 <= members <= MAX_MEMBERS or members % 2 == 0:
        raise ConfigError(f"--members {members}: an odd number from 1 to {MAX_MEMBERS} (3 survives losing 1)")
    if members > len(nodes):
        raise ConfigError(f"--members {members}: the job has only {len(nodes)} node(s)")
    if not 1024 <= port_base <= 65535 - PORTS_PER_JOB:
        raise ConfigError(f"--port-base {port_base}: from 1024 to {65535 - PORTS_PER_JOB}")
    layout = []
    for i, name in enumerate(nodes[:members]):
        if not addresses.get(name):
            raise ConfigError(f"node {name!r} of the job has no address in SLURM")
        layout.append(EtcdMember(name, addresses[name], port_base + i, port_base + MAX_MEMBERS + i))
    check_reachable(layout)
    return layout


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:  # a name, not an address: not decided here
        return False


def check_reachable(layout: list[EtcdMember]) -> None:
    """Refuse a member on a loopback address beside members that are not: the others could not reach it.

    A node whose own name resolves to ``127.0.1.1`` (Debian's ``/etc/hosts``)
    would advertise an address only it can reach. Every member on loopback
    is one host (a test cluster): allowed.

    Raises:
        ConfigError: Naming the node and its address.
    """
    looped = [member for member in layout if _is_loopback(member.host)]
    if looped and len(looped) < len(layout):
        other = next(member for member in layout if not _is_loopback(member.host))
        raise ConfigError(
            f"node {looped[0].name!r} resolves to the loopback address {looped[0].host} while node {other.name!r} "
            f"is at {other.host}: the other members could not reach it; give the node a NodeAddr in slurm.conf or "
            "fix how its name resolves")


def layout_to_json(layout: list[EtcdMember]) -> str:
    """The layout as one line (:data:`~unicron_elastic.env.ETCD_LAYOUT`: decided once, handed to every member)."""
    return json.dumps([asdict(member) for member in layout], separators=(",", ":"))


def layout_from_json(text: str) -> list[EtcdMember]:
    """The layout :func:`layout_to_json` wrote.

    Raises:
        ConfigError: Malformed, empty, or a loopback member beside others (:func:`check_reachable`).
    """
    try:
        layout = [EtcdMember(str(m["name"]), str(m["host"]), int(m["client_port"]), int(m["peer_port"]))
                  for m in json.loads(text)]
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"{ETCD_LAYOUT.name} is not a layout `unicron slurm layout` printed: {exc}") from None
    if not layout:
        raise ConfigError(f"{ETCD_LAYOUT.name} names no member")
    check_reachable(layout)
    return layout


def endpoint_list(layout: list[EtcdMember]) -> str:
    """The members as one ``--rdzv-endpoint`` list (``host:port,host:port,...``)."""
    return ",".join(member.endpoint for member in layout)


def threads_per_worker(cpus_per_task: str | None, cores: int, workers: int) -> int:
    """``OMP_NUM_THREADS`` for each of a node's workers: the launcher's CPUs shared out evenly, at least 1.

    Args:
        cpus_per_task: ``SLURM_CPUS_PER_TASK`` (the CPUs SLURM gave the
            launcher, one task per node), or None when not set.
        cores: The cores this process may run on (its CPU affinity): used
            without ``cpus_per_task``.
        workers: The node's workers (``--nproc-per-node``).

    Raises:
        ConfigError: ``cpus_per_task`` is not a positive number.
    """
    if cpus_per_task is not None:
        if not cpus_per_task.isdigit() or int(cpus_per_task) < 1:
            raise ConfigError(f"SLURM_CPUS_PER_TASK={cpus_per_task!r} is not a positive number")
        cores = int(cpus_per_task)
    return max(1, cores // max(1, workers))


def parse_node_line(line: str) -> dict[str, str]:
    """The ``Key=Value`` fields of one ``scontrol show node -o`` line (values without spaces)."""
    fields: dict[str, str] = {}
    for token in line.split():
        key, sep, value = token.partition("=")
        if sep and key and key not in fields:
            fields[key] = value
    return fields


def state_flags(state: str) -> frozenset[str]:
    """A node's ``State=`` value (``ALLOCATED+DRAIN``, ``MIXED+DRAIN+COMPLETING`` ...) as its set of words."""
    return frozenset(word for word in state.upper().replace("*", "").split("+") if word)


def is_draining(flags: frozenset[str]) -> bool:
    """Whether SLURM drains the node (``scontrol update ... state=drain``): its work should leave.

    ``DRAIN`` is the flag scontrol shows (``ALLOCATED+DRAIN``); ``DRAINING``
    and ``DRAINED`` are the names sinfo uses.
    """
    return bool(flags & {"DRAIN", "DRAINING", "DRAINED"})
