"""The built-in detectors (paper Table 1): node health, process supervision,
exception propagation, hang verdicts from progress, stragglers, and NVML hardware checks.

A detector watches one thing and tells its :class:`~unicron_elastic.agent.api.DetectorContext` (the agent)
what it saw; the agent turns that into an event and an action. Detectors are
provided through the ``unicron_detectors`` hook; these are the default plugin's.
"""

from __future__ import annotations

import os
import select
import threading
import time
from subprocess import Popen
from typing import Any

import structlog
from prometheus_client import Gauge

from unicron_elastic.agent.api import AgentConfig, Detector, DetectorContext
from unicron_elastic.api import StoreError
from unicron_elastic.detection.hang import Finding, HangThresholds, IterationMonitor, hang_verdict
from unicron_elastic.detection.straggler import StragglerThresholds, StragglerWatch
from unicron_elastic.events import ErrorEvent, Severity
from unicron_elastic.plugins import hookimpl
from unicron_elastic.env import node_daemon
from unicron_elastic.store.lease import KeptLease

log = structlog.get_logger(__name__)
STRAGGLER_RATIO = Gauge("unicron_straggler_ratio",
                        "A rank's median busy time per step over its node peers' median (the straggler detector)",
                        ["rank"])


def _own_rank(ctx: DetectorContext, rank: int) -> bool:
    """Whether ``rank`` is the global rank of one of this agent's running workers."""
    return any(own == rank for own, _ in ctx.workers().values())


def _note_dropped(detector: Detector, msg: dict[str, Any]) -> None:
    """Count a message from a rank that is not this agent's; log the 1st, 10th, 100th ..."""
    detector.dropped += 1
    if str(detector.dropped).rstrip("0") == "1":
        log.warning("worker_message_from_unknown_rank", detector=detector.name, rank=msg["rank"],
                    message_type=msg["t"], dropped=detector.dropped)


class ProcessDetector(Detector):
    """Process supervision: one thread woken by the exit of any local worker.

    On Linux (5.3+) the thread blocks on every worker's pidfd: an exit wakes it
    at once and a healthy run costs no CPU. Where pidfds are unavailable it
    polls the workers every ``interval`` s instead.
    """

    name = "process"

    def __init__(self, interval: float = 0.01) -> None:
        self.interval = interval
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._thread: threading.Thread | None = None
        self._reported: set[int] = set()
        self.pidfds = hasattr(os, "pidfd_open")  # False where the platform has none (then: polling)

    def on_workers_started(self, local_ranks: list[int], incarnation: str) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, daemon=True, name="unicron-supervise")
            self._thread.start()
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"w")
        except OSError:  # closed by stop(): nothing to wake
            pass

    def _watch(self) -> None:
        poller, opened = select.poll(), {}  # pid -> pidfd
        poller.register(self._wake_r, select.POLLIN)
        try:
            while not self._stop.is_set():
                try:
                    workers = self.ctx.workers()
                    self._check(workers)
                    self._follow(poller, opened, {p.pid for _, p in workers.values() if p.returncode is None})
                except Exception:  # noqa: BLE001 - one bad pass must not end supervision
                    log.exception("process_detector_pass_failed")
                    self._stop.wait(self.interval)
                    continue
                for fd, _ in poller.poll(None if self.pidfds else self.interval * 1000):
                    if fd == self._wake_r:
                        os.read(self._wake_r, 4096)
        finally:
            for fd in opened.values():
                os.close(fd)

    def _follow(self, poller: select.poll, opened: dict[int, int], running: set[int]) -> None:
        """Watch the pidfds of ``running`` (opened as needed), close the others."""
        if not self.pidfds:
            return
        for pid in set(opened) - running:
            poller.unregister(opened[pid])
            os.close(opened.pop(pid))
        for pid in running - set(opened):
            try:
                opened[pid] = os.pidfd_open(pid)
            except ProcessLookupError:  # reaped already: _check saw (or the next pass sees) its code
                self._wake()
                continue
            except OSError as exc:  # e.g. a kernel without pidfds: poll instead
                log.warning("pidfd_unavailable_polling", error=str(exc), interval=self.interval)
                self.pidfds = False
                return
            poller.register(opened[pid], select.POLLIN)

    def _check(self, workers: dict[int, tuple[int, Popen]]) -> None:
        """Report every worker that ended with a non-zero code (once per process)."""
        for local_rank, (_, proc) in workers.items():
            code = proc.poll()
            if code is not None and code != 0 and proc.pid not in self._reported:
                self._reported.add(proc.pid)
                self.ctx.worker_exited(local_rank, proc.pid, code, time.time())

    def stop(self) -> None:
        self._stop.set()
        self._wake()


