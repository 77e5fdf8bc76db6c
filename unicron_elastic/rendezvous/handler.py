"""The ``unicron`` rendezvous handler that torchrun loads through ``torchrun.handlers``."""

from __future__ import annotations

import time

import structlog
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousInfo,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
    _RendezvousExitOp,
)
from typing_extensions import override

from unicron_elastic.rendezvous.api import RoundJoined
from unicron_elastic.rendezvous.backend import UnicronRendezvousBackend
from unicron_elastic.rendezvous.gate import JoinGate, JoinRequest, OpenGate, PlanGate
from unicron_elastic.rendezvous import fold, quiet
from unicron_elastic.rendezvous.options import BackendOptions, parse_options
from unicron_elastic.rendezvous.rounds import RunRounds, initial_round, raise_places
from unicron_elastic.api import StoreError
from unicron_elastic.store.c10d import EtcdC10dStore
from unicron_elastic.store.client import StatusStore

log = structlog.get_logger(__name__)
#: How long what would make every node restart (no live agent in the running round; the plan wants the run
#: larger than its live places) must hold before a node acts on it: a lease can lapse on an overloaded host and
#: be renewed (:class:`~unicron_elastic.store.lease.KeptLease`), and its keys are gone meanwhile.
SETTLE_S = 5.0


class RunFinished(RendezvousGracefulExitError):
    """The run's rendezvous is closed because its training finished: a node of its newest round
    passed the exit barrier (its workers succeeded). A node arriving now has nothing to join; torch's
    agent returns without a result and ``unicron-run`` exits 0. Raised only under ``unicron-run``
    (:meth:`UnicronRendezvousHandler.join_running_rounds`): plain ``torchrun`` gets torch's ``RendezvousClosedError``."""


class UnicronRendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous, gated by the coordinator's plan.

    Built by :func:`create_handler`; ``gate`` and ``task`` are set there. Its seam with the agent is
    :class:`~unicron_elastic.rendezvous.api.UnicronRendezvous`.
    """

    gate: JoinGate = OpenGate()
    task: str = ""
    status_store: StatusStore | None = None
    #: The run's etcd backend (for :func:`~unicron_elastic.rendezvous.quiet.stamp_live`).
    backend: UnicronRendezvousBackend | None = None
    #: Set by :meth:`join_running_rounds` (``unicron-run``'s agent): a node that arrives while the round runs
    #: takes the place of a lost node instead of making every node restart (torch's ``num_nodes_waiting``).
    rejoin: bool = False
    #: Workers this node runs (``--nproc-per-node``; set by :meth:`join_running_rounds`).
    local_world_size: int = 1
    _round_joined: RoundJoined | None = None  # what the last rendezvous hands the agent (:attr:`round_joined`)
    _joined_before: bool = False
    #: This node's round runs: no torch heartbeats, no reads of torch's state (:mod:`~unicron_elastic.rendezvous.quiet`).
    _quiet: bool = False
    _resumed: bool = False  # torch's heartbeats run again while a node announces it enters the rendezvous
    _announced: int = 0  # announcements seen at the last look
    _look_at: float = 0.0  # monotonic time of the next look at the announcements
    _checked: int | None = None  # the revision of torch's state a quiet look last decoded
    _moved_on: bool = False  # torch's state is past this node's round: it must enter the next one

    @override
    def next_rendezvous(self) -> RendezvousInfo:
        """Wait for the plan to admit this node, then join the running round (rejoin) or the next one."""
        self._round_joined = None
        if self.rejoin and not self._joined_before:  # a restart-all of this node is no rejoin
            info = self._rejoin_running_round()
            self._joined_before = True
            if info is not None:
                return info
        request = JoinRequest(
            run_id=self.get_run_id(),
            task=self.task,
            node=str(self._this_node),
            round=getattr(self._state_holder.state, "round", -1),
        )
        self.gate.admit(request)
        self._forget_agent_store()
        announcement = self._announce()
        try:
            info = super().next_rendezvous()
        except RendezvousClosedError:
            # (only under unicron-run: torch's own launcher takes an agent's graceful exit for a result)
            if self.rejoin and self.status_store is not None and self._rounds().finished():
                log.info("rendezvous_run_finished", run_id=request.run_id, task=self.task)
                raise RunFinished(f"run {request.run_id!r} finished before this node joined") from None
            raise
        finally:
            if announcement is not None:
                announcement.close()
        self._round_joined = RoundJoined(self._state_holder.state.round)
        log.info(
            "rendezvous_joined",
            run_id=request.run_id,
            task=self.task,
            round=self._state_holder.state.round,
            rank=info.rank,
            nodes=info.world_size,
        )
        return info

    # -- a running round costs etcd nothing per node and second (rendezvous/quiet.py) -----------------------
    def _announce(self) -> fold.Joining | None:
        """Before torch's rendezvous: leave the last round, then announce this node as joining the next one.

        Under ``unicron-run``, when torch's state holds a complete round, its quiet participants' heartbeats are
        stamped from their place keys first, and the announcement also tells them to heartbeat until this node
        joined. torch's exit from the last round (this node removes itself from its participants) runs here,
        before the announcement, and not again in torch's ``next_rendezvous``: a write that folded this node into
        the next round meanwhile must not be undone by it (:class:`_LeftAlready`).

        Returns:
            The announcement to withdraw once this node joined (None: no status store).

        Raises:
            RendezvousConnectionError: etcd stayed unreachable.
            RendezvousTimeoutError: This node could not leave the last round within the join timeout.
        """
        if self.status_store is None or self.backend is None:
            return None
        try:
            running = self.rejoin and quiet.stamp_live(self.backend, self.status_store, self.get_run_id()) is not None
            self._stop_heartbeats()
            executor = self._op_executor
            if not isinstance(executor, _LeftAlready):
                executor = self._op_executor = _LeftAlready(executor)
            executor.leave(self._get_deadline(self._settings.timeout.join))
            ttl = max(2, int(self._settings.keep_alive_interval.total_seconds()))
            return fold.Joining(self.status_store, self.get_run_id(), self._this_node, ttl, waiting=running)
        except StoreError as exc:
            raise RendezvousConnectionError(f"the connection to etcd has failed: {exc}") from exc

    @override
    def _start_heartbeats(self) -> None:
        """torch's heartbeats once a round formed; under ``unicron-run`` none: the round runs quiet."""
        if not self.rejoin:
            super()._start_heartbeats()
            return
        self._quiet, self._resumed, self._announced, self._look_at, self._checked = True, False, 0, 0.0, None
        self._moved_on = False

    @override
    def _stop_heartbeats(self) -> None:
        """Stop torch's heartbeats (this node enters the rendezvous, or shuts it down): not quiet any more."""
        self._quiet = False
        self._resumed = False
        super()._stop_heartbeats()

    @override
    def num_nodes_waiting(self) -> int:
        """torch's count of nodes waiting for the next round; while quiet, 0 unless a node announced itself.

        A quiet node looks at the announcements every ``keep_alive_interval``; while there is one it sends
        torch's heartbeats again and answers from torch's state. Each look also checks torch's state when it
        was written since the last look, in the same request (:func:`~unicron_elastic.rendezvous.quiet.look`):
        when torch's round is past this node's (its round ended without it: a node that joined the running
        round is no participant of torch's, and the others may have gone on to the next round while its look
        came too late to see them waiting), it answers at least 1, so that it enters the next round too.

        Raises:
            RendezvousConnectionError: etcd stayed unreachable.
            RendezvousStateError: torch's state in etcd is corrupt.
        """
        if not self._quiet:
            return super().num_nodes_waiting()
        now = time.monotonic()
        if now >= self._look_at:
            self._look_at = now + self._settings.keep_alive_interval.total_seconds()
            try:
                if self.backend is None:  # (a handler not made by create_handler: no state to check)
                    self._announced = quiet.announced(self.status_store, self.get_run_id())  # type: ignore[arg-type]
                else:
                    store: StatusStore = self.status_store  # type: ignore[assignment]
                    found = quiet.look(self.backend, store, self.get_run_id(), self._checked)
                    self._checked, self._announced = found.checked, found.waiting
                    self._note_round(found.round)
            except StoreError as exc:
                raise RendezvousConnectionError(f"the connection to etcd has failed: {exc}") from exc
            if self._announced and not self._resumed:
                log.info("rendezvous_heartbeats_resumed", run_id=self.get_run_id(), announced=self._announced)
                self._resumed = True
                super()._start_heartbeats()
            elif not self._announced and self._resumed:
                self._resumed = False
                super()._stop_heartbeats()
        waiting = super().num_nodes_waiting() if self._announced else 0
        if self._announced:
            self._note_round(self._state_holder.state.round)  # (synced by torch's count)
        return max(waiting, 1) if self._moved_on else waiting

    def _note_round(self, state_round: int | None) -> None:
        """Whether torch's state is past the round this node runs in (then it must enter the next one)."""
        joined = self._round_joined
        if state_round is None or joined is None or state_round == joined.round or self._moved_on:
            return
        self._moved_on = True
        log.warning("rendezvous_round_moved_on", run_id=self.get_run_id(), round=joined.round, now=state_round)

    def _rejoin_running_round(self) -> RendezvousInfo | None:
        """Join the running round: take a lost node's place, or grow the round by one place.

        A round runs while the agent of one of its nodes is alive in the
        round's meeting space (torch's own rendezvous state is not asked: its
        heartbeat bookkeeping may already have dropped every participant). A
        place is free when its node started workers and its agent key vanished
        (lease lapsed) before it finished. Claimed create-only, so two arriving
        nodes never take the same place. When no place is free and the gate
        wants the run larger (without a coordinator: up to ``--nnodes``' max),
        the node adds a place past the round's, if the round's workers said
        they admit such joiners (``hello(growable=True)``): nobody restarts.

        A round none of whose agents is alive, but whose places did not all
        finish, may have lost every node, or its agents' leases lapsed on an
        overloaded host and are about to be renewed: that, like the plan's
        wish to grow the run by a restart-all, must hold for :data:`SETTLE_S`
        before this node gives the round up (every node would restart). A
        place taken while its node's lease had lapsed is lost to that node
        (its renewal is create-only: :meth:`MeetingPoint._rekey
        <unicron_elastic.agent.meeting_point.MeetingPoint._rekey>`).

        Returns:
            The rendezvous of the running round as that place's rank, or None
            when no round runs or the run must grow by torch's restart-all
            (workers that cannot admit joiners past their world, under a plan).

        Raises:
            RendezvousTimeoutError: A round runs, but no place was free within the join timeout.
        """
        deadline = time.monotonic() + self._settings.timeout.join.total_seconds()
        restart_since: float | None = None  # since when what would restart every node held
        rounds, claim = self._rounds(), str(self._this_node)  # (a claim's value: torch's node, not an owner)
        while True:
            running = rounds.running()
            if running is None:
                return None
            round_, prefix, nodes, alive = running.round, running.prefix, running.nodes, running.alive
            if not alive:  # every agent gone: lost, or between a lapsed lease and its renewal
                restart_since = restart_since or time.monotonic()
                if time.monotonic() - restart_since >= SETTLE_S:
                    log.info("rendezvous_round_gone", run_id=self.get_run_id(), round=round_, nodes=nodes)
                    return None
                time.sleep(0.1)
                continue
            for g in range(nodes):
                if g not in alive and rounds.place_free(prefix, g) and rounds.fits(prefix, g, self.local_world_size) \
                        and rounds.claim(prefix, g, claim):
                    return self._running_round_info(rounds, round_, prefix, g, nodes)
            request = JoinRequest(self.get_run_id(), self.task, str(self._this_node), round_)
            if nodes < self._settings.max_nodes and self.gate.grow(request, len(alive)):
                growable = rounds.growable(prefix, nodes, self.local_world_size)
                if growable:
                    if rounds.claim(prefix, nodes, claim):
                        raise_places(rounds.store, prefix, nodes + 1)
                        log.info("rendezvous_grown", run_id=self.get_run_id(), round=round_, place=nodes)
                        return self._running_round_info(rounds, round_, prefix, nodes, nodes + 1)
                    time.sleep(0.05)
                    continue  # another node took that place first: look again
                if growable is not None and self.gate.restarts_to_grow:
                    restart_since = restart_since or time.monotonic()
                    if time.monotonic() - restart_since >= SETTLE_S:
                        log.warning("rendezvous_grows", run_id=self.get_run_id(), round=round_, nodes=nodes,
                                    reason="the round's workers do not admit joiners past their world")
                        return None  # the plan wants the run larger: join the next round (torch's restart-all)
                    time.sleep(0.1)
                    continue
            restart_since = None
            if time.monotonic() >= deadline:
                raise RendezvousTimeoutError(f"round {round_} of {self.get_run_id()!r} runs with every place "
                                             f"taken; no lost node's place freed within the join timeout")
            time.sleep(0.1)

    def _rounds(self) -> RunRounds:
        """The run's rounds as their meeting spaces record them (``unicron-run`` only: it sets :attr:`status_store`)."""
        assert self.status_store is not None
        return RunRounds(self.status_store, self.get_run_id())

    def _running_round_info(self, rounds: RunRounds, round_: int, prefix: str, group_rank: int,
                            nodes: int) -> RendezvousInfo:
        """The rendezvous of place ``group_rank`` of the running round (``nodes`` places now).

        A place of the round torch formed gets that round's node count (torch's
        rank assignment reads every one of its nodes' role keys); a place past
        it counts up to itself.
        """
        store = dist.PrefixStore(f"torch.rendezvous.{self.get_run_id()}.{round_}", self._store)  # torch's layout
        start = initial_round(rounds.store, prefix)
        past = start if start is not None and group_rank >= start.nodes else None
        world = nodes if start is None else (group_rank + 1 if past else start.nodes)
        addr = store.get(RendezvousStoreInfo.MASTER_ADDR_KEY).decode()
        port = int(store.get(RendezvousStoreInfo.MASTER_PORT_KEY).decode())
        self._round_joined = RoundJoined(round_, running=True, past_round=past)
        self._start_heartbeats()  # (quiet: this node is no participant of torch's round)
        log.warning("rendezvous_rejoined", run_id=self.get_run_id(), round=round_, rank=group_rank, nodes=nodes)
        return RendezvousInfo(store, group_rank, world, RendezvousStoreInfo(addr, port))

    # -- the seam with the agent (rendezvous/api.py's UnicronRendezvous) ------------------------------------
    def join_running_rounds(self, local_world_size: int) -> None:
        """From now on, join a round of the run that is running instead of making every node restart.

        ``unicron-run``'s agent calls it: a node arriving while a round runs takes a lost node's place,
        or adds one with ``local_world_size`` workers (:meth:`_rejoin_running_round`); the round runs
        quiet (:mod:`~unicron_elastic.rendezvous.quiet`), and a node arriving after the run finished gets
        :class:`RunFinished`.

        Raises:
            ValueError: ``local_world_size`` < 1.
        """
        if local_world_size < 1:
            raise ValueError(f"local_world_size must be >= 1, got {local_world_size}")
        self.rejoin = True
        self.local_world_size = local_world_size

    @property
    def round_joined(self) -> RoundJoined | None:
        """What this node's last rendezvous handed over (None before the first completed)."""
        return self._round_joined

    @property
    def max_nodes(self) -> int:
        """The most nodes the run may have (``--nnodes``' max)."""
        return int(self._settings.max_nodes)

    def current_round(self) -> int:
        """The rendezvous round this node last joined (-1 before the first)."""
        joined = self._round_joined
        if joined is not None and joined.running:
            return joined.round
        return int(getattr(self._state_holder.state, "round", -1))

    def _forget_agent_store(self) -> None:
        """Make the next round start a fresh agent TCPStore (pytorch/pytorch#135712).

        Workers assume "a new TCPStore for every retry" (torch's
        ``_create_c10d_store``) and add no per-round prefix, but torch 2.13's
        handler keeps the rank-0 node's TCPStore server across rounds; workers
        of round N+1 then read round N's gloo addresses and fail to connect.
        Dropping the cached server makes rank 0 of every round bind a new one
        and publish its port through the (per-round) etcd store.
        ``tests/test_rendezvous.py`` pins these private attributes.
        """
        self._shared_tcp_store_server = None
        self._bootstrap_store_info = None


