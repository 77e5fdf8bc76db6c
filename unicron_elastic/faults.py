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
from dataclasses import asdict, dataclass, fields
from pathlib import Path

FAULTS_ENV = "UNICRON_FAULTS"
FAULT_LOG_ENV = "UNICRON_FAULT_LOG"
FAULT_KINDS = ("kill", "exit", "raise", "hang", "stop", "stop_node")
FAULT_POINTS = (None, "before_optimizer_step", "after_optimizer_step", "before_first_group")
#: Appended to ``$UNICRON_FAULT_LOG``'s path: where the faults that did not fire are reported (JSON lines).
UNFIRED_SUFFIX = ".unfired"


@dataclass(frozen=True)
class Fault:
    """One injected failure.

    Attributes:
        rank: Global rank that fails.
        step: Training step at which it fails.
        micro_batch: Micro-batch within the step (None: at the start of the step).
        bucket: Gradient bucket during the all-reduce (None: not in the reduction).
        at: A named point of the step instead: ``before_optimizer_step`` (all
            buckets reduced) or ``after_optimizer_step``; or ``before_first_group``
            (step -1: the engine is about to build the run's first group).
        kind: ``kill`` (SIGKILL itself), ``exit`` (exit code 3), ``raise``
            (raise ``RuntimeError(message)``), ``hang`` (sleep forever),
            ``stop`` (SIGSTOP itself: a hung process, silent, its connections
            open) or ``stop_node`` (SIGSTOP its launcher and every process
            below it: a frozen node or a partition, nothing resets).
        message: Exception message for ``raise`` (chooses the severity).
        times: Fire at most this many times, all in the rank's first
            incarnation (a restarted worker is spared); None: every time the
            point is reached, in every incarnation.
    """

    rank: int
    step: int
    micro_batch: int | None = None
    kind: str = "kill"
    message: str = ""
    times: int | None = 1
    bucket: int | None = None
    at: str | None = None

    def __post_init__(self) -> None:
        if self.at not in FAULT_POINTS:
            raise ValueError(f"fault point at={self.at!r} is not one of {FAULT_POINTS}")
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind {self.kind!r} is not one of {FAULT_KINDS}")
        if self.times is not None and self.times < 1:
            raise ValueError(f"fault times={self.times} must be >= 1 or None")


def fail_at(rank: int, step: int, micro_batch: int | None = None, kind: str = "kill",
            message: str = "", times: int | None = 1, bucket: int | None = None, at: str | None = None) -> Fault:
    """Describe a failure of ``rank`` at ``step`` (and ``micro_batch``, gradient ``bucket`` or point ``at``).

    Raises:
        ValueError: Unknown ``kind`` or ``at``.
    """
    return Fault(rank, step, micro_batch, kind, message, times, bucket, at)


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


def _first_incarnation() -> bool:
    return os.environ.get("UNICRON_WORKER_RESTARTS", "0") == "0" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


_FIRED: dict[int, int] = {}
_RANKS: set[int] = set()  # the ranks this process reached fault points as


def maybe_fail(rank: int, step: int, micro_batch: int | None = None, bucket: int | None = None,
               at: str | None = None) -> None:
    """Fire the fault planned for this point, if any (workers call this).

    Each firing is appended to ``$UNICRON_FAULT_LOG`` (one JSON line) first, so a
    test can assert that the fault really happened. The first call as a rank
    arranges for :func:`report_unfired` to run when the process exits.

    Raises:
        ValueError: ``$UNICRON_FAULTS`` is malformed (the message names it).
    """
    raw = os.environ.get(FAULTS_ENV)
    if not raw:
        return
    if rank not in _RANKS:
        if not _RANKS:
            atexit.register(report_unfired)
        _RANKS.add(rank)
    for index, (spec, fault) in enumerate(planned_faults(raw)):
        if (fault.rank, fault.step, fault.micro_batch, fault.bucket, fault.at) != (rank, step, micro_batch, bucket, at):
            continue
        if fault.times is not None and (not _first_incarnation() or _FIRED.get(index, 0) >= fault.times):
            continue
        _FIRED[index] = _FIRED.get(index, 0) + 1
        log_path = os.environ.get(FAULT_LOG_ENV)
        if log_path:
            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "a") as f:
                f.write(json.dumps({**spec, "pid": os.getpid(), "time": time.time()}) + "\n")
                f.flush()
                os.fsync(f.fileno())
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "exit":
            os._exit(3)
        elif fault.kind == "raise":
            raise RuntimeError(fault.message or "injected failure")
        elif fault.kind == "hang":
            time.sleep(3600)
        elif fault.kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault.kind == "stop_node":
            _stop_node()


def unfired() -> list[dict]:
    """The faults planned for the ranks this process reached fault points as that have not fired (their specs).

    Only in a rank's first incarnation: a fault of a restarted worker's rank
    fired, or not, in the one before it.
    """
    raw = os.environ.get(FAULTS_ENV)
    if not raw or not _RANKS or not _first_incarnation():
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
    log_path = os.environ.get(FAULT_LOG_ENV)
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
    from unicron_elastic.node.processes import process_tree

    me = os.getpid()
    for pid in process_tree(os.getppid()):
        if pid != me:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
    os.kill(me, signal.SIGSTOP)
