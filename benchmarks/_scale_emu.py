"""Emulated nodes for ``benchmarks/scale.py`` and ``tests/test_scale.py``: the real control plane, many nodes a process.

What runs is the project's own code: :class:`~unicron_elastic.node.daemon.NodeDaemon` (its lease, its record,
its command watch and loop), the agent's side of etcd as ``unicron-run`` drives it (the ``unicron`` rendezvous
handler with torch's dynamic rendezvous and its heartbeats, torch's rank assignment in the c10d store,
:class:`~unicron_elastic.agent.meeting_point.MeetingPoint` with one liveness key per rank, the node detector,
``num_nodes_waiting`` polled at torchrun's monitor interval), the data-parallel primary's request read each step
(:class:`~unicron_elastic.strategy.engine.requests.RequestReader`), and :class:`~unicron_elastic.coordinator.service.Coordinator`.
What is replaced: process creation (a launcher is a thread), the training (a thread that steps; only the primary of a
task touches etcd in a step, as the engine's primary does) and the snapshot server (its address is published, no
TCPStore is opened). Many emulated nodes share one process and one gRPC client per role; each watch keeps its own
client, as in production.

Every etcd request the process sends is counted by a gRPC interceptor on each client
(:func:`install_meter`): by role (daemon, agent, worker, coordinator), by kind (range, put, delete, txn,
lease grant/revoke, keep-alive, watch events) and by key family (``nodes/``, ``rdzv/``, the meeting space's
liveness keys ...), with request and response payload bytes.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import grpc

from unicron_elastic.api import EtcdConfig, StoreError
from unicron_elastic.store import _etcd3_compat

#: Methods whose requests etcd writes through raft (a proposal each, committed to every member's log).
_WRITES = {"Put", "DeleteRange", "LeaseGrant", "LeaseRevoke"}


def key_family(key: bytes) -> str:
    """The part of unicron's layout a key belongs to (``nodes``, ``rdzv``, ``meeting:live`` ...)."""
    text = key.decode(errors="replace")
    parts = text.split("/", 3)  # '', 'unicron', cluster, rest
    if len(parts) < 4 or parts[1] != "unicron":
        return "other"
    rest = parts[3]
    head = rest.split("/", 1)[0]
    if head == "meeting":
        inner = rest.split("/", 3)[3] if rest.count("/") >= 3 else ""
        if inner.startswith("unicron-dp/live"):
            return "meeting:live"
        if inner.startswith("unicron-agents"):
            return "meeting:agents"
        if inner.startswith("unicron-snapshot"):
            return "meeting:snapshot"
        return "meeting:dp"
    return head or "other"


class Meter:
    """Counts of the etcd traffic this process sends and receives, by (role, kind, family)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Start counting afresh (the window's start is now)."""
        with self._lock:
            self.calls: collections.Counter = collections.Counter()
            self.bytes: collections.Counter = collections.Counter()  # payload bytes, sent + received
            self.conflicts: collections.Counter = collections.Counter()  # CAS transactions whose comparison failed
            self.started = time.monotonic()

    def add(self, role: str, kind: str, family: str, n: int = 1, size: int = 0) -> None:
        with self._lock:
            self.calls[(role, kind, family)] += n
            self.bytes[(role, kind, family)] += size

    def conflict(self, role: str, family: str) -> None:
        with self._lock:
            self.conflicts[(role, family)] += 1

    def snapshot(self) -> dict[str, Any]:
        """The counts so far and the seconds they cover."""
        with self._lock:
            return {"seconds": time.monotonic() - self.started, "calls": dict(self.calls),
                    "bytes": dict(self.bytes), "conflicts": dict(self.conflicts)}


METER = Meter()
_ROLES: dict[int, str] = {}  # id(EtcdConfig) -> role


def role_config(config: EtcdConfig, role: str) -> EtcdConfig:
    """A copy of ``config`` whose clients count their traffic under ``role``."""
    mine = replace(config)
    _ROLES[id(mine)] = role
    return mine


