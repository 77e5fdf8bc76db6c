"""Fault points: failures described as data, fired where the training code calls :func:`maybe_fail`.

A leaf module of production code (the Lightning strategy and the example
workers call :func:`maybe_fail` at every micro-batch, bucket and around the
optimizer step; with ``$UNICRON_FAULTS`` unset it returns at once), like
TorchFT's event injector. The test helpers module re-exports these names
for tests and demos.

A planned fault never passes silently: each firing is appended to
``$UNICRON_FAULT_LOG``, and a process that reached fault points as a rank
reports, when it exits, every fault planned for that rank (in its first
incarnation) that did not fire, because the rank never reached that point
(it never computed that micro-batch or bucket at that step, or the run ended
first): one line on stderr (``unicron_faults: fault_not_fired ...``) and one
JSON line in ``$UNICRON_FAULT_LOG`` + :data:`UNFIRED_SUFFIX`.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from unicron_elastic.env import FAULT_LOG, FAULTS, fault_log_path, faults_text, first_incarnation

FAULTS_ENV = FAULTS.name  # (the variables are env.FAULTS and env.FAULT_LOG)
FAULT_LOG_ENV = FAULT_LOG.name
FAULT_KINDS = ("kill", "exit", "raise", "hang", "spin", "stuck_collective", "stop", "stop_node", "throttle")
FAULT_POINTS = (None, "before_optimizer_step", "after_optimizer_step", "before_first_group", "optimizer_step", "gather",
                "backward")
#: Appended to ``$UNICRON_FAULT_LOG``'s path: where the faults that did not fire are reported (JSON lines).
UNFIRED_SUFFIX = ".unfired"


@dataclass(frozen=True)
class Fault:
    """One injected failure.

    Attributes:
        rank: Global rank that fails.
        step: Training step at which it fails.
        micro_batch: Micro-batch within the step (None: at the start of the step).
        bucket: Gradient bucket: right before its all-reduce starts (from backward, or when the reduction
            begins; the buckets before it may be in flight), None: not in the reduction.
        at: A named point of the step instead: ``before_optimizer_step`` (all
            buckets reduced) or ``after_optimizer_step``; or ``before_first_group``
            (step -1: the engine is about to build the run's first group); with a
            sharded optimizer ``optimizer_step`` (inside the optimizer's step) or
            ``gather`` (inside the gather of the parameters that step updated);
            ``backward``: inside the backward of the rank's last micro-batch,
            right after its first bucket's all-reduce started from it (a bucket
            in flight while backward still runs).
        kind: ``kill`` (SIGKILL itself), ``exit`` (exit code 3), ``raise``
            (raise ``RuntimeError(message)``), ``hang`` (sleep forever),
            ``spin`` (a Python infinite loop: busy, no progress),
            ``stuck_collective`` (block forever saying it waits on its group, as
            a rank inside a collective that never completes does),
            ``stop`` (SIGSTOP itself: a hung process, silent, its connections
            open), ``stop_node`` (SIGSTOP its launcher and every process
            below it: a frozen node or a partition, nothing resets) or
            ``throttle`` (from ``step`` on, for ``steps`` steps, each of its
            micro-batches takes ``factor`` times as long: a slow rank, not a
            failed one; ``micro_batch``, ``bucket`` and ``at`` stay None).
        message: Exception message for ``raise`` (chooses the severity).
        times: Fire at most this many times, all in the rank's first
            incarnation (a restarted worker is spared); None: every time the
            point is reached, in every incarnation.
        factor: ``throttle``: how many times longer each micro-batch takes.
        steps: ``throttle``: for how many steps.
    """

    rank: int
    step: int
    micro_batch: int | None = None
    kind: str = "kill"
    message: str = ""
    times: int | None = 1
    bucket: int | None = None
    at: str | None = None
    factor: float = 3.0
    steps: int = 1

    def __post_init__(self) -> None:
        if self.at not in FAULT_POINTS:
            raise ValueError(f"fault point at={self.at!r} is not one of {FAULT_POINTS}")
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind {self.kind!r} is not one of {FAULT_KINDS}")
        if self.times is not None and self.times < 1:
            raise ValueError(f"fault times={self.times} must be >= 1 or None")
        if self.kind == "throttle":
            if (self.micro_batch, self.bucket, self.at) != (None, None, None):
                raise ValueError("a throttle fault slows every micro-batch of its steps: micro_batch, bucket and "
                                 "at must be None")
            if not self.factor >= 1 or self.steps < 1:
                raise ValueError(f"a throttle fault needs factor >= 1 and steps >= 1, got {self.factor}, {self.steps}")


def fail_at(rank: int, step: int, micro_batch: int | None = None, kind: str = "kill",
            message: str = "", times: int | None = 1, bucket: int | None = None, at: str | None = None) -> Fault:
    """Describe a failure of ``rank`` at ``step`` (and ``micro_batch``, gradient ``bucket`` or point ``at``).

    Raises:
        ValueError: Unknown ``kind`` or ``at``.
    """
    return Fault(rank, step, micro_batch, kind, message, times, bucket, at)


def throttle(rank: int, step: int, factor: float = 3.0, steps: int = 20) -> Fault:
    """Describe a slow rank: from ``step`` on, for ``steps`` steps, its micro-batches take ``factor`` times as long.

    Raises:
        ValueError: ``factor`` below 1 or ``steps`` below 1.
    """
    return Fault(rank, step, kind="throttle", factor=factor, steps=steps)


def faults_env(faults: list[Fault], log_path: str | None = None) -> dict[str, str]:
    """Environment variables that carry ``faults`` to the workers."""
    env = {FAULTS_ENV: json.dumps([asdict(f) for f in faults])}
    if log_path:
        env[FAULT_LOG_ENV] = log_path
    return env


def _fault(index: int, spec: object) -> Fault:
    """Entry ``index`` of ``$UNICRON_FAULTS`` as a :class:`Fault` (TypeError/ValueError naming the entry)."""
    if not isinstance(spec, dict):
        raise TypeError(f"fault {index}: expected an object, got {type(spec).__name__}")
    unknown = sorted(set(spec) - {f.name for f in fields(Fault)})
    if unknown:
        known = ", ".join(f.name for f in fields(Fault))
        raise TypeError(f"fault {index}: unknown field(s) {', '.join(map(str, unknown))}; known: {known}")
    try:
        return Fault(**spec)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"fault {index}: {exc}") from None


def planned_faults(raw: str) -> list[tuple[dict, Fault]]:
    """Parse the value of ``$UNICRON_FAULTS``: a JSON list of :class:`Fault` fields.

    Returns:
        ``(spec, fault)`` per entry, in order.

    Raises:
        ValueError: The text is not such a list; the message starts with
            ``UNICRON_FAULTS:`` and names the entry.
    """
    try:
        specs = json.loads(raw)
        if not isinstance(specs, list):
            raise TypeError(f"expected a JSON list of faults, got {type(specs).__name__}")
        return [(spec, _fault(index, spec)) for index, spec in enumerate(specs)]
    except RecursionError:
        raise ValueError(f"{FAULTS_ENV}: JSON nested too deeply") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{FAULTS_ENV}: {exc}") from None


_FIRED: dict[int, int] = {}
_RANKS: set[int] = set()  # the ranks this process reached fault points as


def maybe_fail(rank: int, step: int, micro_batch: int | None = None, bucket: int | None = None,
               at: str | None = None, waiting: Callable[[bool], None] | None = None) -> None:
    """Fire the fault planned for this point, if any (workers call this).

    ``waiting`` is what a ``stuck_collective`` fault says, every 0.15 s, forever
    (the worker's :meth:`~unicron_elastic.worker.WorkerChannel.waiting`; None: it
    says nothing, as ``hang``).

    Each firing is appended to ``$UNICRON_FAULT_LOG`` (one JSON line) first, so a
    test can assert that the fault really happened. The first call as a rank
    arranges for :func:`report_unfired` to run when the process exits.

    Raises:
        ValueError: ``$UNICRON_FAULTS`` is malformed (the message names it).
    """
    raw = faults_text()
    if not raw:
        return
    if rank not in _RANKS:
        if not _RANKS:
            atexit.register(report_unfired)
        _RANKS.add(rank)
    planned = planned_faults(raw)
    _throttle(planned, rank, step, micro_batch is not None)
    for index, (spec, fault) in enumerate(planned):
        if fault.kind == "throttle":
            continue
        if (fault.rank, fault.step, fault.micro_batch, fault.bucket, fault.at) != (rank, step, micro_batch, bucket, at):
            continue
        if fault.times is not None and (not first_incarnation() or _FIRED.get(index, 0) >= fault.times):
            continue
        _fired(index, spec)
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "exit":
            os._exit(3)
        elif fault.kind == "raise":
            raise RuntimeError(fault.message or "injected failure")
        elif fault.kind == "hang":
            time.sleep(3600)
        elif fault.kind == "spin":
            _spin()
        elif fault.kind == "stuck_collective":
            _stuck_collective(waiting)
        elif fault.kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault.kind == "stop_node":
            _stop_node()


def _fired(index: int, spec: dict) -> None:
    """Count a firing of fault ``index`` and append it to ``$UNICRON_FAULT_LOG`` (synced: the process may die next)."""
    _FIRED[index] = _FIRED.get(index, 0) + 1
    log_path = fault_log_path()
    if log_path:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a") as f:
            f.write(json.dumps({**spec, "pid": os.getpid(), "time": time.time()}) + "\n")
            f.flush()
            os.fsync(f.fileno())


_LAST_POINT: dict[int, tuple[float, bool]] = {}  # rank -> (monotonic time of its last point, a micro-batch's?)


def _throttle(planned: list[tuple[dict, Fault]], rank: int, step: int, micro_batch_point: bool) -> None:
    """Slow ``rank`` as its ``throttle`` faults say: the time since its last point, when that point began a
    micro-batch (that micro-batch's computation), is stretched ``factor`` times by sleeping here. Logged once,
    on its first use; only in the rank's first incarnation."""
    now = time.monotonic()
    last = _LAST_POINT.get(rank)
    _LAST_POINT[rank] = (now, micro_batch_point)
    if last is None or not last[1] or not first_incarnation():
        return
    for index, (spec, fault) in enumerate(planned):
        if fault.kind == "throttle" and fault.rank == rank and fault.step <= step < fault.step + fault.steps:
            if not _FIRED.get(index):
                _fired(index, spec)
            time.sleep((fault.factor - 1) * (now - last[0]))
            _LAST_POINT[rank] = (time.monotonic(), micro_batch_point)


def _spin() -> None:
    """A Python infinite loop: the process is busy and makes no progress."""
    spins = 0
    while True:
        spins += 1


def _stuck_collective(waiting: Callable[[bool], None] | None) -> None:
    """Block forever, calling ``waiting(True)`` every 0.15 s (as the engine's watch reports a rank inside a
    collective of its group that never completes)."""
    while True:
        if waiting is not None:
            waiting(True)
        time.sleep(0.15)


def unfired() -> list[dict]:
    """The faults planned for the ranks this process reached fault points as that have not fired (their specs).

    Only in a rank's first incarnation: a fault of a restarted worker's rank
    fired, or not, in the one before it.
    """
    raw = faults_text()
    if not raw or not _RANKS or not first_incarnation():
        return []
    return [spec for index, (spec, fault) in enumerate(planned_faults(raw))
            if fault.rank in _RANKS and not _FIRED.get(index)]


def report_unfired() -> list[dict]:
    """Report the faults of :func:`unfired` (at exit): a line on stderr each, and JSON lines in
    ``$UNICRON_FAULT_LOG`` + :data:`UNFIRED_SUFFIX`.

    Returns:
        Their specs.
    """
    try:
        specs = unfired()
    except ValueError:  # (a malformed plan was an error where it was read)
        return []
    log_path = fault_log_path()
    for spec in specs:
        sys.stderr.write(f"unicron_faults: fault_not_fired {json.dumps(spec)} pid={os.getpid()}: the rank never "
                         f"reached that point (it did not compute that micro-batch or bucket at that step, or the "
                         f"run ended first)\n")
        if log_path:
            with open(log_path + UNFIRED_SUFFIX, "a") as f:
                f.write(json.dumps({**spec, "pid": os.getpid(), "time": time.time(), "fired": False}) + "\n")
    sys.stderr.flush()
    return specs


def _stop_node() -> None:
    """SIGSTOP this worker's launcher (its parent) and every process below it, this one last."""
    from unicron_elastic.processes import process_tree

    me = os.getpid()
    for pid in process_tree(os.getppid()):
        if pid != me:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
    os.kill(me, signal.SIGSTOP)
