"""``UnicronAgent``: torchrun's local agent with in-band detection and the ladder.

On top of ``LocalElasticAgent`` it

* opens the worker channel (``UNICRON_AGENT_SOCKET``) and runs the detectors
  (``unicron_detectors`` hook; built-ins in ``detectors.py``);
* turns every detection into one :class:`~unicron_elastic.events.ErrorEvent`,
  published to etcd (when the ``unicron`` rendezvous gives it a store), to the
  log and to the ``unicron_event`` hook (``publisher.py``);
* executes :func:`~unicron_elastic.agent.ladder.climb` (``remedies.py``): SEV3
  reattempt in place, SEV2 restart of only the failed worker (resumable
  workers), SEV1 give up the node (:class:`NodeGaveUp`, exit code 75). Plain
  scripts keep torchrun's restart-all behaviour;
* restarts a worker that asked to rejoin (alive but left out of its group,
  message ``rejoin``) as a joiner when it exits: no error event, a ``left_out``
  decision counted in ``rejoins`` (bounded by ``max_rejoins``), not in restarts;
* stops for good on a signal or any error: from the moment torch shuts the
  workers down, no detection acts and nothing is respawned.

Its lifecycle is one :class:`~unicron_elastic.agent.lifecycle.AgentState`, and how
the node's part in its task ends one :class:`~unicron_elastic.agent.lifecycle.Departure`.
"""

from __future__ import annotations

import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from subprocess import Popen
from typing import Any

import structlog
from torch.distributed.elastic.agent.server.api import RunResult, Worker, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from typing_extensions import override

from unicron_elastic.agent import _torch_compat, detectors
from unicron_elastic.agent.api import AgentConfig, Detector, NodeGaveUp
from unicron_elastic.agent.channel import AgentChannel
from unicron_elastic.agent.detector_set import DetectorSet, bounded
from unicron_elastic.agent.ladder import RankHistory, Remedy, Rung
from unicron_elastic.agent.leave import NodeLeave
from unicron_elastic.agent.lifecycle import AgentState, Departure, Lifecycle
from unicron_elastic.agent.local_workers import LocalWorkers
from unicron_elastic.agent.meeting_point import MeetingPoint
from unicron_elastic.agent.publisher import EventPublisher
from unicron_elastic.agent.rank_state import RankTable
from unicron_elastic.agent.remedies import Remedies
from unicron_elastic.agent.seam import round_joined, round_start, status_store, task_of, unicron_rendezvous
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
from unicron_elastic.agent.warm.pool import WarmPool
from unicron_elastic.api import ConfigError, StoreError
from unicron_elastic.detection.hang import Finding
from unicron_elastic.env import (
    incarnation,
    node_daemon,
    respawn_env,
    set_agent_socket,
    set_group_start,
    set_joiner,
    set_max_world,
    set_round,
)
from unicron_elastic.events import Classification, ErrorEvent, Severity
from unicron_elastic.plugins.manager import call_isolated, classify_exception, plugin_manager
from unicron_elastic.rendezvous.api import RoundJoined, ranks_past_round
from unicron_elastic.store.client import StatusStore

log = structlog.get_logger(__name__)

#: Findings the agent publishes and never acts on: the rank is slow, not failed.
OBSERVED_ONLY = ("link_flapping", "straggler")


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