class ExceptionDetector(Detector):
    """Exception propagation: classify what workers report (severity table + plugins).

    Reports that name a rank which is not one of this agent's workers are
    dropped (counted in ``dropped``).
    """

    name = "exception"

    def on_message(self, msg: dict[str, Any], received: float) -> None:
        if msg["t"] != "exc":
            return
        if not _own_rank(self.ctx, msg["rank"]):
            _note_dropped(self, msg)
            return
        classification = self.ctx.classify(str(msg["type"]), str(msg["msg"]), str(msg.get("tb", "")))
        self.ctx.exception(msg["rank"], msg, classification, received)


class HangDetector(Detector):
    """Hang verdicts from progress, one monitor per rank (:mod:`~unicron_elastic.detection.hang`).

    Heartbeats, ``progress`` messages (progress within a step) and ``waiting``
    reports are signs of life. A rank that reports it is waiting on its group
    (and keeps reporting it) is spared up to the longest wait; the one that
    went silent is hung (:func:`~unicron_elastic.detection.hang.hang_verdict`).
    Only this agent's workers get a monitor: messages from any other rank are
    dropped (counted in ``dropped``), and monitors of ranks no longer running
    here are removed when workers start, so the table stays bounded.
    """

    name = "hang"

    def __init__(self, thresholds: HangThresholds | None = None, interval: float = 1.0) -> None:
        self.thresholds = thresholds or HangThresholds()
        self.interval = interval  # the longest sleep between checks (the thread wakes at the next deadline)
        self.monitors: dict[int, IterationMonitor] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._changed = threading.Event()  # a deadline moved earlier (or a worker appeared): recompute the sleep
        self._thread: threading.Thread | None = None

    def start(self, ctx: DetectorContext) -> None:
        super().start(ctx)
        self._thread = threading.Thread(target=self._run, daemon=True, name="unicron-hang")
        self._thread.start()

    def on_workers_started(self, local_ranks: list[int], incarnation: str) -> None:
        ranks = {lr: rank for lr, (rank, _) in self.ctx.workers().items()}
        now = time.monotonic()
        with self._lock:
            for gone in set(self.monitors) - set(ranks.values()):
                del self.monitors[gone]
            for local_rank in local_ranks:
                rank = ranks.get(local_rank)
                if rank is not None:
                    self.monitors.setdefault(rank, IterationMonitor(self.thresholds)).reset(incarnation, now)
        self._changed.set()

    def on_message(self, msg: dict[str, Any], received: float) -> None:
        if msg["t"] not in ("beat", "state", "progress"):
            return
        if msg["rank"] not in self.monitors and not _own_rank(self.ctx, msg["rank"]):
            _note_dropped(self, msg)
            return
        with self._lock:
            monitor = self.monitors.setdefault(msg["rank"], IterationMonitor(self.thresholds))
            before = monitor.deadline()
            finding = None
            if msg["t"] == "beat":
                finding = monitor.heartbeat(received, float(msg["dur"]))
            elif msg["t"] == "progress":
                monitor.sign(received)
            else:
                monitor.set_state(received, paused=msg.get("paused"), in_collective=msg.get("collective"),
                                  pause_for=msg.get("pause_for"), waiting=msg.get("waiting"))
            self._note_deadline(before, monitor.deadline())
        if finding is not None:
            self.ctx.hang(msg["rank"], finding)

    def on_rank_failed(self, rank: int, now: float) -> None:
        """Give every other worker the peer-failure grace (see :meth:`IterationMonitor.peer_failed`)."""
        with self._lock:
            for other, monitor in self.monitors.items():
                if other != rank:
                    monitor.peer_failed(now)

    def _note_deadline(self, before: float | None, after: float | None) -> None:
        """Wake the thread when a worker's deadline came earlier (heartbeats only push it later)."""
        if after is not None and (before is None or after < before):
            self._changed.set()

    def _run(self) -> None:
        """Check every monitor, then sleep until the earliest deadline (or ``interval``, or a change)."""
        while not self._stop.is_set():
            self._changed.clear()
            now = time.monotonic()
            with self._lock:
                reports = {rank: m.report(rank) for rank, m in self.monitors.items()}
                verdict = hang_verdict(reports, now)
                found = [(rank, self.monitors[rank].finding(now)) for rank in verdict.hung]
                deadlines = [d for d in (m.deadline() for m in self.monitors.values()) if d is not None]
            if found:  # who was blamed, and who was spared because it kept saying it waits on its group
                log.info("hang_verdict", hung=list(verdict.hung), spared_waiting=list(verdict.waiting))
            for rank, finding in found:
                self.ctx.hang(rank, finding)
            sleep = self.interval if not deadlines else min(self.interval, max(min(deadlines) - now, 0.0) + 0.001)
            self._changed.wait(sleep)

    def stop(self) -> None:
        self._stop.set()
        self._changed.set()


