"""``UnicronAgent``: torchrun's local agent with in-band detection and the ladder.

On top of ``LocalElasticAgent`` it

* opens the worker channel (``UNICRON_AGENT_SOCKET``) and runs the detectors
  (``unicron_detectors`` hook; built-ins in ``detectors.py``);
* turns every detection into one :class:`~unicron_elastic.events.ErrorEvent`,
  published to etcd (when the ``unicron`` rendezvous gives it a store), to the
  log and to the ``unicron_event`` hook;
* executes :func:`~unicron_elastic.agent.ladder.climb`: SEV3 reattempt in
  place, SEV2 restart of only the failed worker (resumable workers), SEV1 give
  up the node (:class:`NodeGaveUp`, exit code 75). Plain scripts keep torchrun's
  restart-all behaviour;
* restarts a worker that asked to rejoin (alive but left out of its group,
  message ``rejoin``) as a joiner when it exits: no error event, a ``left_out``
  decision counted in ``rejoins`` (bounded by ``max_rejoins``), not in restarts;
* stops for good on a signal or any error: from the moment torch shuts the
  workers down, no detection acts and nothing is respawned.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from subprocess import Popen
from typing import Any

import structlog
from prometheus_client import Counter, Histogram
from torch.distributed.elastic.agent.server.api import RunResult, Worker, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import SignalException

from unicron_elastic.agent import _torch_compat, detectors
from unicron_elastic.agent.api import AgentConfig, Detector, NodeGaveUp
from unicron_elastic.agent.channel import AgentChannel
from unicron_elastic.agent.ladder import LEFT_OUT, Action, RankHistory, Rung, climb
from unicron_elastic.agent.meeting_point import MeetingPoint
from unicron_elastic.agent.rank_state import HELLO_GRACE_S, LeaveDecision, RankState, leave_decision
from unicron_elastic.agent.signals import (
    begin_shutdown,
    install_leave_signal,
    install_stop_signals,
    leave_requested,
    leaving_ends_the_wait,
    raise_if_orphaned,
    raise_pending_stop,
    signal_for_workers,
    stop_signals_deferred,
)
from unicron_elastic.api import ConfigError, StoreError
from unicron_elastic.detection.hang import Finding
from unicron_elastic.events import Classification, ErrorEvent, Severity
from unicron_elastic.env import (
    node_daemon,
    respawn_env,
    set_agent_socket,
    incarnation,
    set_group_start,
    set_joiner,
    set_max_world,
    set_round,
)
from unicron_elastic.plugins.manager import call_isolated, classify_exception, plugin_manager
from unicron_elastic.processes import signal_tree
from unicron_elastic.rendezvous.api import RoundJoined, RoundStart, UnicronRendezvous, max_world, ranks_past_round
from unicron_elastic.store.client import StatusStore

log = structlog.get_logger(__name__)

#: Findings the agent publishes and never acts on: the rank is slow, not failed.
OBSERVED_ONLY = ("link_flapping", "straggler")
EVENTS = Counter("unicron_events_total", "Error events detected by this agent", ["severity", "kind", "detector"])
ACTIONS = Counter("unicron_actions_total", "Actions taken by this agent", ["action"])
DETECTION = Histogram("unicron_detection_latency_seconds", "From failure to detection", ["detector"],
                      buckets=(0.01, 0.05, 0.1, 0.3, 1, 3, 10, 60))

def make_detectors(config: AgentConfig, pm: Any = None) -> list[Detector]:
    """The detectors ``config.detectors`` names, from the ``unicron_detectors`` hook.

    Args:
        config: The agent settings.
        pm: The plugin manager (default: a new one with the installed plugins).

    Returns:
        One detector per name, in the order given.

    Raises:
        ConfigError: A name is provided by no plugin; the message lists the known ones.
    """
    provided: dict[str, Detector] = {}
    for batch in call_isolated(pm or plugin_manager(builtins=(detectors,)), "unicron_detectors", config=config):
        for detector in batch:
            provided.setdefault(detector.name, detector)
    unknown = [name for name in config.detectors if name not in provided]
    if unknown:
        raise ConfigError(f"--detectors: unknown detector(s) {', '.join(map(repr, unknown))}; "
                          f"known: {', '.join(sorted(provided))}")
    return [provided[name] for name in config.detectors]


def _unicron(handler: Any) -> UnicronRendezvous | None:
    """``handler`` if it is a ``unicron`` rendezvous handler; None for another backend's (torch's c10d, static, ...)."""
    return handler if isinstance(handler, UnicronRendezvous) else None


def _round_joined(handler: Any) -> RoundJoined | None:
    """What the ``unicron`` rendezvous ``handler`` handed over about the round this node joined (None: another backend).

    Raises:
        RuntimeError: Asked before this node's first rendezvous completed.
    """
    rendezvous = _unicron(handler)
    if rendezvous is None:
        return None
    joined = rendezvous.round_joined
    if joined is None:
        raise RuntimeError("the unicron rendezvous has handed over no round: this node joined none yet")
    return joined


class UnicronAgent(LocalElasticAgent):
    """The agent ``unicron-run`` builds (``LocalElasticAgent`` arguments plus ``config``)."""

    def __init__(self, *args: Any, config: AgentConfig | None = None,
                 shutdown_timeout: int = _torch_compat.DEFAULT_SHUTDOWN_TIMEOUT_S, **kwargs: Any) -> None:
        if _torch_compat.agent_takes_shutdown_timeout():
            kwargs["shutdown_timeout"] = shutdown_timeout
        super().__init__(*args, **kwargs)
        self.shutdown_timeout = shutdown_timeout  # every stop of the workers, a restart's included (_shutdown)
        self.config = config or AgentConfig()
        self.node = self.config.node
        self.rendezvous_count = 0  # rounds this agent joined (part of each worker's incarnation)
        self.events: list[ErrorEvent] = []
        self.actions: list[tuple[str, int]] = []
        self._lock = threading.RLock()
        self._ranks: dict[int, RankState] = {}  # global rank -> what this agent knows of it (under the lock)
        self._handled_pids: set[int] = set()
        self._give_up: Rung | None = None
        self._stopping = False  # torch is stopping the workers: their exits are not failures
        self._closed = False  # stopping for good (signal, error, end of run): never act or respawn again
        self._restarting = False  # inside _stop_workers: a stop before a restart, not the final one
        self.left = False  # asked to leave: the workers leave the data-parallel group at a step boundary
        self._leave_waiting_since: float | None = None  # a leave waits for workers' hello since then (monotonic)
        self.finished = False  # every worker of this node succeeded (torch's exit barrier comes only then)
        self._pm = plugin_manager(builtins=(detectors,))
        self._detectors = make_detectors(self.config, self._pm)
        self._started = False
        tmp = tempfile.mkdtemp(prefix="unicron-")
        try:
            self._channel = AgentChannel(tmp, self._on_message)
        except BaseException:  # a signal or a socket error: leave no temp dir behind
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._dir: str | None = tmp
        set_agent_socket(self._channel.path)
        self._meeting: MeetingPoint | None = None
        rendezvous = self._unicron_rendezvous()
        if rendezvous is not None:  # a returning node takes its place, no restart-all (ranks of a place it adds)
            rendezvous.join_running_rounds(self._worker_group.spec.local_world_size)

    # -- set-up ----------------------------------------------------------------
    def _unicron_rendezvous(self) -> UnicronRendezvous | None:
        """The ``unicron`` rendezvous handler; None with another backend (torch's c10d, static, ...)."""
        return _unicron(self._worker_group.spec.rdzv_handler)

    @property
    def store(self) -> StatusStore | None:
        """The etcd status store of the ``unicron`` rendezvous, if that is the backend."""
        rendezvous = self._unicron_rendezvous()
        return rendezvous.status_store if rendezvous is not None else None

    @property
    def task(self) -> str:
        rendezvous = self._unicron_rendezvous()
        return (rendezvous.task if rendezvous is not None else "") or self._worker_group.spec.rdzv_handler.get_run_id()

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        with leaving_ends_the_wait():  # (a drain seen before the node has a round: it takes no part)
            super()._rendezvous(worker_group)
        raise_pending_stop()  # a signal that the rendezvous' etcd calls swallowed
        self.rendezvous_count += 1
        structlog.contextvars.bind_contextvars(
            run_id=worker_group.spec.rdzv_handler.get_run_id(),
            node=self.node,
            group_rank=worker_group.group_rank,
            rendezvous_count=self.rendezvous_count,
        )
        world_size = worker_group.workers[0].world_size if worker_group.workers else None
        log.info("agent_rendezvous_complete", world_size=world_size)
        joined = _round_joined(worker_group.spec.rdzv_handler)
        if joined is not None and joined.running:
            set_joiner()  # its workers join the running task from a replica
        if joined is not None:  # > 0: this run's workers were restarted all together (torch's restart-all)
            set_round(joined.round)
        self._open_meeting(worker_group, joined)
        if self._meeting is not None and self._meeting.start is not None:  # the same for every worker of the run
            set_max_world(self._meeting.start.max_world)
        if not self._started:
            self._started = True
            for detector in self._detectors:
                try:
                    detector.start(self)
                except Exception:  # noqa: BLE001 - a broken detector must not stop the agent
                    log.exception("detector_start_failed", detector=detector.name)

    @staticmethod
    def _round_start(worker_group: WorkerGroup, max_nodes: int) -> RoundStart | None:
        """This round as torch formed it, seen from this node (the round's first agent records it).

        Places that nodes add get this node's ``--nproc-per-node`` workers
        each, up to ``max_nodes`` (``--nnodes``' max).
        """
        if not worker_group.workers:
            return None
        spec = worker_group.spec
        nodes, world = worker_group.group_world_size, worker_group.workers[0].world_size
        return RoundStart(nodes, world, spec.local_world_size,
                          max_world(nodes, world, max_nodes, spec.local_world_size))

    def _assign_worker_ranks(self, store: Any, group_rank: int, group_world_size: int,
                             spec: WorkerSpec) -> list[Worker]:
        """torch's ranks, except on a place past the round torch formed (a node that grew the run).

        torch's rank assignment would wait for the round's first agent, which
        assigned ranks only when the round formed: see :func:`ranks_past_round`.
        """
        joined = _round_joined(spec.rdzv_handler)
        past = joined.past_round if joined is not None else None
        if past is None:
            return super()._assign_worker_ranks(store, group_rank, group_world_size, spec)
        world = past.world
        return [Worker(local_rank=i, global_rank=rank, role_rank=rank, world_size=world, role_world_size=world)
                for i, rank in enumerate(ranks_past_round(past.nodes, world, group_rank, spec.local_world_size))]

    def _open_meeting(self, worker_group: WorkerGroup, joined: RoundJoined | None) -> None:
        """With the etcd rendezvous: the workers of this round meet in etcd, with liveness keys (nothing on one node).

        The meeting point also hosts this node's snapshot server, at the
        address the rendezvous advertises for this node (torch's rule:
        ``--local-addr``, else the FQDN).

        Args:
            worker_group: This round's workers.
            joined: What the ``unicron`` rendezvous handed over about the round (None: another backend).
        """
        rendezvous = _unicron(worker_group.spec.rdzv_handler)
        store = rendezvous.status_store if rendezvous is not None else None
        if rendezvous is None or store is None or joined is None:
            return
        if self._meeting is not None:
            self._meeting.close()
        watching = any(hasattr(d, "peer_lost") for d in self._detectors)
        under_daemon = node_daemon() is not None
        self._meeting = MeetingPoint(store, worker_group.spec.rdzv_handler.get_run_id(), joined.round,
                                     self.config.node_ttl, worker_group.group_rank, worker_group.group_world_size,
                                     host=worker_group.spec.local_addr or socket.getfqdn(),
                                     start=self._round_start(worker_group, rendezvous.max_nodes),
                                     on_place_lost=self.lost_place,
                                     node=self.node, on_peer_lost=self._peer_lost if watching else None,
                                     on_lease_lost=self.lost_own_lease if under_daemon else None)
        self._meeting.export()
        for worker in worker_group.workers:
            self._meeting.worker_started(worker.global_rank, incarnation(self.node, self.rendezvous_count, 0), self.left)

    def _exit_barrier(self) -> None:
        """Wait for the other nodes to finish, not for nodes that were lost (torch's waits for all).

        A node that left the task (:meth:`leave_at_step_boundary`) does not wait: the others train on.
        """
        self.finished = not self.left
        if self.left:
            log.info("exit_barrier_skipped", reason="this node left the task")
            return
        if self._meeting is None:
            super()._exit_barrier()
            return
        started = time.monotonic()
        try:
            running = self._meeting.exit_barrier(self._worker_group.group_world_size, self._exit_barrier_timeout)
        except StoreError as exc:
            log.error("exit_barrier_failed", error=str(exc)[:200])
            return
        log.info("exit_barrier_done", seconds=round(time.monotonic() - started, 3), still_running=running)

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        with self._lock:
            self._stopping = True
        self._restarting = True
        try:
            super()._stop_workers(worker_group)  # calls self._shutdown()
        finally:
            self._restarting = False

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int | None = None) -> None:
        """Stop the workers; unless for a restart, stop for good first (never respawn again).

        torch calls this from ``run()`` on a signal (``death_sig`` is that
        signal) and on any error or the end of the run, and from
        :meth:`_stop_workers` before a restart of the group; torch before 2.12
        passes no ``timeout``. The workers get :attr:`shutdown_timeout` seconds
        after ``death_sig`` whatever the release (torch's own ``_shutdown`` is
        left the rest of its clean-up: its watchdog and health-check server).
        """
        if not self._restarting:
            self._close_for_good()
        pcontext, self._pcontext = self._pcontext, None
        try:
            super()._shutdown(death_sig)  # (no workers to stop: they are ours to stop)
        finally:
            self._pcontext = pcontext
        _torch_compat.stop_workers(pcontext, signal_for_workers(death_sig),
                                   self.shutdown_timeout if timeout is None else timeout)

    def _close_for_good(self) -> None:
        """Under the lock: no detection acts and no worker is respawned from now on.

        A respawn under way (it holds the lock) finishes first, so torch's
        shutdown that follows sees and stops its process.
        """
        begin_shutdown()
        with self._lock:
            if not self._closed:
                log.info("agent_stopping", pending_give_up=self._give_up is not None)
            self._closed = True
            self._stopping = True

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        set_group_start(self.node, self.rendezvous_count)
        with stop_signals_deferred():  # a signal now: after torch recorded every worker, so it stops them all
            ids = super()._start_workers(worker_group)
            install_stop_signals()  # in case torch registered its own handler after all
            install_leave_signal()  # (TORCHELASTIC_SIGNALS_TO_HANDLE may name SIGUSR2)
        with self._lock:  # only now: exits seen before are the previous round's
            self._stopping = self._closed
            for state in self._ranks.values():  # requests of the previous round's processes
                state.rejoining = None
        self._notify_started(list(ids), incarnation(self.node, self.rendezvous_count, 0))
        return ids

    def _notify_started(self, local_ranks: list[int], incarnation: str) -> None:
        for detector in self._detectors:
            try:
                detector.on_workers_started(local_ranks, incarnation)
            except Exception:  # noqa: BLE001
                log.exception("detector_failed", detector=detector.name)

    def _notify_failed(self, rank: int) -> None:
        now = time.monotonic()
        for detector in self._detectors:
            try:
                detector.on_rank_failed(rank, now)
            except Exception:  # noqa: BLE001 - isolate plugin detectors
                log.exception("detector_failed", detector=detector.name)

    # -- DetectorContext -------------------------------------------------------
    def workers(self) -> dict[int, tuple[int, Popen]]:
        procs = _torch_compat.worker_processes(self._pcontext)
        ranks = {w.local_rank: w.global_rank for w in self._worker_group.workers}
        return {lr: (ranks[lr], proc) for lr, proc in procs.items() if lr in ranks}

    def classify(self, exc_type: str, message: str, traceback: str) -> Classification:
        return classify_exception(self._pm, exc_type, message, traceback)

    def _local_rank(self, rank: int) -> int | None:
        return next((w.local_rank for w in self._worker_group.workers if w.global_rank == rank), None)

    def _process(self, rank: int) -> Popen | None:
        """The running process of ``rank`` (None if it has none or it ended)."""
        local_rank = self._local_rank(rank)
        entry = self.workers().get(local_rank) if local_rank is not None else None
        return entry[1] if entry is not None and entry[1].poll() is None else None

    def publish(self, event: ErrorEvent) -> None:
        """Record, log, store and announce one event."""
        self.events.append(event)
        EVENTS.labels(event.severity.name, event.kind, event.detector).inc()
        DETECTION.labels(event.detector).observe(max(0.0, event.latency))
        log.warning("error_event", severity=event.severity.name, kind=event.kind, detector=event.detector,
                    rank=event.rank, detected_at=event.detected_at, message=event.message[:200])
        store = self.store
        if store is not None:
            try:
                store.append_event(event.to_json())  # keeps the newest store.event_retention events
            except StoreError as exc:
                log.error("event_publish_failed", error=str(exc))
        call_isolated(self._pm, "unicron_event", event=event)

    def report(self, event: ErrorEvent) -> None:
        self.publish(event)
        if event.severity is Severity.SEV1 and event.node == self.node:
            with self._lock:
                self._act(-1, Rung(Action.GIVE_UP, Severity.SEV1, RankHistory(), event.kind), event)

    def _peer_lost(self, node: str, revision: int) -> None:
        """(The meeting point's watch) another node of this round is lost: the detectors that care report it."""
        for detector in self._detectors:
            if hasattr(detector, "peer_lost"):
                try:
                    detector.peer_lost(node, revision)
                except Exception:  # noqa: BLE001 - isolate plugin detectors
                    log.exception("detector_failed", detector=detector.name)

    def lost_place(self) -> None:
        """Another node claimed this node's place in the round while its lease had lapsed: give the node up (SEV1).

        The claimant's workers take this node's ranks; these must not go on beside them.
        """
        self.lost_own_lease("its place in the round was taken by another node while its lease had lapsed")

    def lost_own_lease(self, message: str = "own lease expired") -> None:
        """This node's lease lapsed: give the node up (SEV1), unless its work is already done.

        When the agent is stopping, or one of its workers already finished
        with exit code 0 (training is over: the rest are on their way out),
        there is nothing left to hand to other nodes: a give-up would turn a
        finished run into a failed launcher. That case is logged, not acted on.
        """
        with self._lock:
            finishing = self._stopping or self._closed or self._some_worker_finished()
        if finishing:
            log.warning("own_lease_lost_after_work_done", node=self.node,
                        reason="agent stopping" if self._stopping or self._closed else "a worker finished with 0")
            return
        self.report(ErrorEvent(Severity.SEV1, "lost_connection", "node", self.node, message=message))

    def _some_worker_finished(self) -> bool:
        """Whether one of this node's current workers exited with code 0 (caller holds the lock)."""
        return any(proc.poll() == 0 for proc in _torch_compat.worker_processes(self._pcontext).values())

    def _event(self, severity: Severity, kind: str, detector: str, rank: int, message: str, occurred: float,
               detected: float | None = None) -> ErrorEvent:
        return ErrorEvent(severity, kind, detector, self.node, rank=rank, task=self.task, message=message,
                          occurred_at=occurred, detected_at=time.time() if detected is None else detected)

    def worker_exited(self, local_rank: int, pid: int, exitcode: int, detected_at: float) -> None:
        with self._lock:
            if pid in self._handled_pids:
                return
            self._handled_pids.add(pid)
            rank, current = self.workers().get(local_rank, (-1, None))
            if current is None or current.pid != pid:
                return  # a process torch already replaced (restart-all): not a new failure
            if not self._stopping:  # first: the etcd write below can take etcd's request timeout (a lost leader)
                self._notify_failed(rank)  # its peers may wait in a collective with it: not a hang
            if self._meeting is not None and not self._stopping:  # (stopping: close() revokes the lease)
                self._meeting.worker_exited(rank)  # peers regrouping stop waiting for it now
            if self._stopping or self._give_up is not None:
                return
            state = self._state(rank)
            expected, state.expected_exit = state.expected_exit, None
            if expected is not None:  # we killed it (hang): the decision is already made
                self._execute(rank, expected, None)
                return
            if state.rejoining is not None and self._rejoin(rank, pid, exitcode, detected_at):
                return  # finished, or restarted as a joiner: no failure
            fatal, state.fatal = state.fatal, None
            severity = Severity.SEV1 if fatal and fatal.severity is Severity.SEV1 else Severity.SEV2
            kind = fatal.kind if severity is Severity.SEV1 else "exited_abnormally"
            event = self._event(severity, kind, "process", rank, f"pid {pid} exited with {exitcode}",
                                detected_at, detected_at)
            self.publish(event)
            self._climb(rank, event, responsive=False)

    def exception(self, rank: int, msg: dict[str, Any], classification: Classification, received: float) -> None:
        if self._closed:
            return  # stopping for good: a worker's exception on the way out is no failure to act on
        with self._lock:
            rejoining = self._ranks.get(rank, RankState()).rejoining is not None
        if rejoining and msg["fatal"]:  # the exception that left it out (sent after the request): no failure
            log.debug("exception_of_rejoining_worker", rank=rank, type=msg["type"])
            return
        event = self._event(classification.severity, classification.kind, "exception", rank,
                            f"{msg['type']}: {msg['msg']}"[:500], time.time() - (time.monotonic() - received))
        self.publish(event)
        with self._lock:
            if msg["fatal"]:
                self._state(rank).fatal = classification  # acted on when the process exits
                return
            self._climb(rank, event, responsive=True, step=int(msg["step"]))

    def hang(self, rank: int, finding: Finding) -> None:
        if self._closed or self._process(rank) is None:
            return  # stopping for good, or finished or already dead: process supervision has it
        occurred = time.time() - (time.monotonic() - finding.since)
        detector = "straggler" if finding.kind == "straggler" else "hang"
        event = self._event(finding.severity, finding.kind, detector, rank, finding.message, occurred)
        self.publish(event)
        if finding.kind in OBSERVED_ONLY:
            return  # slow, not failed: reported, nothing to retry or restart
        with self._lock:
            self._climb(rank, event, responsive=False)

    def _rejoin(self, rank: int, pid: int, exitcode: int, detected_at: float) -> bool:
        """The worker of ``rank`` exited after asking to rejoin (caller holds the lock; clears the request).

        Exit code 0: it finished, nothing to do. Otherwise the ladder decides
        on an unpublished ``left_out`` event: a restart as a joiner (counted
        in ``rejoins``, bounded by ``max_rejoins``) is no failure, so no event
        is published (nor passed to the ``unicron_event`` hook).

        Returns:
            Whether the exit is handled; False (a plain script, or
            ``max_rejoins`` used up): it is an ordinary exit for the caller to handle.
        """
        state = self._ranks[rank]
        reason, state.rejoining = state.rejoining or "", None
        if exitcode == 0:
            log.info("worker_finished_after_rejoin_request", rank=rank, pid=pid)
            return True
        event = self._event(Severity.SEV3, LEFT_OUT, "process", rank, f"pid {pid} left out: {reason}"[:500],
                            detected_at, detected_at)
        history = replace(state.history, responsive=False)
        decision = climb(self.config.ladder, history, event)
        if decision.history.rejoins == history.rejoins:  # the ladder counted no rejoin
            why = "worker not resumable" if not history.resumable else f"max_rejoins={self.config.ladder.max_rejoins}"
            log.warning("rejoin_refused", rank=rank, reason=why, pid=pid, exitcode=exitcode)
            return False
        state.fatal = None
        log.info("worker_rejoining", rank=rank, reason=reason[:200], pid=pid, exitcode=exitcode)
        state.history = decision.history
        self._act(rank, decision, event)
        return True

    # -- the ladder --------------------------------------------------------------
    def _climb(self, rank: int, event: ErrorEvent, responsive: bool, step: int = -1) -> None:
        state = self._state(rank)
        decision = climb(self.config.ladder, replace(state.history, responsive=responsive), event, step)
        state.history = decision.history
        self._act(rank, decision, event)

    def _state(self, rank: int) -> RankState:
        """The record of ``rank``, made on its first write (caller holds the lock; reads use ``_ranks.get``)."""
        return self._ranks.setdefault(rank, RankState())

    def _act(self, rank: int, decision: Rung, event: ErrorEvent) -> None:
        if self._closed:  # callers hold the lock: a shutdown that began is final
            log.info("agent_action_skipped", action=decision.action.value, rank=rank, reason="agent stopping")
            return
        log.info("agent_action", action=decision.action.value, rank=rank, reason=decision.reason)
        ACTIONS.labels(decision.action.value).inc()
        call_isolated(self._pm, "unicron_action", action=decision.action.value, event=event,
                      detail={"rank": rank, "reason": decision.reason})
        process = self._process(rank)
        if decision.action is Action.REATTEMPT:
            self.actions.append((decision.action.value, rank))
            self._channel.send(self._ranks.get(rank, RankState()).reply, {"t": "verdict", "action": "reattempt"})
        elif process is not None and decision.action in (Action.RESTART_WORKER, Action.RESTART_ALL):
            # still running (hung, or told to stop): stop it and every process it started (its DataLoader
            # workers, a deadlocked one included, would outlive it), act on its exit
            state = self._state(rank)
            state.expected_exit = decision
            self._channel.send(state.reply, {"t": "verdict", "action": "exit"})
            signal_tree(process.pid, signal.SIGKILL)
        else:
            self._execute(rank, decision, self._local_rank(rank))

    def _execute(self, rank: int, decision: Rung, local_rank: int | None) -> None:
        if self._closed:
            return
        self.actions.append((decision.action.value, rank))
        local_rank = self._local_rank(rank) if local_rank is None else local_rank
        if decision.action is Action.RESTART_WORKER and local_rank is not None:
            if _torch_compat.supports_per_rank_restart(self._pcontext):
                self._respawn(local_rank)
                return
            decision = replace(decision, action=Action.RESTART_ALL)
        if decision.action is Action.GIVE_UP:
            self._give_up = decision
        # RESTART_ALL: torch's monitor sees the failed process and restarts the group

    def _respawn(self, local_rank: int) -> None:
        with self._lock:  # held by every caller already; re-entrant
            if self._stopping or self._closed:
                log.info("worker_restart_skipped", local_rank=local_rank, reason="agent stopping")
                return
            with stop_signals_deferred():  # (main thread) torch must know the new process before a stop
                self._respawn_locked(local_rank)

    def _respawn_locked(self, local_rank: int) -> None:
        worker = self._worker_group.workers[local_rank]
        state = self._state(worker.global_rank)
        history = state.history
        restarts = history.restarts + history.rejoins  # a rejoined worker is a joiner too: a new incarnation
        state.rejoining = None
        if self._meeting is not None:
            self._meeting.worker_started(worker.global_rank, incarnation(self.node, self.rendezvous_count, restarts), self.left)
        env = respawn_env(self.node, self.rendezvous_count, restarts)
        started = time.monotonic()
        pid = _torch_compat.respawn(self._pcontext, local_rank, env)  # type: ignore[arg-type]
        worker.id = pid
        state.reply = ""
        log.info("worker_restarted", rank=worker.global_rank, local_rank=local_rank, pid=pid,
                 seconds=round(time.monotonic() - started, 4))
        self._notify_started([local_rank], incarnation(self.node, self.rendezvous_count, restarts))

    # -- messages and monitoring -------------------------------------------------
    def _on_message(self, msg: dict[str, Any], received: float) -> None:
        if msg["t"] == "rejoin":
            self._request_rejoin(msg)
        elif msg["t"] == "hello":
            if self._local_rank(msg["rank"]) is None:
                return  # not one of this agent's workers: no table grows with made-up ranks
            with self._lock:
                state = self._state(msg["rank"])
                state.reply, state.leavable = str(msg["reply"]), msg.get("leavable") is True
                state.history = replace(state.history, resumable=bool(msg["resumable"]))
                meeting = self._meeting
            if msg.get("growable") is True and meeting is not None:
                try:
                    meeting.mark_growable()
                except StoreError as exc:  # a node arriving later then waits for a lost place
                    log.warning("growable_not_recorded", rank=msg["rank"], error=str(exc)[:200])
        for detector in self._detectors:
            try:
                detector.on_message(msg, received)
            except Exception:  # noqa: BLE001 - isolate plugin detectors
                log.exception("detector_failed", detector=detector.name)

    def _request_rejoin(self, msg: dict[str, Any]) -> None:
        """Remember that the worker of ``msg["rank"]`` asked to rejoin (acted on when its process exits).

        A request from a process that is not the rank's current one (a late
        datagram of a worker already replaced, whose exit was handled) or from
        a rank that is not this agent's is dropped.
        """
        rank = msg["rank"]
        with self._lock:
            local_rank = self._local_rank(rank)
            process = self.workers().get(local_rank, (rank, None))[1] if local_rank is not None else None
            if (process is None or process.pid in self._handled_pids
                    or ("pid" in msg and msg["pid"] != process.pid)):
                log.warning("rejoin_request_dropped", rank=rank, reason="not a current worker of this agent")
                return
            self._state(rank).rejoining = str(msg["reason"])

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        raise_pending_stop()  # a signal some library code swallowed
        raise_if_orphaned()
        if leave_requested() and not self.left:
            self.leave_at_step_boundary()
        with self._lock:
            procs = _torch_compat.worker_processes(self._pcontext)
            for local_rank, proc in procs.items():  # no-op while a give-up is pending
                code = proc.poll()
                if code not in (None, 0) and proc.pid not in self._handled_pids:
                    self.worker_exited(local_rank, proc.pid, code, time.time())
                elif code == 0 and proc.pid not in self._handled_pids:
                    self._handled_pids.add(proc.pid)  # finished: no longer live for peers that regroup
                    rank = self.workers().get(local_rank, (-1, None))[0]
                    if rank in self._ranks:  # asked to rejoin, then finished after all: nothing to do
                        self._ranks[rank].rejoining = None
                    if self._meeting is not None and rank >= 0 and not self._stopping:
                        self._meeting.worker_exited(rank)
            if self._give_up is not None:
                self._stopping = True
                raise NodeGaveUp(f"node {self.node} gives up its assignment: {self._give_up.reason}")
            if self._healthy_for_now():
                return RunResult(state=WorkerState.HEALTHY)
            result = super()._monitor_workers(worker_group)
            if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY, WorkerState.SUCCEEDED):
                # torch has just closed the whole group (SIGTERM to the rest): those exits are not failures
                self._stopping = True
            return result

    def leave_at_step_boundary(self) -> None:
        """Ask this node's workers to leave the task's data-parallel group at the next step boundary.

        Each worker gets a leave request in the meeting store; the group's
        leader leaves them out of the next step's members (the global batch
        is kept by the others), they retire and exit 0, and this launcher then
        exits 0 without waiting in the exit barrier and without closing the
        rendezvous (the task goes on; a node may take the place later).
        While a worker has not said yet whether it can leave (starting, or
        restarting), nothing is done, for at most ``HELLO_GRACE_S``: the
        monitor loop asks again at its next interval (:func:`leave_decision`).

        Raises:
            SignalException: (as SIGTERM) The workers cannot leave at a step
                boundary (no meeting store, a worker that said it is not a
                ``unicron_megatron``/``ElasticDataParallel`` rank, or none said
                within ``HELLO_GRACE_S``): they are stopped instead.
        """
        with self._lock:
            ranks = sorted(rank for rank, _ in self.workers().values() if self._process(rank) is not None)
            meeting = self._meeting
            said = [self._ranks[r] for r in ranks if r in self._ranks and self._ranks[r].reply]
            waited = 0.0 if self._leave_waiting_since is None else time.monotonic() - self._leave_waiting_since
            decision = leave_decision(meeting is not None, len(ranks), len(said), all(s.leavable for s in said), waited)
            if decision is LeaveDecision.LEAVE:
                self.left = True  # from now on a worker started for one of these ranks is asked to leave too
        if decision is LeaveDecision.WAIT:
            if self._leave_waiting_since is None:
                log.info("leave_deferred", ranks=ranks, reason="a worker has not said yet whether it can leave",
                         at_most_s=HELLO_GRACE_S)
                self._leave_waiting_since = time.monotonic()
            return
        if decision is LeaveDecision.STOP:
            log.warning("leave_by_stopping", ranks=ranks,
                        reason="no meeting store" if meeting is None else "workers cannot leave at a step boundary "
                        f"(one said so, or none said within {HELLO_GRACE_S:g} s)")
            raise SignalException(f"Process {os.getpid()}: asked to leave; the workers cannot leave at a step "
                                  "boundary", sigval=signal.SIGTERM)
        try:  # etcd requests outside the lock: exits and detections are handled meanwhile
            meeting.ask_to_leave(ranks)
        except StoreError as exc:
            log.error("leave_by_stopping", ranks=ranks, reason=f"leave requests not written: {exc}"[:300])
            raise SignalException(f"Process {os.getpid()}: asked to leave; the requests could not be written",
                                  sigval=signal.SIGTERM) from None
        log.info("leaving_task", ranks=ranks)

    def _healthy_for_now(self) -> bool:
        """Whether torch's monitor must not look at the group this time (caller holds the lock).

        True while some worker runs and every other one ended with 0, and also
        when a worker failed *after* the loop above polled it (its exit is not
        handled yet: it is, at the next interval or by the process detector,
        which waits for the lock): torch's monitor would take that exit for
        the group's failure and stop every worker, healthy ones included.
        """
        procs = _torch_compat.worker_processes(self._pcontext)
        codes = {proc.pid: proc.poll() for proc in procs.values()}
        if any(code not in (None, 0) and pid not in self._handled_pids for pid, code in codes.items()):
            return True
        return bool(procs) and all(code in (None, 0) for code in codes.values()) and None in codes.values()

    def run(self, role: str = "default") -> RunResult:
        """Run the workers until done; detectors and the channel close at the end."""
        try:
            return super().run(role)
        finally:
            self.close()

    def close(self) -> None:
        """Stop for good, then close the meeting point and the detectors, the channel and the temp dir (idempotent).

        The meeting point (its lease revoked) and the detectors get at most the
        shutdown timeout together (either may wait on an unreachable etcd): one
        still stopping after it is left to its daemon thread.
        """
        self._close_for_good()
        if self._dir is None:
            return
        deadline = time.monotonic() + max(2.0, float(self.shutdown_timeout))
        if self._meeting is not None:  # revoking the lease may wait on an unreachable etcd: bounded too
            self._bounded(self._meeting.close, "meeting", deadline)
            self._meeting = None
        for detector in self._detectors:
            self._bounded(detector.stop, detector.name, deadline)
        self._channel.close()
        shutil.rmtree(self._dir, ignore_errors=True)
        self._dir = None

    @staticmethod
    def _bounded(stop: Callable[[], None], name: str, deadline: float) -> None:
        """Run ``stop`` on a daemon thread, waiting for it until ``deadline`` at most."""
        def run() -> None:
            try:
                stop()
            except Exception:  # noqa: BLE001
                log.exception("detector_stop_failed", detector=name)

        thread = threading.Thread(target=run, daemon=True, name=f"unicron-stop-{name}")
        thread.start()
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            log.error("detector_stop_timeout", detector=name)
