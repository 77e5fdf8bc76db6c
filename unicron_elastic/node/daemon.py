"""``unicron node``: the per-machine daemon of a coordinated cluster (the paper's agent).

It holds the node's lease and keeps the node's record (``nodes/<name>``,
with its slots) on it, so the coordinator sees the node join and, when the
machine is lost, sees the record vanish within one TTL (SEV1). It follows the
commands the coordinator writes for it (``commands/<name>/<generation>``,
the newest wins): run task T means start ``unicron-run`` - the existing
agent, detectors and ladder - for T with ``--nproc-per-node`` = the node's
slots, joining T's rendezvous (run id = task name) with ``--nnodes
1:ceil(max_workers / slots)``; a command for another task or for none stops
the running launcher first. When the plan keeps the old task on other nodes,
the launcher is asked to leave at a step boundary first (SIGUSR2: its workers
retire from the data-parallel group, the others keep the global batch and
never see a failure); if it has not exited after ``leave_timeout``, or the
task does not go on, it is stopped (SIGTERM, then SIGKILL of its whole tree
after ``stop_timeout``).

Reports: the launcher exiting 0 writes ``tasks/<T>/done/<name>`` (the task
finished); exiting otherwise while the command still stands publishes a SEV2
``launcher_failed`` event and starts it again after a back-off (the
coordinator isolates a node that fails repeatedly).
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import structlog

from unicron_elastic.api import MalformedValueError, StoreError
from unicron_elastic.coordinator.api import ClusterPlan, Command, NodeRecord, TaskSpec
from unicron_elastic.coordinator.transition import keeps_running, leaves_first
from unicron_elastic.env import launcher_environment
from unicron_elastic.events import ErrorEvent, Severity
from unicron_elastic.processes import signal_tree
from unicron_elastic.store.client import StatusStore
from unicron_elastic.store.lease import KeptLease
from unicron_elastic.store.watch import PrefixWatch

log = structlog.get_logger(__name__)

#: Seconds a task's first rendezvous round waits for more nodes after the first one arrived.
LAST_CALL_S = 5
#: Seconds between a failed launcher and its next start.
RESTART_BACKOFF_S = 1.0
#: Seconds between two reads of this node's commands when its watch said nothing (a safety net: the watch
#: wakes the daemon on every new command).
COMMAND_RECHECK_S = 5.0
#: Seconds between two looks at the launcher (no etcd request).
SUPERVISE_S = 0.2


class NodeDaemon:
    """One machine's daemon.

    Args:
        store: The cluster's status store.
        name: The node's name (unique in the cluster).
        slots: Workers it runs (its GPUs).
        ttl: Lease TTL in seconds (the node counts as lost within about this).
        launcher_args: Extra ``unicron-run`` flags for every task (e.g. ``--node-ttl=1``).
        stop_timeout: Seconds a stopped launcher gets before SIGKILL.
        leave_timeout: Seconds a launcher asked to leave its task at a step
            boundary gets before it is stopped.
    """

    def __init__(self, store: StatusStore, name: str, slots: int, ttl: int = 2,
                 launcher_args: Sequence[str] = (), stop_timeout: float = 30.0, leave_timeout: float = 60.0) -> None:
        self.store = store
        self.name = name
        self.record = NodeRecord(name, slots, socket.gethostname(), os.getpid())
        self.ttl = ttl
        self.launcher_args = list(launcher_args)
        self.stop_timeout = stop_timeout
        self.leave_timeout = leave_timeout
        self.stopped = threading.Event()
        self._hurry = threading.Event()  # stop now: no drain, no waiting for a launcher to leave
        self._draining = False
        self._leaving = False  # the record says ``leaving`` (a drain is under way)
        self._wake = threading.Event()
        self._commands_changed = threading.Event()  # the command watch saw a write: read the commands
        self._recheck_at = 0.0  # monotonic time of the next read of the commands without a watch event
        self.applied: Command | None = None
        self.launcher: subprocess.Popen | None = None
        self.task: str | None = None
        self.lease: KeptLease | None = None
        self._next_start = 0.0

    # -- lifecycle ---------------------------------------------------------------------------------
    def run(self) -> int:
        """Register, follow commands until :meth:`stop`; then stop the launcher and leave.

        Returns:
            0 after a requested stop, 1 if the node's lease was lost.
        """
        keys = self.store.keys
        self.lease = KeptLease(self.store, self.ttl, on_lost=self.stop, on_renewed=self._register)
        self._register(self.lease.id)
        watch = PrefixWatch(self.store, keys.commands(self.name), self._on_command)
        try:
            while not self.stopped.is_set():
                self._wake.clear()
                self.tick()
                self._wake.wait(SUPERVISE_S)
        finally:
            watch.cancel()
            if self._draining and not self.lease.lost.is_set():
                self._drain()  # (marks the record ``leaving``: the coordinator plans the node out, no SEV1)
            self._stop_launcher()
            lost = self.lease.lost.is_set()
            self.lease.close(revoke=not lost)  # a stop without a drain: the record vanishes, a node lost
        return 1 if lost else 0

    def _register(self, lease: int) -> None:
        """Put this node's record on ``lease``; again after a lapsed lease was renewed.

        The coordinator saw the record go (the node lost: it was planned out)
        and sees it come back (a node joined: planned in again), as if the
        daemon had been restarted.

        Raises:
            StoreError: etcd refused or could not be reached.
        """
        state = "leaving" if self._leaving else "up"  # (a renewal during a drain must not undo it)
        self.store.put(self.store.keys.node(self.name), self.record.to_json(state), lease=lease)
        log.info("node_registered", node=self.name, slots=self.record.slots, lease=lease, state=state)

    def stop(self) -> None:
        """Ask :meth:`run` to stop now (thread- and signal-safe): the launcher is stopped, not drained.

        The coordinator sees the node's record go (a node lost, SEV1) unless a drain marked it ``leaving``.
        """
        self._hurry.set()
        self.stopped.set()
        self._wake.set()

    def drain(self) -> None:
        """Ask :meth:`run` to take the node out of the cluster, then stop (thread- and signal-safe).

        The record is marked ``leaving`` (the coordinator re-plans without the
        node: no failure, no alert) and the daemon follows the plan that drops
        it for up to ``leave_timeout``: a task that goes on elsewhere is left at
        a step boundary. A second call stops now (:meth:`stop`).
        """
        if self.stopped.is_set():
            self.stop()
            return
        self._draining = True
        self.stopped.set()
        self._wake.set()

    def _drain(self) -> None:
        """Mark the record ``leaving``; once the plan drops this node, leave a task that goes on elsewhere."""
        from unicron_elastic.coordinator.records import read_plan

        assert self.lease is not None
        self._leaving = True
        try:
            self.store.put(self.store.keys.node(self.name), self.record.to_json("leaving"), lease=self.lease.id)
        except StoreError as exc:
            log.warning("node_not_drained", node=self.name, error=str(exc)[:200])
            return
        log.info("node_draining", node=self.name, task=self.task, timeout=self.leave_timeout)
        deadline = time.monotonic() + self.leave_timeout
        while not self._hurry.is_set() and time.monotonic() < deadline:
            code = self.launcher.poll() if self.launcher is not None else None
            try:
                if code is not None:  # it ended meanwhile: report a completion, do not restart a failure
                    self.launcher = None
                    if code == 0 and self.task is not None:
                        self._ended(self.task, code)
                plan = read_plan(self.store)
            except StoreError as exc:
                log.warning("node_not_drained", node=self.name, error=str(exc)[:200])
                return
            if plan is None or self.name not in plan.nodes:  # re-planned without this node (or never planned)
                if self.launcher is not None and self.task is not None and leaves_first(plan, self.task, self.name):
                    self._leave_launcher()
                break
            time.sleep(0.1)
        log.info("node_drained" if self.launcher is None else "node_not_drained", node=self.name, task=self.task)

    def _on_command(self, _event: object) -> None:
        """(The watch's thread) a command was written or deleted: the loop reads them now."""
        self._commands_changed.set()
        self._wake.set()

    def tick(self) -> None:
        """Apply the newest command (when the watch saw one, or every :data:`COMMAND_RECHECK_S`), then look after
        the launcher."""
        now = time.monotonic()
        if self._commands_changed.is_set() or now >= self._recheck_at:
            self._commands_changed.clear()  # (before the read: a command written meanwhile is read next time)
            self._recheck_at = now + COMMAND_RECHECK_S
            command = self.latest_command()
            if command is not None and (self.applied is None or command.generation > self.applied.generation):
                self.apply(command)
        self.supervise()

    # -- commands ----------------------------------------------------------------------------------
    def latest_command(self) -> Command | None:
        """The newest command for this node (older ones are deleted), or None."""
        kvs = self.store.get_prefix(self.store.keys.commands(self.name))
        commands = []
        for kv in kvs:
            try:
                commands.append((Command.from_json(kv.value), kv.key))
            except MalformedValueError:
                log.warning("malformed_command_skipped", key=kv.key)
        if not commands:
            return None
        commands.sort(key=lambda c: c[0].generation)
        for _, key in commands[:-1]:
            self.store.delete(key)
        return commands[-1][0]

    def apply(self, command: Command) -> None:
        """Run the command's task (stopping another one first) or stop what runs."""
        log.info("command", node=self.name, generation=command.generation, task=command.task,
                 running=self.task)
        self.applied = command
        if keeps_running(self.task, self.launcher is not None, command):
            return
        if self.task is not None and leaves_first(self._stored_plan(), self.task, self.name):
            self._leave_launcher()
        self._stop_launcher()
        self.task = command.task
        self._next_start = 0.0

    def supervise(self) -> None:
        """Start the launcher the command asks for; report how a launcher ended."""
        if self.task is None:
            return
        if self.launcher is not None:
            code = self.launcher.poll()
            if code is None:
                return
            self.launcher = None
            self._ended(self.task, code)
            return
        if time.monotonic() >= self._next_start:
            self._start(self.task)

    def _ended(self, task: str, code: int) -> None:
        keys = self.store.keys
        if code == 0:
            log.info("task_done_on_node", node=self.name, task=task)
            self.store.put(keys.task_done(task, self.name), str(time.time()))
            self.task = None
            return
        log.warning("launcher_failed", node=self.name, task=task, exitcode=code)
        event = ErrorEvent(Severity.SEV2, "launcher_failed", "node-daemon", self.name, task=task,
                           message=f"unicron-run of task {task} exited with code {code}")
        try:
            self.store.append_event(event.to_json())
        except StoreError as exc:
            log.warning("event_not_published", error=str(exc))
        self._next_start = time.monotonic() + RESTART_BACKOFF_S

    # -- the launcher ------------------------------------------------------------------------------
    def launcher_argv(self, spec: TaskSpec, per_node: int | None = None) -> list[str]:
        """The ``unicron-run`` command line of ``spec`` on this node.

        ``--nnodes=1:ceil(max_workers / slots)`` with a last call of
        :data:`LAST_CALL_S`: the first round forms that long after the first
        node arrives (the plan's nodes start together), or at once with every
        node. A fixed minimum would wait forever when the plan shrinks the task
        before its first round formed.
        """
        config = self.store.config
        slots = min(per_node or self.record.slots, self.record.slots)  # the plan's workers per node
        most = max(1, math.ceil(spec.max_workers / slots))
        conf = [f"cluster={config.cluster}", f"task={spec.name}", f"last_call_timeout={LAST_CALL_S}"]
        if config.ca_cert:
            conf.append(f"ca_cert={config.ca_cert}")
        if config.cert_cert and config.cert_key:
            conf += [f"cert_cert={config.cert_cert}", f"cert_key={config.cert_key}"]
        if config.user:
            conf.append(f"user={config.user}")  # the password travels in $UNICRON_ETCD_PASSWORD
        return [
            sys.executable, "-m", "unicron_elastic.launcher",
            f"--nnodes=1:{most}",
            f"--nproc-per-node={slots}",
            "--rdzv-backend=unicron",
            f"--rdzv-endpoint={config.endpoint}",
            f"--rdzv-id={spec.name}",
            f"--rdzv-conf={','.join(conf)}",
            f"--node-name={self.name}",
            *self.launcher_args,
            "--no-python",
            *spec.command,
        ]

    def _start(self, task: str) -> None:
        from unicron_elastic.coordinator.records import read_specs

        spec = read_specs(self.store).get(task)
        if spec is None:
            log.error("task_spec_missing", node=self.name, task=task)
            self._next_start = time.monotonic() + RESTART_BACKOFF_S
            return
        env = launcher_environment(self.name, os.getpid(), self.store.config.password or None)
        command = self.applied
        per_node = command.workers // command.nodes if command is not None and command.nodes else None
        argv = self.launcher_argv(spec, per_node)
        log.info("launcher_starting", node=self.name, task=task, argv=argv)
        self.launcher = subprocess.Popen(argv, env=env)

    def _stored_plan(self) -> ClusterPlan | None:
        """The plan in the store (None: none yet, or unreadable: then the launcher is stopped, not left)."""
        from unicron_elastic.coordinator.records import read_plan

        try:
            return read_plan(self.store)
        except StoreError as exc:
            log.warning("plan_unreadable", error=str(exc)[:200])
            return None

    def _leave_launcher(self) -> None:
        """Ask the launcher to leave its task at a step boundary; wait up to ``leave_timeout`` for it to exit.

        Its exit is not the task's completion (no ``done`` marker): the task goes on elsewhere.
        """
        from unicron_elastic.agent.signals import LEAVE_SIGNAL

        proc = self.launcher
        if proc is None or proc.poll() is not None:
            return
        log.info("launcher_leaving", node=self.name, task=self.task, pid=proc.pid)
        proc.send_signal(LEAVE_SIGNAL)
        deadline = time.monotonic() + self.leave_timeout
        while proc.poll() is None and time.monotonic() < deadline and not self._hurry.is_set():
            time.sleep(0.05)
        code = proc.poll()
        if code is None:
            log.warning("launcher_did_not_leave", node=self.name, task=self.task, seconds=self.leave_timeout)
            return
        log.info("launcher_left" if code == 0 else "launcher_stopped_instead_of_leaving", node=self.name,
                 task=self.task, exitcode=code)
        self.launcher = None

    def _stop_launcher(self) -> None:
        """SIGTERM the launcher (it stops its workers); after ``stop_timeout`` SIGKILL its whole process tree.

        torch starts workers in sessions of their own, so killing the launcher
        alone would leave them running on slots the plan gives another task.
        """
        proc, self.launcher = self.launcher, None
        if proc is None or proc.poll() is not None:
            return
        log.info("launcher_stopping", node=self.name, task=self.task, pid=proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            log.warning("launcher_killed", node=self.name, task=self.task, pids=signal_tree(proc.pid))
            proc.wait()