class StragglerDetector(Detector):
    """Stragglers: a rank whose steps keep it persistently busier than its node peers (:mod:`~unicron_elastic.detection.straggler`).

    Each heartbeat that carries ``busy`` (the step's seconds not spent waiting
    on the group) feeds the watch; a rank found slow is reported once per
    episode as a SEV3 ``straggler`` finding, which the agent publishes and
    never acts on; every rank's ratio to its peers goes to the
    ``unicron_straggler_ratio`` metric. An agent compares its own node's ranks.
    """

    name = "straggler"

    def __init__(self, thresholds: StragglerThresholds | None = None) -> None:
        self.watch = StragglerWatch(thresholds)
        self._lock = threading.Lock()

    def on_workers_started(self, local_ranks: list[int], incarnation: str) -> None:
        ranks = {lr: rank for lr, (rank, _) in self.ctx.workers().items()}
        with self._lock:
            for local_rank in local_ranks:  # a new process: its record starts afresh
                if local_rank in ranks:
                    self.watch.forget(ranks[local_rank])

    def on_message(self, msg: dict[str, Any], received: float) -> None:
        if msg["t"] != "beat" or "busy" not in msg:
            return
        if not _own_rank(self.ctx, msg["rank"]):
            _note_dropped(self, msg)
            return
        with self._lock:
            found = self.watch.record(msg["rank"], float(msg["busy"]))
            ratios = self.watch.ratios()
        for rank, ratio in ratios.items():
            STRAGGLER_RATIO.labels(rank=str(rank)).set(ratio)
        for straggler in found:
            log.warning("straggler", rank=straggler.rank, busy_s=round(straggler.busy, 4),
                        peers_s=round(straggler.peers, 4), ratio=round(straggler.ratio, 2))
            self.ctx.hang(straggler.rank, Finding(Severity.SEV3, "straggler", straggler.message, received))


class NodeHealthDetector(Detector):
    """Node health: this node's lease in etcd, and the places of the other nodes of its run.

    Without a node daemon the agent keeps this node's record (``nodes/<node>``) on a lease of this
    detector's. Under one, the daemon's record is the node's and the agent's liveness is its meeting
    point's lease (lost: :meth:`UnicronAgent.lost_own_lease
    <unicron_elastic.agent.agent.UnicronAgent.lost_own_lease>`): no lease here. Peers lost are
    told by the agent's meeting point, which watches the places of this node's round only
    (:class:`~unicron_elastic.agent.meeting_point.PlacesWatch`): a loss reaches the run's nodes, not every
    node of the cluster.
    """

    name = "node"

    def __init__(self, ttl: int = 2) -> None:
        self.ttl = ttl
        self.lease: KeptLease | None = None
        # Once stopping, a renewal must not turn the ``leaving`` record back to ``running``.
        self._stopping = False

    def start(self, ctx: DetectorContext) -> None:
        super().start(ctx)
        store = ctx.store
        if store is None:
            log.info("detector_disabled", detector=self.name, reason="no etcd status store (not the unicron backend)")
            return
        if node_daemon() is not None:
            # The daemon's record is this node's, and the meeting point's lease is the agent's.
            return
        self.lease = KeptLease(store, self.ttl, on_lost=ctx.lost_own_lease, on_renewed=self._register)
        self._register(self.lease.id)

    def _register(self, lease: int) -> None:
        """Put this node's record on ``lease`` (again after a lapsed lease was renewed).

        Raises:
            StoreError: etcd refused or could not be reached.
        """
        if node_daemon() is not None or self._stopping:
            # The node daemon holds this node's record (with its slots) on its own lease, or the node is leaving.
            return
        store = self.ctx.store
        assert store is not None
        store.put_json(store.keys.node(self.ctx.node), {"state": "running", "lease": lease, "ts": time.time()},
                       lease=lease)

    def peer_lost(self, node: str, revision: int) -> None:
        """The place of ``node``, a peer of this run, vanished at ``revision`` (its lease expired): one SEV1
        ``lost_connection`` event, deduplicated across the run's nodes by a create-only marker."""
        ctx = getattr(self, "ctx", None)  # (not started yet: the agent's first moments)
        store = ctx.store if ctx is not None else None
        if store is None or node == ctx.node:
            return
        marker = store.keys.node_lost(node, revision)
        try:
            if not store.cas(marker, str(time.time()), None).succeeded:
                return  # another node reported it
        except StoreError:
            log.exception("node_loss_dedup_failed", node=node)
        self.ctx.report(ErrorEvent(Severity.SEV1, "lost_connection", self.name, node,
                                   message=f"lease of node {node} expired", occurred_at=time.time() - self.ttl))

    def stop(self) -> None:
        store = self.ctx.store if hasattr(self, "ctx") else None
        self._stopping = True
        if self.lease is not None and store is not None:
            if node_daemon() is None:
                try:
                    store.put_json(store.keys.node(self.ctx.node), {"state": "leaving"}, lease=self.lease.id)
                except StoreError:
                    pass
            self.lease.close(revoke=True)