def _txn_kind(request: Any) -> tuple[str, str]:
    ops = list(request.success) + list(request.failure)
    writes = any(op.WhichOneof("request") in ("request_put", "request_delete_range", "request_txn") for op in ops)
    key = b""
    if request.compare:
        key = request.compare[0].key
    else:
        for op in ops:
            inner = getattr(op, op.WhichOneof("request"))
            key = inner.key
            break
    return ("txn" if writes else "txn_read"), key_family(key)


class _Interceptor(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Counts each request and response of one client (unary calls, keep-alive and watch streams)."""

    def __init__(self, role: str) -> None:
        self.role = role

    def intercept_unary_unary(self, continuation, details, request):  # noqa: D102
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        name = method.rsplit("/", 1)[-1]
        outcome = continuation(details, request)
        try:
            response = outcome.result()
        except Exception:  # noqa: BLE001 - the caller sees the error
            response = None
        size = request.ByteSize() + (response.ByteSize() if response is not None else 0)
        if name == "Txn":
            kind, family = _txn_kind(request)
            if response is not None and request.compare and not response.succeeded:
                METER.conflict(self.role, family)
        elif name in ("Range", "Put", "DeleteRange"):
            kind, family = name.lower(), key_family(request.key)
        elif name in ("LeaseGrant", "LeaseRevoke"):
            kind, family = name.lower(), "lease"
        else:
            kind, family = name.lower(), "other"
        METER.add(self.role, kind, family, 1, size)
        return outcome

    def intercept_stream_stream(self, continuation, details, request_iterator):  # noqa: D102
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        name = method.rsplit("/", 1)[-1]
        role = self.role
        families: dict[int, str] = {}  # watch id -> family (etcd3 creates one watch per stream here)
        state = {"family": "other"}

        def requests() -> Iterator[Any]:
            for req in request_iterator:
                if name == "LeaseKeepAlive":
                    METER.add(role, "keepalive", "lease", 1, req.ByteSize())
                elif name == "Watch":
                    if req.HasField("create_request"):
                        state["family"] = key_family(req.create_request.key)
                        METER.add(role, "watch_create", state["family"], 1, req.ByteSize())
                    else:
                        METER.add(role, "watch_cancel", state["family"], 1, req.ByteSize())
                yield req

        call = continuation(details, requests())

        def responses() -> Iterator[Any]:
            for rsp in call:
                if name == "LeaseKeepAlive":
                    METER.add(role, "keepalive_reply", "lease", 1, rsp.ByteSize())
                elif name == "Watch":
                    fam = families.setdefault(rsp.watch_id, state["family"])
                    if rsp.events:
                        METER.add(role, "watch_event", fam, len(rsp.events), rsp.ByteSize())
                yield rsp

        return _Stream(call, responses())


class _Stream:
    """A stream call whose responses are counted (iteration goes through the counter, the rest to the call)."""

    def __init__(self, call: Any, it: Iterator[Any]) -> None:
        self._call, self._it = call, it

    def __iter__(self) -> _Stream:
        return self

    def __next__(self) -> Any:
        return next(self._it)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)


_original_new_client = _etcd3_compat.new_client


def _metered_client(config: EtcdConfig, member: int = 0):
    client = _original_new_client(config, member)
    interceptor = _Interceptor(_ROLES.get(id(config), "other"))
    for endpoint in client.endpoints.values():
        endpoint.channel = grpc.intercept_channel(endpoint.channel, interceptor)
    client._stubs.clear()  # (none but the auth stub yet: rebuilt on the counted channel)
    return client


def install_meter() -> None:
    """Count the traffic of every etcd client built from now on in this process (idempotent)."""
    _etcd3_compat.new_client = _metered_client


def totals(snapshot: dict[str, Any], role: str | None = None) -> dict[str, float]:
    """Calls and bytes of a :meth:`Meter.snapshot` by kind (all roles, or one)."""
    out: collections.Counter = collections.Counter()
    for (r, kind, family), n in snapshot["calls"].items():
        if role is None or r == role:
            out[kind] += n
            out[f"{kind}:bytes"] += snapshot["bytes"].get((r, kind, family), 0)
    return dict(out)


def writes_of(snapshot: dict[str, Any]) -> tuple[int, int]:
    """(requests etcd writes through raft, their payload bytes) in a :meth:`Meter.snapshot`."""
    n = size = 0
    for (role, kind, family), count in snapshot["calls"].items():
        if kind in ("txn", "put", "deleterange", "leasegrant", "leaserevoke"):
            n += count
            size += snapshot["bytes"].get((role, kind, family), 0)
    return n, size


def server_metrics(endpoints: list[str]) -> dict[str, float]:
    """Summed counters of every member's ``/metrics`` (etcd's own count of what it served)."""
    import urllib.request

    wanted = ("etcd_server_proposals_committed_total", "etcd_debugging_mvcc_events_total",
              "etcd_debugging_lease_renewed_total", "etcd_network_client_grpc_received_bytes_total",
              "etcd_network_client_grpc_sent_bytes_total", "grpc_server_msg_received_total",
              "etcd_mvcc_range_total", "etcd_mvcc_put_total", "etcd_mvcc_txn_total", "etcd_mvcc_delete_total")
    out: collections.Counter = collections.Counter()
    for endpoint in endpoints:
        text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10).read().decode()
        for line in text.splitlines():
            if line.startswith("#"):
                continue
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in wanted:
                value = float(line.rsplit(" ", 1)[1])
                if name == "grpc_server_msg_received_total":
                    method = line.split('grpc_method="', 1)[1].split('"', 1)[0]
                    out[f"msg_received:{method}"] += value
                else:
                    out[name] += value
    return dict(out)


# -- the emulated agent -------------------------------------------------------------------------------
_FAKE_PIDS = itertools.count(1 << 30)  # never a real process: a launcher here is a thread


@contextlib.contextmanager
def _handler_store(store: Any) -> Iterator[None]:
    """Make ``create_handler`` use ``store`` (one client for many emulated agents) instead of a new one."""
    from unicron_elastic.rendezvous import handler as handler_module

    original = handler_module.StatusStore
    handler_module.StatusStore = lambda config: store  # type: ignore[assignment]
    try:
        yield
    finally:
        handler_module.StatusStore = original  # type: ignore[assignment]


_CREATE = threading.Lock()


@dataclass
class Settings:
    """What every emulated node shares.

    Attributes:
        ttl: The node TTL (``--node-ttl`` and the daemon's lease), seconds.
        nproc: Workers (ranks) per node.
        monitor_interval: torchrun's ``--monitor-interval`` (the agent asks ``num_nodes_waiting`` this often).
        step_time: Seconds one training step takes.
        keep_alive_interval: The rendezvous' ``keep_alive_interval`` (torch's heartbeats), seconds.
        join_timeout: The rendezvous' join timeout, seconds.
    """

    ttl: int = 2
    nproc: int = 8
    monitor_interval: float = 0.1
    step_time: float = 1.0
    keep_alive_interval: float = 5.0
    join_timeout: float = 600.0


class EmuAgent:
    """One node's ``unicron-run`` agent as etcd sees it (a thread; see the module doc).

    Args:
        stores: The process' stores by role (``agent``, ``worker``).
        endpoint: ``--rdzv-endpoint``.
        cluster: The unicron cluster name.
        node: The node's name.
        task: The run id (the task).
        nnodes: ``(min, max)`` nodes of the run.
        settings: Shared settings.
        gate: The rendezvous gate (None: the handler's default).
        on_loss_seen: Called ``(node seen lost, this node, monotonic time)`` when this agent's watch sees a peer lost.
    """

    def __init__(self, stores: dict[str, Any], endpoint: str, cluster: str, node: str, task: str,
                 nnodes: tuple[int, int], settings: Settings, gate: Any = None,
                 on_loss_seen: Callable[[str, str, float], None] | None = None) -> None:
        self.stores, self.endpoint, self.cluster = stores, endpoint, cluster
        self.node, self.task, self.nnodes, self.settings, self.gate = node, task, nnodes, settings, gate
        self.on_loss_seen = on_loss_seen
        self.store = stores["agent"]
        self.handler = None
        self.meeting = None
        self.detectors: list[Any] = []
        self.info = None
        self.workers: list[Any] = []
        self.joined = threading.Event()
        self.failed: BaseException | None = None
        self.waiting_seen = 0  # times num_nodes_waiting said > 0 (torch's agent would restart every worker)
        self.steps = 0
        self.joined_at: float | None = None
        self.rendezvous_at: float | None = None  # torch's round complete for this node (its rank known)
        self._stop = threading.Event()
        self._killed = False
        self._thread: threading.Thread | None = None

    # DetectorContext -------------------------------------------------------------------------------------
    def report(self, event: Any) -> None:  # noqa: D102 - the agent's publish: the event goes to etcd
        try:
            self.store.append_event(event.to_json())
        except StoreError:
            pass

    def lost_own_lease(self) -> None:  # noqa: D102
        pass

    def workers_map(self) -> dict[int, tuple[int, Any]]:
        return {}

    def worker_exited(self, *args: Any) -> None:  # noqa: D102
        pass

    def _peer_lost(self, node: str, revision: int) -> None:
        """(The meeting point's watch) as the agent does: the node detector reports it; the time is noted."""
        if self.on_loss_seen is not None:
            self.on_loss_seen(node, self.node, time.monotonic())
        for detector in self.detectors:
            detector.peer_lost(node, revision)

    # life ---------------------------------------------------------------------------------------------------
    def start(self) -> EmuAgent:
        self._thread = threading.Thread(target=self._run, name=f"emu-agent-{self.node}", daemon=True)
        self._thread.start()
        return self

    def make_handler(self) -> Any:
        """The ``unicron`` handler as torchrun builds it for ``unicron-run`` (our agent's settings on it)."""
        from torch.distributed.elastic.rendezvous import RendezvousParameters

        from unicron_elastic.rendezvous.handler import create_handler

        s = self.settings
        params = RendezvousParameters(
            backend="unicron", endpoint=self.endpoint, run_id=self.task, min_nodes=self.nnodes[0],
            max_nodes=self.nnodes[1], local_addr="127.0.0.1", cluster=self.cluster, task=self.task,
            join_timeout=str(int(s.join_timeout)), keep_alive_interval=str(int(s.keep_alive_interval)),
            last_call_timeout="1")
        with _CREATE, _handler_store(self.store):
            handler = create_handler(params, gate=self.gate)
        handler.join_running_rounds(s.nproc)  # as UnicronAgent does
        return handler

    def _run(self) -> None:
        try:
            self._join()
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - recorded for the benchmark's report
            if not self._killed and not self._stop.is_set():
                self.failed = exc

    def _join(self) -> None:
        from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

        from unicron_elastic.agent.meeting_point import RoundStart
        from unicron_elastic.rendezvous.api import max_world, ranks_past_round
        from unicron_elastic.agent.detectors import NodeHealthDetector

        s = self.settings
        self.handler = handler = self.make_handler()
        self.info = info = handler.next_rendezvous()
        self.rendezvous_at = time.monotonic()
        spec = SimpleNamespace(role="default", local_world_size=s.nproc)
        joined = handler.round_joined
        if joined is not None and joined.past_round is not None:
            past = joined.past_round
            self.workers = [SimpleNamespace(local_rank=i, global_rank=r, world_size=past.world)
                            for i, r in enumerate(ranks_past_round(past.nodes, past.world, info.rank, s.nproc))]
        else:  # torch's own assignment through the c10d store (rank 0 reads every agent's role)
            self.workers = SimpleElasticAgent._assign_worker_ranks(None, info.store, info.rank, info.world_size,
                                                                   spec)
        world = self.workers[0].world_size
        start = RoundStart(info.world_size, world, s.nproc, max_world(info.world_size, world, handler.max_nodes,
                                                                      s.nproc))
        detector = NodeHealthDetector(s.ttl)
        self.detectors.append(detector)
        self.meeting = EmuMeetingPoint(self.store, handler.get_run_id(), handler.current_round(), s.ttl, info.rank,
                                       info.world_size, host=self.node, start=start, node=self.node,
                                       on_peer_lost=self._peer_lost)
        for worker in self.workers:
            self.meeting.worker_started(worker.global_rank, f"{self.node}.1.0")
        detector.start(self)
        self.joined_at = time.monotonic()
        self.joined.set()

    def _serve(self) -> None:
        """torch's monitor loop (``num_nodes_waiting`` each interval) and, on the primary, one request read a step."""
        from unicron_elastic.store.c10d import EtcdC10dStore
        from unicron_elastic.strategy.engine.requests import RequestReader

        s = self.settings
        primary = self.info.rank == 0
        reader = RequestReader(EtcdC10dStore(self.stores["worker"], self.meeting.prefix), 0) if primary else None
        next_step = time.monotonic() + s.step_time
        while not self._stop.wait(s.monitor_interval):
            if self.handler.num_nodes_waiting() > 0:
                self.waiting_seen += 1
            if time.monotonic() >= next_step:
                next_step += s.step_time
                self.steps += 1
                if reader is not None:
                    reader.count()

    def kill(self) -> None:
        """The node is lost (SIGKILL, power): nothing is cleaned up; its leases lapse within the TTL."""
        self._killed = True
        self._stop.set()
        if self.handler is not None:
            self.handler._stop_heartbeats()
        for lease in self._leases():
            lease._stop.set()
            lease.lost.set()  # (so that nothing revokes it)
        if self.meeting is not None and self.meeting._places is not None:
            self.meeting._places.cancel()

    def stop(self) -> None:
        """A clean stop (SIGTERM): the leases are revoked, the watches cancelled."""
        self._stop.set()
        if self.handler is not None:
            self.handler._stop_heartbeats()
        for detector in self.detectors:
            with contextlib.suppress(Exception):
                detector.stop()
        if self.meeting is not None:
            with contextlib.suppress(Exception):
                self.meeting.close()

    def _leases(self) -> list[Any]:
        leases = [d.lease for d in self.detectors if getattr(d, "lease", None) is not None]
        if self.meeting is not None:
            leases.append(self.meeting.lease)
        return leases

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)


def _meeting_point_class():
    from unicron_elastic.agent.meeting_point import MeetingPoint

    class _EmuMeetingPoint(MeetingPoint):
        """The agent's meeting point without its snapshot server's TCPStore (its address is published as is)."""

        def _serve_snapshots(self, host: str):  # noqa: D102
            self._snapshot_address = f"{host}:1"
            from unicron_elastic.store.keys import MeetingKeys

            self.store.put(self.prefix + MeetingKeys.snapshot_host(self.group_rank), self._snapshot_address.encode(),
                           lease=self.lease.id)
            return None

    return _EmuMeetingPoint


def EmuMeetingPoint(*args: Any, **kwargs: Any) -> Any:  # noqa: N802 - a class made on first use (torch import)
    global EmuMeetingPoint
    cls = _meeting_point_class()
    globals()["EmuMeetingPoint"] = cls
    return cls(*args, **kwargs)


# -- the emulated daemon ------------------------------------------------------------------------------
class EmuLauncher:
    """What ``subprocess.Popen`` is to the daemon, for an :class:`EmuAgent` in a thread."""

    def __init__(self, agent: EmuAgent) -> None:
        self.agent = agent
        self.pid = next(_FAKE_PIDS)
        self.returncode: int | None = None
        self._thread = threading.Thread(target=self._run, name=f"emu-launcher-{agent.node}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.agent.start()
        self.agent.join()
        self.agent._stop.wait()  # the agent serves until stopped
        self.returncode = 0 if not self.agent.failed else 1

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.agent._killed:
            return
        self.agent.stop()
        self.returncode = 128 + int(sig) if sig == signal.SIGTERM else 0

    def wait(self, timeout: float | None = None) -> int | None:
        self._thread.join(timeout)
        return self.returncode  # (never TimeoutExpired: the daemon would kill a process tree by this fake pid)


def make_daemon_class():
    from unicron_elastic.node.daemon import NodeDaemon

    class EmuDaemon(NodeDaemon):
        """:class:`NodeDaemon` whose launcher is an :class:`EmuAgent` in a thread."""

        emu: EmuCluster

        def _start(self, task: str) -> None:
            from unicron_elastic.coordinator.service import read_specs
            from unicron_elastic.rendezvous.gate import PlanGate

            spec = read_specs(self.store).get(task)
            if spec is None:
                self._next_start = time.monotonic() + 1.0
                return
            most = max(1, math.ceil(spec.max_workers / self.record.slots))
            agent = EmuAgent(self.emu.stores, self.emu.endpoint, self.emu.cluster, self.name, task,
                             (self.emu.min_nodes(task, most), most), self.emu.settings,
                             gate=PlanGate(self.emu.stores["agent"], self.name), on_loss_seen=self.emu.loss_seen)
            self.agent = agent
            self.launcher = EmuLauncher(agent)

        def kill(self) -> None:
            """The machine is gone: the daemon's lease lapses (no revoke), its agent too."""
            if getattr(self, "agent", None) is not None:
                self.agent.kill()
            if self.lease is not None:
                self.lease._stop.set()
                self.lease.lost.set()
            self.stopped.set()
            self._hurry.set()
            self._wake.set()

    return EmuDaemon


# -- the emulated cluster -----------------------------------------------------------------------------
class EmuCluster:
    """Coordinator(s), N daemons and their agents against one etcd (one member or several).

    Args:
        config: How to reach etcd (the cluster name included).
        settings: Shared node settings.
        coordinators: Coordinator processes to run (the first leads; the others stand by).
    """

    def __init__(self, config: EtcdConfig, settings: Settings, coordinators: int = 1) -> None:
        from unicron_elastic.store.client import StatusStore

        install_meter()
        # the agents' node records are the daemons' (as under `unicron node`); put back by close(), since
        # processes this process starts later (other tests' launchers) would wait for a plan to admit them
        self._daemon_env = os.environ.get("UNICRON_NODE_DAEMON")
        os.environ["UNICRON_NODE_DAEMON"] = "1"
        self.config, self.settings = config, settings
        self.cluster = config.cluster
        self.endpoint = ",".join(f"{h}:{p}" for h, p in config.members)
        self.stores = {role: StatusStore(role_config(config, role)) for role in ("daemon", "agent", "worker", "admin")}
        self.admin = self.stores["admin"]
        self.daemons: dict[str, Any] = {}
        self._threads: list[threading.Thread] = []
        self.coordinators: list[Any] = []
        self.losses: dict[str, dict[str, float]] = collections.defaultdict(dict)  # lost node -> seer -> time
        self._min_nodes: dict[str, int] = {}
        self._coordinator_count = coordinators

    # coordinators --------------------------------------------------------------------------------------
    def start_coordinators(self, ttl: int = 5) -> None:
        from unicron_elastic.coordinator.service import Coordinator
        from unicron_elastic.coordinator.vocabulary import PolicyConfig
        from unicron_elastic.store.client import StatusStore

        for i in range(self._coordinator_count):
            store = StatusStore(role_config(self.config, "coordinator"))
            c = Coordinator(store, PolicyConfig(failure_rate=1e-4), ttl=ttl, candidate=f"coordinator-{i}",
                            alert=lambda a: None)
            t = threading.Thread(target=c.run, name=f"emu-coordinator-{i}", daemon=True)
            t.start()
            self.coordinators.append(c)
            if i == 0:  # the first leads
                deadline = time.monotonic() + 30
                while c.election.token is None and time.monotonic() < deadline:
                    time.sleep(0.05)

    # tasks -----------------------------------------------------------------------------------------------
    def submit(self, name: str, nodes: int, slots: int | None = None, weight: float = 1.0) -> None:
        """Store a task that runs on 1 to ``nodes`` nodes, the more the better (it keeps the rest after a loss)."""
        slots = slots or self.settings.nproc
        workers = nodes * slots
        table = {str(k * slots): float(k) for k in range(1, nodes + 1)}
        spec = {"name": name, "command": ["true"], "weight": weight, "min_workers": slots, "max_workers": workers,
                "global_batch": workers, "model": {"calibration": table}}
        self._min_nodes[name] = nodes
        self.admin.put(self.admin.keys.task_spec(name), json.dumps(spec))

    def min_nodes(self, task: str, most: int) -> int:
        """The run's ``--nnodes`` minimum: the nodes the plan gave the task, so its first round forms with all of them.

        The plan, not the size asked for: a coordinator that had not yet seen every node places the task on fewer.
        """
        from unicron_elastic.coordinator.service import read_plan

        plan = read_plan(self.admin)
        placed = plan.tasks.get(task) if plan is not None else None
        if placed is not None and placed.nodes:
            return min(len(placed.nodes), most)
        return min(self._min_nodes.get(task, 1), most)

    # daemons ---------------------------------------------------------------------------------------------
    def start_daemons(self, n: int, first: int = 0) -> list[str]:
        cls = make_daemon_class()
        names = []
        for i in range(first, first + n):
            name = f"n{i:05d}"
            daemon = cls(self.stores["daemon"], name, self.settings.nproc, ttl=self.settings.ttl, stop_timeout=5.0,
                         leave_timeout=5.0)
            daemon.emu = self
            t = threading.Thread(target=daemon.run, name=f"emu-daemon-{name}", daemon=True)
            t.start()
            self.daemons[name] = daemon
            self._threads.append(t)
            names.append(name)
        return names

    def wait_registered(self, count: int, timeout: float) -> None:
        """Wait until ``count`` node records are in etcd and, with a coordinator, its plan counts them all.

        Then one plan places a task on all of them (a task submitted earlier may be placed on the nodes seen so far).

        Raises:
            TimeoutError: Not within ``timeout`` seconds.
        """
        from unicron_elastic.coordinator.service import read_plan

        deadline = time.monotonic() + timeout
        while self.admin.count_prefix(self.admin.keys.nodes()) < count or (
                self.coordinators and len(getattr(read_plan(self.admin), "nodes", ())) < count):
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {count} nodes registered (and planned for) within {timeout}s")
            time.sleep(0.1)

    def agents(self) -> dict[str, EmuAgent]:
        return {n: d.agent for n, d in self.daemons.items() if getattr(d, "agent", None) is not None}

    def wait_joined(self, names: list[str], timeout: float) -> float:
        """Seconds until every named node's agent joined its round (raises on a timeout or an agent's failure)."""
        started = time.monotonic()
        deadline = started + timeout
        while True:
            agents = self.agents()
            failed = [a.failed for n, a in agents.items() if n in names and a.failed is not None]
            if failed:
                raise RuntimeError(f"an agent failed: {failed[0]!r}") from failed[0]
            done = [n for n in names if n in agents and agents[n].joined.is_set()]
            if len(done) == len(names):
                return time.monotonic() - started
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(done)} of {len(names)} agents joined within {timeout}s")
            time.sleep(0.1)

    def leases(self) -> list[Any]:
        """Every lease the emulated nodes keep (daemons' and agents')."""
        out = [d.lease for d in self.daemons.values() if d.lease is not None]
        for agent in self.agents().values():
            out.extend(agent._leases())
        return out

    def wait_count_joined(self, count: int, timeout: float) -> None:
        """Wait until ``count`` agents joined their rounds (raises on a timeout or an agent's failure)."""
        deadline = time.monotonic() + timeout
        while True:
            agents = list(self.agents().values())
            failed = [a.failed for a in agents if a.failed is not None]
            if failed:
                raise RuntimeError(f"an agent failed: {failed[0]!r}") from failed[0]
            joined = sum(1 for a in agents if a.joined.is_set())
            if joined >= count:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{joined} of {count} agents joined within {timeout}s")
            time.sleep(0.1)

    def loss_seen(self, lost: str, seer: str, when: float) -> None:
        self.losses[lost].setdefault(seer, when)

    def kill(self, name: str) -> None:
        self.daemons[name].kill()

    def close(self) -> None:
        for c in self.coordinators:
            c.stop()
        for d in self.daemons.values():
            if getattr(d, "agent", None) is not None and not d.agent._killed:
                d.agent._stop.set()
                d.agent.stop()
            d.stop()
        for t in self._threads:
            t.join(10)
        for store in self.stores.values():
            with contextlib.suppress(Exception):
                store.close()
        if self._daemon_env is None:
            os.environ.pop("UNICRON_NODE_DAEMON", None)
        else:
            os.environ["UNICRON_NODE_DAEMON"] = self._daemon_env


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values``, nearest rank."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