def _open_channel(on_message: Callable[[dict[str, Any], float], None]) -> tuple[AgentChannel, str]:
    """The agent's end of the worker channel, in a private temp dir of its own.

    Returns:
        The channel and its directory.

    Raises:
        OSError: The socket could not be opened; the directory is removed again (also on a signal).
    """
    tmp = tempfile.mkdtemp(prefix="unicron-")
    try:
        return AgentChannel(tmp, on_message), tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class UnicronAgent(LocalElasticAgent):
    """The agent ``unicron-run`` builds (``LocalElasticAgent`` arguments plus ``config``).

    It is the detectors' :class:`~unicron_elastic.agent.api.DetectorContext`. Its parts, each given what it
    uses: its :class:`Lifecycle`, the records of its ranks (:class:`RankTable`), its worker processes
    (:class:`LocalWorkers`), the detectors (:class:`DetectorSet`), the events (:class:`EventPublisher`), the
    ladder's rungs carried out (:class:`Remedies`), the worker channel and, with the ``unicron`` rendezvous,
    the round's :class:`MeetingPoint`.

    Args:
        config: The agent settings (default: ``AgentConfig()``).
        warm_pool: The node's warm pool (its workers forked from a zygote), waited for before workers start.
        shutdown_timeout: Seconds the workers get after the stop signal, on every stop of the workers (a
            restart's included) and whatever the torch release.

    Raises:
        ConfigError: ``config`` names a detector no plugin provides.

    Attributes:
        config: The agent settings.
        node: This node's name.
        rendezvous_count: The rounds this agent joined (part of each worker's incarnation).
        events: Every error event published, oldest first.
        actions: ``(action, rank)`` of every rung of the ladder carried out, oldest first.
    """

    def __init__(self, *args: Any, config: AgentConfig | None = None,
                 shutdown_timeout: int = _torch_compat.DEFAULT_SHUTDOWN_TIMEOUT_S, warm_pool: WarmPool | None = None,
                 **kwargs: Any) -> None:
        if _torch_compat.agent_takes_shutdown_timeout():
            kwargs["shutdown_timeout"] = shutdown_timeout
        super().__init__(*args, **kwargs)
        self.shutdown_timeout = shutdown_timeout
        self.config = config or AgentConfig()
        self.node = self.config.node
        self.rendezvous_count = 0
        self._warm_pool = warm_pool
        handler = self._worker_group.spec.rdzv_handler
        self._lock = threading.RLock()
        self._lifecycle = Lifecycle()
        self._ranks = RankTable()
        self._local_workers = LocalWorkers(self._worker_group, lambda: self._pcontext)
        self._pm = plugin_manager(builtins=(detectors,))
        self._detectors = DetectorSet(make_detectors(self.config, self._pm))
        self._publisher = EventPublisher(self.node, self._pm, handler)
        self.events = self._publisher.events
        self._leave = NodeLeave(self._lifecycle)
        self._meeting: MeetingPoint | None = None
        self._channel, tmp = _open_channel(self._on_message)
        self._dir: str | None = tmp
        set_agent_socket(self._channel.path)
        self._remedies = Remedies(policy=self.config.ladder, ranks=self._ranks, workers=self._local_workers,
                                  channel=self._channel, lifecycle=self._lifecycle, publisher=self._publisher,
                                  pm=self._pm, respawn=self._respawn)
        self.actions = self._remedies.actions
        rendezvous = unicron_rendezvous(handler)
        if rendezvous is not None:
            # A returning node takes its place instead of making every node restart (or adds a place).
            rendezvous.join_running_rounds(self._worker_group.spec.local_world_size)

    # -- set-up ----------------------------------------------------------------
    @property
    def store(self) -> StatusStore | None:
        """The etcd status store of the ``unicron`` rendezvous, if that is the backend."""
        return status_store(self._worker_group.spec.rdzv_handler)

    @property
    def task(self) -> str:
        """The task of the run (the run id when the rendezvous names none)."""
        return task_of(self._worker_group.spec.rdzv_handler)

    @property
    def left(self) -> bool:
        """Whether this node left its task: its workers leave the data-parallel group at a step boundary."""
        return self._lifecycle.departure is Departure.LEAVING

    @property
    def finished(self) -> bool:
        """Whether every worker of this node succeeded while it stayed (torch's exit barrier comes only then)."""
        return self._lifecycle.departure is Departure.FINISHED

    @override
    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        """torch's rendezvous, then the round's settings for the workers, its meeting point and (once) the detectors.

        Raises:
            LeftBeforeTraining: The node was asked to leave while it waited for a round.
            SignalException: A stop signal arrived while it waited.
            StoreError: The meeting point could not be opened in etcd.
        """
        # A drain seen before the node has a round ends the wait: the node takes no part.
        with leaving_ends_the_wait():
            super()._rendezvous(worker_group)
        # A signal that the rendezvous' etcd calls swallowed is raised now.
        raise_pending_stop()
        self.rendezvous_count += 1
        structlog.contextvars.bind_contextvars(
            run_id=worker_group.spec.rdzv_handler.get_run_id(),
            node=self.node,
            group_rank=worker_group.group_rank,
            rendezvous_count=self.rendezvous_count,
        )
        world_size = worker_group.workers[0].world_size if worker_group.workers else None
        log.info("agent_rendezvous_complete", world_size=world_size)
        joined = round_joined(worker_group.spec.rdzv_handler)
        if joined is not None and joined.running:
            # The workers join the running task, their state from a replica.
            set_joiner()
        if joined is not None:
            # A round above 0 means that this run's workers were restarted all together (torch's restart-all).
            set_round(joined.round)
        self._open_meeting(worker_group, joined)
        if self._meeting is not None and self._meeting.start is not None:
            # The most workers the run may have: the same for every worker of the run.
            set_max_world(self._meeting.start.max_world)
        if self._lifecycle.first_rendezvous():
            self._detectors.start(self)

    @override
    def _assign_worker_ranks(self, store: Any, group_rank: int, group_world_size: int,
                             spec: WorkerSpec) -> list[Worker]:
        """torch's ranks, except on a place past the round torch formed (a node that grew the run).

        torch's rank assignment would wait for the round's first agent, which
        assigned ranks only when the round formed: see :func:`ranks_past_round`.
        """
        joined = round_joined(spec.rdzv_handler)
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

        Raises:
            StoreError: etcd refused or could not be reached.
        """
        rendezvous = unicron_rendezvous(worker_group.spec.rdzv_handler)
        store = rendezvous.status_store if rendezvous is not None else None
        if rendezvous is None or store is None or joined is None:
            return
        if self._meeting is not None:
            self._meeting.close()
        watching = self._detectors.watches_peers
        under_daemon = node_daemon() is not None
        self._meeting = MeetingPoint(store, worker_group.spec.rdzv_handler.get_run_id(), joined.round,
                                     self.config.node_ttl, worker_group.group_rank, worker_group.group_world_size,
                                     host=worker_group.spec.local_addr or socket.getfqdn(),
                                     start=round_start(worker_group, rendezvous.max_nodes),
                                     on_place_lost=self.lost_place,
                                     node=self.node, on_peer_lost=self._detectors.peer_lost if watching else None,
                                     on_lease_lost=self.lost_own_lease if under_daemon else None)
        self._meeting.export()
        for worker in worker_group.workers:
            self._meeting.worker_started(worker.global_rank, incarnation(self.node, self.rendezvous_count, 0), self.left)

    @override
    def _exit_barrier(self) -> None:
        """Wait for the other nodes to finish, not for nodes that were lost (torch's waits for all).

        A node that left the task (:meth:`leave_at_step_boundary`) does not wait: the others train on.
        """
        self._lifecycle.exit_barrier_reached()
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

    @override
    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        """Stop the workers before a restart of the group: their exits are not failures, and the stop is not final."""
        with self._lock:
            self._lifecycle.restart_begins()
        try:
            # torch's stop calls self._shutdown().
            super()._stop_workers(worker_group)
        finally:
            self._lifecycle.restart_stopped()

    @override
    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int | None = None) -> None:
        """Stop the workers; unless for a restart, stop for good first (never respawn again).

        torch calls this from ``run()`` on a signal (``death_sig`` is that
        signal) and on any error or the end of the run, and from
        :meth:`_stop_workers` before a restart of the group; torch before 2.12
        passes no ``timeout``. The workers get :attr:`shutdown_timeout` seconds
        after ``death_sig`` whatever the release (torch's own ``_shutdown`` is
        left the rest of its clean-up: its watchdog and health-check server).
        """
        if self._lifecycle.state is not AgentState.RESTARTING:
            self._close_for_good()
        pcontext, self._pcontext = self._pcontext, None
        try:
            # With no process context, torch's own shutdown stops no workers: they are the agent's to stop.
            super()._shutdown(death_sig)
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
            if self._lifecycle.close():
                log.info("agent_stopping", pending_give_up=self._remedies.give_up is not None)

    @override
    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        """Start the round's workers as torch does; from then on their exits are failures, and the detectors know them.

        Returns:
            torch's ids of the workers by local rank.
        """
        set_group_start(self.node, self.rendezvous_count)
        if self._warm_pool is not None:  # (the zygote's imports: a stop signal may still cut this wait short)
            self._warm_pool.await_ready()
        # A stop signal that arrives now is raised once torch recorded every worker, so that it stops them all.
        with stop_signals_deferred():
            ids = super()._start_workers(worker_group)
            # torch may have registered its own handlers after all, and TORCHELASTIC_SIGNALS_TO_HANDLE may
            # name SIGUSR2.
            install_stop_signals()
            install_leave_signal()
        # Only now: the exits seen before were the previous round's, and so were the rejoin requests.
        with self._lock:
            self._lifecycle.workers_started()
            self._ranks.new_round()
        self._detectors.workers_started(list(ids), incarnation(self.node, self.rendezvous_count, 0))
        return ids

    # -- DetectorContext -------------------------------------------------------
    def workers(self) -> dict[int, tuple[int, Popen]]:
        """``local_rank -> (global rank, process)`` of the running workers."""
        return self._local_workers.by_local_rank()

    def classify(self, exc_type: str, message: str, traceback: str) -> Classification:
        """Classify an exception through the plugins."""
        return classify_exception(self._pm, exc_type, message, traceback)

    def publish(self, event: ErrorEvent) -> None:
        """Record, log, store and announce one event."""
        self._publisher.publish(event)

    def report(self, event: ErrorEvent) -> None:
        """Publish ``event``; a SEV1 of this node gives the node up."""
        self._publisher.publish(event)
        if event.severity is Severity.SEV1 and event.node == self.node:
            with self._lock:
                self._remedies.act(-1, Rung(Remedy.GIVE_UP, Severity.SEV1, RankHistory(), event.kind), event)

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
            stopping = self._lifecycle.state.stopping
            finishing = stopping or self._local_workers.some_finished()
        if finishing:
            log.warning("own_lease_lost_after_work_done", node=self.node,
                        reason="agent stopping" if stopping else "a worker finished with 0")
            return
        self.report(ErrorEvent(Severity.SEV1, "lost_connection", "node", self.node, message=message))

    def worker_exited(self, local_rank: int, pid: int, exitcode: int, detected_at: float) -> None:
        """A worker process ended with a non-zero exit code: its peers are told, then the ladder decides.

        The exit of a process torch already replaced, or one seen while torch stops the workers or while a
        give-up is pending, is no new failure.
        """
        with self._lock:
            if pid in self._ranks.handled_pids:
                return
            self._ranks.handled_pids.add(pid)
            rank, current = self.workers().get(local_rank, (-1, None))
            if current is None or current.pid != pid:
                # A process torch already replaced (restart-all): not a new failure.
                return
            stopping = self._lifecycle.state.stopping
            if not stopping:
                # This comes first, as the etcd write below can take etcd's request timeout (a lost etcd
                # leader): the rank's peers may wait in a collective with it, which is not a hang.
                self._detectors.rank_failed(rank)
            if self._meeting is not None and not stopping:
                # Peers regrouping stop waiting for it now. While the agent stops, close() revokes the lease.
                self._meeting.worker_exited(rank)
            if stopping or self._remedies.give_up is not None:
                return
            self._remedies.worker_exited(rank, pid, exitcode, detected_at)

    def exception(self, rank: int, msg: dict[str, Any], classification: Classification, received: float) -> None:
        """A worker reported an exception: a fatal one is acted on when its process exits, another at once."""
        if self._lifecycle.state is AgentState.CLOSED:
            # Stopping for good: a worker's exception on the way out is no failure to act on.
            return
        with self._lock:
            rejoining = self._ranks.peek(rank).rejoining is not None
        if rejoining and msg["fatal"]:
            # The exception that left the worker out, sent after its rejoin request: no failure.
            log.debug("exception_of_rejoining_worker", rank=rank, type=msg["type"])
            return
        event = self._publisher.event(classification.severity, classification.kind, "exception", rank,
                                      f"{msg['type']}: {msg['msg']}"[:500], time.time() - (time.monotonic() - received))
        self._publisher.publish(event)
        with self._lock:
            if msg["fatal"]:
                self._ranks.state(rank).fatal = classification
                return
            self._remedies.climb(rank, event, responsive=True, step=int(msg["step"]))

    def hang(self, rank: int, finding: Finding) -> None:
        """A rank's finding: a hang or a collective timeout is acted on, a slow rank only published."""
        if self._lifecycle.state is AgentState.CLOSED or self._local_workers.process(rank) is None:
            # Stopping for good, or the worker finished or is dead already: process supervision has it.
            return
        occurred = time.time() - (time.monotonic() - finding.since)
        detector = "straggler" if finding.kind == "straggler" else "hang"
        event = self._publisher.event(finding.severity, finding.kind, detector, rank, finding.message, occurred)
        self._publisher.publish(event)
        if finding.kind in OBSERVED_ONLY:
            # Slow, not failed: reported, with nothing to retry or restart.
            return
        with self._lock:
            self._remedies.climb(rank, event, responsive=False)

    # -- restarting one rank -----------------------------------------------------
    def _respawn(self, local_rank: int) -> None:
        """Restart the worker of ``local_rank`` alone, as a new incarnation (not once torch stops the workers).

        Its liveness key (asked to leave too when the node leaves) is put before the process starts, and
        the detectors are told after.
        """
        # Every caller holds the lock already; it is re-entrant.
        with self._lock:
            if self._lifecycle.state.stopping:
                log.info("worker_restart_skipped", local_rank=local_rank, reason="agent stopping")
                return
            # On the main thread, a stop signal waits until torch knows the new process.
            with stop_signals_deferred():
                worker = self._local_workers.worker(local_rank)
                state = self._ranks.state(worker.global_rank)
                # A rejoined worker is a joiner too: a new incarnation.
                restarts = state.history.restarts + state.history.rejoins
                state.rejoining = None
                fresh = incarnation(self.node, self.rendezvous_count, restarts)
                if self._meeting is not None:
                    self._meeting.worker_started(worker.global_rank, fresh, self.left)
                env = respawn_env(self.node, self.rendezvous_count, restarts)
                started = time.monotonic()
                pid = self._local_workers.respawn(local_rank, env)
                state.reply = ""
                log.info("worker_restarted", rank=worker.global_rank, local_rank=local_rank, pid=pid,
                         seconds=round(time.monotonic() - started, 4))
                self._detectors.workers_started([local_rank], fresh)

    # -- messages and monitoring -------------------------------------------------
    def _on_message(self, msg: dict[str, Any], received: float) -> None:
        """A worker's message (on the channel's thread): rejoin requests and hellos are the agent's to record."""
        if msg["t"] == "rejoin":
            self._request_rejoin(msg)
        elif msg["t"] == "hello":
            if self._local_workers.local_rank(msg["rank"]) is None:
                # Not one of this agent's workers: no table grows with made-up ranks.
                return
            with self._lock:
                self._ranks.hello(msg["rank"], msg)
                meeting = self._meeting
            if msg.get("growable") is True and meeting is not None:
                try:
                    meeting.mark_growable()
                except StoreError as exc:
                    # A node arriving later then waits for a lost place.
                    log.warning("growable_not_recorded", rank=msg["rank"], error=str(exc)[:200])
        self._detectors.message(msg, received)

    def _request_rejoin(self, msg: dict[str, Any]) -> None:
        """Remember that the worker of ``msg["rank"]`` asked to rejoin (acted on when its process exits).

        A request from a process that is not the rank's current one (a late
        datagram of a worker already replaced, whose exit was handled) or from
        a rank that is not this agent's is dropped.
        """
        rank = msg["rank"]
        with self._lock:
            local_rank = self._local_workers.local_rank(rank)
            process = self.workers().get(local_rank, (rank, None))[1] if local_rank is not None else None
            if (process is None or process.pid in self._ranks.handled_pids
                    or ("pid" in msg and msg["pid"] != process.pid)):
                log.warning("rejoin_request_dropped", rank=rank, reason="not a current worker of this agent")
                return
            self._ranks.state(rank).rejoining = str(msg["reason"])

    @override
    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        """Handle the workers' exits and a pending give-up; hand torch's monitor only what it must see.

        Raises:
            NodeGaveUp: The ladder gave the node up.
            SignalException: A stop signal arrived, or the node cannot leave at a step boundary.
        """
        # A signal that some library code swallowed is raised now.
        raise_pending_stop()
        raise_if_orphaned()
        if leave_requested() and not self.left:
            self.leave_at_step_boundary()
        with self._lock:
            self._handle_exits()
            if self._remedies.give_up is not None:
                self._lifecycle.group_stopping()
                raise NodeGaveUp(f"node {self.node} gives up its assignment: {self._remedies.give_up.reason}")
            if self._local_workers.healthy_for_now(self._ranks.handled_pids):
                return RunResult(state=WorkerState.HEALTHY)
            result = super()._monitor_workers(worker_group)
            if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY, WorkerState.SUCCEEDED):
                # torch has just closed the whole group (SIGTERM to the rest): those exits are not failures.
                self._lifecycle.group_stopping()
            return result

    def _handle_exits(self) -> None:
        """The workers' exits not handled yet (the caller holds the lock).

        A failed worker goes to :meth:`worker_exited`, which does nothing while a give-up is pending. A
        worker that finished with 0 is no longer live for peers that regroup, and a rejoin it asked for
        is void.
        """
        for local_rank, proc in self._local_workers.processes().items():
            code = proc.poll()
            if code not in (None, 0) and proc.pid not in self._ranks.handled_pids:
                self.worker_exited(local_rank, proc.pid, code, time.time())
            elif code == 0 and proc.pid not in self._ranks.handled_pids:
                self._ranks.handled_pids.add(proc.pid)
                rank = self.workers().get(local_rank, (-1, None))[0]
                self._ranks.finished(rank)
                if self._meeting is not None and rank >= 0 and not self._lifecycle.state.stopping:
                    self._meeting.worker_exited(rank)

    def leave_at_step_boundary(self) -> None:
        """Ask this node's workers to leave the task's data-parallel group at the next step boundary.

        Each worker gets a leave request in the meeting store; the group's
        primary leaves them out of the next step's members (the global batch
        is kept by the others), they retire and exit 0, and this launcher then
        exits 0 without waiting in the exit barrier and without closing the
        rendezvous (the task goes on; a node may take the place later).
        While a worker has not said yet whether it can leave (starting, or
        restarting), nothing is done, for at most ``HELLO_GRACE_S``: the
        monitor loop asks again at its next interval (:class:`~unicron_elastic.agent.leave.NodeLeave`).

        Raises:
            SignalException: (as SIGTERM) The workers cannot leave at a step
                boundary (no meeting store, a worker that said it is not a
                ``unicron_megatron``/``ElasticDataParallel`` rank, or none said
                within ``HELLO_GRACE_S``): they are stopped instead.
        """
        with self._lock:
            ranks = self._local_workers.running_ranks()
            meeting = self._meeting
            decision = self._leave.decide(meeting is not None, ranks, self._ranks.said_hello(ranks))
        self._leave.carry_out(decision, ranks, meeting)

    @override
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
        if self._meeting is not None:
            # Revoking the lease may wait on an unreachable etcd: it is bounded too.
            bounded(self._meeting.close, "meeting", deadline)
            self._meeting = None
        self._detectors.stop(deadline)
        self._channel.close()
        shutil.rmtree(self._dir, ignore_errors=True)
        self._dir = None