def nvml_counters(nv: Any, handle: Any) -> dict[str, int]:
    """The error counters one GPU answers, by name (a counter NVML does not support on it is left out).

    ``ecc``: uncorrected volatile ECC errors; ``retired_pages``: pages
    pending retirement (before Hopper); ``remapped_rows``: uncorrectable
    remapped rows plus a pending remap and a remap failure (Ampere and later,
    where rows are remapped instead of pages retired); ``nvlink``: the
    replay errors of the links that answer.

    Args:
        nv: The ``pynvml`` module (or a stand-in with its functions).
        handle: The device's NVML handle.
    """
    readers = {
        "ecc": lambda: nv.nvmlDeviceGetTotalEccErrors(handle, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                      nv.NVML_VOLATILE_ECC),
        "retired_pages": lambda: nv.nvmlDeviceGetRetiredPagesPendingStatus(handle),
        "remapped_rows": lambda: sum(int(v) for v in nv.nvmlDeviceGetRemappedRows(handle)[1:4]),
        "nvlink": lambda: _nvlink_errors(nv, handle),
    }
    found = {}
    for name, read in readers.items():
        try:
            value = read()
        except Exception:  # noqa: BLE001 - not supported on this GPU (NVMLError_NotSupported, ...)
            continue
        if value is not None:
            found[name] = int(value)
    return found


def _nvlink_errors(nv: Any, handle: Any) -> int | None:
    """The replay errors summed over the links that answer; None when none does (no NVLink here)."""
    counts = []
    for link in range(nv.NVML_NVLINK_MAX_LINKS):
        try:
            counts.append(int(nv.nvmlDeviceGetNvLinkErrorCounter(handle, link, 0)))
        except Exception:  # noqa: BLE001 - a link that is not there or not active
            continue
    return sum(counts) if counts else None


class NvmlDetector(Detector):
    """Hardware: the GPUs' NVML error counters (:func:`nvml_counters`); silent without NVML.

    Needs an NVIDIA driver. On machines without one (CI, CPU-only) it logs
    ``detector_disabled`` once and costs nothing. A counter that rises above
    what it read at start is a SEV1 event named after the counter.
    """

    name = "nvml"

    def __init__(self, interval: float = 1.0) -> None:
        self.interval = interval
        self.available = False
        self._stop = threading.Event()
        self._baseline: dict[tuple[int, str], int] = {}

    def start(self, ctx: DetectorContext) -> None:
        super().start(ctx)
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception as exc:  # noqa: BLE001 - no driver, no library, no GPU
            log.info("detector_disabled", detector=self.name, reason=f"NVML unavailable: {exc}")
            return
        self.available = True
        self._counters()  # baseline
        log.info("nvml_counters", detector=self.name, counters=sorted({kind for _, kind in self._baseline}),
                 gpus=len(self._handles))
        threading.Thread(target=self._run, daemon=True, name="unicron-nvml").start()

    def _counters(self) -> list[tuple[int, str, int]]:
        """The counters that rose since the last look: ``(gpu, name, value)``."""
        found = []
        for index, handle in enumerate(self._handles):
            for kind, value in nvml_counters(self._nvml, handle).items():
                key = (index, kind)
                if value > self._baseline.setdefault(key, value):
                    found.append((index, kind, value))
                    self._baseline[key] = value
        return found

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for index, kind, value in self._counters():
                self.ctx.report(ErrorEvent(Severity.SEV1, kind, self.name, self.ctx.node,
                                           message=f"GPU {index}: {kind} counter rose to {value}"))

    def stop(self) -> None:
        self._stop.set()


@hookimpl
def unicron_detectors(config: AgentConfig) -> list[Detector]:
    """The built-in detectors of paper Table 1 plus NVML (this module is the agent's built-in plugin)."""
    return [
        NodeHealthDetector(ttl=config.node_ttl),
        ProcessDetector(),
        ExceptionDetector(),
        HangDetector(config.hang),
        StragglerDetector(config.straggler),
        NvmlDetector(),
    ]
