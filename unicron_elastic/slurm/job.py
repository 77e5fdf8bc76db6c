"""The SLURM job this process runs in: its environment, and what ``scontrol`` says about its nodes.

Every question to SLURM goes through :func:`scontrol` (one place that runs
the command, bounds its time and turns its failures into
:class:`~unicron_elastic.slurm.api.SlurmCommandError`); the parsing is pure
(:mod:`unicron_elastic.slurm.api`).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Mapping, Sequence

import structlog

from unicron_elastic.slurm.api import (
    NotUnderSlurm,
    SlurmCommandError,
    SlurmJob,
    parse_node_line,
    state_flags,
)

log = structlog.get_logger(__name__)

#: Seconds one ``scontrol`` call may take (slurmctld answers in milliseconds; a busy one in seconds).
SCONTROL_TIMEOUT_S = 30.0


def scontrol(*args: str, timeout: float = SCONTROL_TIMEOUT_S) -> str:
    """Run ``scontrol ARGS`` and return its standard output.

    Raises:
        SlurmCommandError: scontrol is not installed, failed or timed out.
    """
    binary = shutil.which("scontrol")
    if binary is None:
        raise SlurmCommandError("scontrol not found on PATH: is this a SLURM node?")
    try:
        done = subprocess.run([binary, *args], capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise SlurmCommandError(f"scontrol {' '.join(args)} took longer than {timeout:g}s") from None
    if done.returncode != 0:
        raise SlurmCommandError(f"scontrol {' '.join(args)} failed ({done.returncode}): "
                                f"{' '.join(done.stderr.split())[:300]}")
    return done.stdout


def expand_hostlist(hostlist: str) -> tuple[str, ...]:
    """SLURM's compressed node list (``n[1-3],gpu07``) expanded by SLURM itself (``scontrol show hostnames``).

    Raises:
        SlurmCommandError: scontrol failed.
    """
    return tuple(line.strip() for line in scontrol("show", "hostnames", hostlist).splitlines() if line.strip())


def current_job(environ: Mapping[str, str] | None = None) -> SlurmJob:
    """The job step this process runs in.

    Raises:
        NotUnderSlurm: ``SLURM_JOB_ID``, ``SLURMD_NODENAME`` or the job's
            node list is missing (not a task of an ``srun`` step).
        ConfigError: ``SLURM_RESTART_COUNT`` is not a number.
        SlurmCommandError: The node list could not be expanded.
    """
    env = os.environ if environ is None else environ
    missing = [name for name in ("SLURM_JOB_ID", "SLURMD_NODENAME") if not env.get(name)]
    hostlist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if missing or not hostlist:
        raise NotUnderSlurm(f"not a task of a SLURM job step ({', '.join(missing) or 'SLURM_JOB_NODELIST'} "
                            "unset): run it in a SLURM job (under srun or sbatch)")
    restarts = env.get("SLURM_RESTART_COUNT", "0") or "0"
    if not restarts.isdigit():
        raise NotUnderSlurm(f"SLURM_RESTART_COUNT={restarts!r} is not a number")
    return SlurmJob(job_id=env["SLURM_JOB_ID"], node=env["SLURMD_NODENAME"], nodes=expand_hostlist(hostlist),
                    restart_count=int(restarts), array_job_id=env.get("SLURM_ARRAY_JOB_ID") or None,
                    array_task_id=env.get("SLURM_ARRAY_TASK_ID") or None)


def node_records(names: Sequence[str]) -> dict[str, dict[str, str]]:
    """``scontrol show node -o`` of ``names``: each node's fields (``State``, ``NodeAddr`` ...).

    Raises:
        SlurmCommandError: scontrol failed (an unknown node included).
    """
    records = {}
    for line in scontrol("show", "node", "-o", ",".join(names)).splitlines():
        fields = parse_node_line(line)
        if "NodeName" in fields:
            records[fields["NodeName"]] = fields
    return records


def node_flags(name: str) -> frozenset[str]:
    """The words of node ``name``'s state (``{"ALLOCATED", "DRAIN"}`` ...).

    Raises:
        SlurmCommandError: scontrol failed, or said nothing about the node.
    """
    record = node_records([name]).get(name)
    if record is None or "State" not in record:
        raise SlurmCommandError(f"scontrol show node {name} said nothing about its state")
    return state_flags(record["State"])


def node_addresses(names: Sequence[str]) -> dict[str, str]:
    """Each node's address: its ``NodeAddr`` (else its name) resolved to an IP address.

    Raises:
        SlurmCommandError: scontrol failed, or an address does not resolve.
    """
    records = node_records(names)
    addresses = {}
    for name in names:
        host = records.get(name, {}).get("NodeAddr") or name
        try:
            addresses[name] = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
        except OSError as exc:
            raise SlurmCommandError(f"address {host!r} of node {name!r} does not resolve: {exc}") from None
    return addresses


def requeue_decision(record: Mapping[str, str], only_if_preempted: bool = False) -> tuple[bool, str]:
    """Whether a stopped job is requeued, from SLURM's record of it (``scontrol show job``), and why.

    Only a job SLURM still runs is: one preempted (``PreemptMode=REQUEUE``:
    SLURM sent its steps SIGTERM and keeps it ``RUNNING`` with a
    ``PreemptTime`` for its ``GraceTime``; a job that ends by itself within
    it is a finished job to SLURM, never requeued), or one stopped by the
    warning signal. A cancelled job is not, nor one SLURM is already ending:
    after ``scancel`` or at the time limit the job is ``COMPLETING`` until its
    processes are gone (scontrol then shows that flag, not ``CANCELLED``).

    Args:
        record: The job's fields.
        only_if_preempted: Requeue only a preempted job (the batch shell saw
            no signal: a launcher that exited on SIGTERM is a preemption only
            if SLURM says so).
    """
    state = record.get("JobState", "UNKNOWN")
    preempted = record.get("PreemptTime", "None") not in ("None", "Unknown", "")
    if state.startswith("CANCELLED"):
        return False, "the job was cancelled"
    if state != "RUNNING":
        return False, f"SLURM is ending the job ({state}: cancelled, or at its time limit)"
    if only_if_preempted and not preempted:
        return False, "the job was not preempted"
    return True, "preempted" if preempted else "stopped (the warning signal or a SIGTERM)"


def requeue_unless_cancelled(job: SlurmJob, only_if_preempted: bool = False) -> bool:
    """Requeue the job if SLURM still runs it (:func:`requeue_decision`).

    Args:
        job: This job.
        only_if_preempted: See :func:`requeue_decision`.

    Returns:
        Whether the job was requeued.

    Raises:
        SlurmCommandError: scontrol failed or refused the requeue.
    """
    record = parse_node_line(scontrol("show", "job", "-o", job.requeue_id))
    state = record.get("JobState", "UNKNOWN")
    requeued, reason = requeue_decision(record, only_if_preempted)
    if not requeued:
        log.warning("slurm_requeue_skipped", job=job.requeue_id, state=state, reason=reason)
        return False
    log.warning("slurm_requeue", job=job.requeue_id, state=state, reason=reason)
    requeue(job)
    return True


def requeue(job: SlurmJob) -> None:
    """``scontrol requeue`` the job (an array task by its ``ARRAYJOB_TASK`` id).

    SLURM stops every step of the job, then starts the batch script again
    with ``SLURM_RESTART_COUNT`` one higher (after the site's requeue delay).

    Raises:
        SlurmCommandError: scontrol refused (a job submitted with ``--no-requeue``, say).
    """
    scontrol("requeue", job.requeue_id)
    log.warning("slurm_job_requeued", job=job.requeue_id, restart_count=job.restart_count)