class _LeftAlready:
    """torch's rendezvous op executor, except for the exit op that follows :meth:`leave` (skipped once).

    torch's ``next_rendezvous`` runs the exit op (leave the last round) then the join op. With the fold
    (:mod:`~unicron_elastic.rendezvous.fold`), the handler leaves before it announces itself; by the time torch's
    exit op runs, another node may already have folded this one into the next round, and torch's exit would
    remove it again.

    Args:
        inner: torch's executor.
    """

    def __init__(self, inner) -> None:
        self.inner = inner
        self._left = False

    def leave(self, deadline: float) -> None:
        """Run torch's exit op now; torch's next one is skipped."""
        self.inner.run(_RendezvousExitOp(), deadline)
        self._left = True

    def run(self, state_handler, deadline: float, update_deadline=None) -> None:
        """See torch's ``_RendezvousOpExecutor.run``."""
        if self._left and isinstance(state_handler, _RendezvousExitOp):
            self._left = False
            return
        self._left = False
        self.inner.run(state_handler, deadline, update_deadline)


def _default_gate(store: StatusStore, options: BackendOptions) -> JoinGate:
    """:class:`PlanGate` under a node daemon (``$UNICRON_NODE_DAEMON`` names the node), else :class:`OpenGate`."""
    from unicron_elastic.env import node_daemon

    node = node_daemon()
    if not node:
        return OpenGate()
    timeout = options.join_timeout.total_seconds() if options.join_timeout is not None else 600.0
    return PlanGate(store, node, timeout=timeout)


def create_handler(params: RendezvousParameters, gate: JoinGate | None = None) -> UnicronRendezvousHandler:
    """Build the handler from torchrun's rendezvous parameters.

    Args:
        params: ``--rdzv-endpoint`` (etcd), ``--rdzv-id``, ``--nnodes`` and
            ``--rdzv-conf`` as torchrun parsed them.
        gate: Join gate; default: :class:`PlanGate` under a node daemon, else admits everyone.

    Returns:
        The handler.

    Raises:
        ConfigError: A ``--rdzv-conf`` key or value is invalid (a ValueError).
    """
    options: BackendOptions = parse_options(params.endpoint, params.run_id, params.config)
    store = StatusStore(options.etcd)
    backend = UnicronRendezvousBackend(store, params.run_id)
    c10d = EtcdC10dStore(store, store.keys.c10d(params.run_id), timeout=options.store_timeout)
    timeout = RendezvousTimeout(
        options.join_timeout, options.last_call_timeout, options.close_timeout, options.heartbeat_timeout
    )
    handler = UnicronRendezvousHandler.from_backend(
        params.run_id,
        c10d,
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        timeout,
        keep_alive_interval=options.keep_alive_interval,
        keep_alive_max_attempt=options.keep_alive_max_attempt,
    )
    handler.gate = gate or _default_gate(store, options)
    handler.task = options.task
    handler.status_store = store
    handler.backend = backend
    backend.fold = fold.Folder(store, params.run_id, handler._settings, handler._this_node)
    return handler

