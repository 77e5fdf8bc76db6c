"""Failure traces: the paper's trace-a and trace-b generators, and trace files.

A trace is a cluster (nodes of g GPUs) and a list of failures. A SEV1 failure
takes its node out until it is repaired; SEV2/SEV3 failures hit the tasks on a
node but leave the node available (paper section 7.5).

* trace-a: 16 nodes x 8 GPUs for 8 weeks, 10 SEV1 and 33 other failures at
  uniformly random times, SEV1 repair time uniform in 1-7 days.
* trace-b: the failure rate of trace-a x 20 as Poisson processes over 7 days.
  Repairs are 20x faster too (uniform 1.2-8.4 hours): the paper has repaired
  nodes "re-joining the cluster at a similar rate to maintain a stable
  resource pool", which 1-7 day repairs could not do at this rate.

Files: CSV with header ``time_s,kind,node,repair_s`` (repair_s empty unless
kind is sev1) or JSON ``{"nodes", "gpus_per_node", "duration_s", "events": [...]}``.
Every number must be finite; a trace lasts at most :data:`MAX_TRACE_S` (ten
years, also the longest repair) on at most ``MAX_GPUS`` (100,000) GPUs.
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from unicron_elastic.api import ConfigError, finite_positive
from unicron_elastic.planner.throughput import MAX_GPUS

DAY = 86400.0
WEEK = 7 * DAY
KINDS = ("sev1", "sev2", "sev3")
#: Longest trace, in seconds (ten years); also the longest repair time.
MAX_TRACE_S = 10 * 365 * DAY


@dataclass(frozen=True)
class Failure:
    """One failure.

    Attributes:
        time_s: Seconds from the start of the trace.
        kind: ``sev1``, ``sev2`` or ``sev3``.
        node: Index of the node it hits.
        repair_s: For SEV1, seconds until the node is back.
    """

    time_s: float
    kind: str
    node: int
    repair_s: float | None = None


@dataclass(frozen=True)
class Trace:
    """A cluster and its failures over a period.

    Raises:
        ConfigError: Inconsistent, non-finite or out-of-range content (message
            names the field or event).
    """

    name: str
    nodes: int
    gpus_per_node: int
    duration_s: float
    events: tuple[Failure, ...]

    def __post_init__(self) -> None:
        try:
            _check(self.nodes, self.gpus_per_node, self.duration_s, self.events)
        except ConfigError as exc:
            raise ConfigError(f"trace {self.name!r}: {exc}") from None

    @property
    def gpus(self) -> int:
        """GPUs in the cluster."""
        return self.nodes * self.gpus_per_node

    def counts(self) -> dict[str, int]:
        """Failures per kind."""
        return {k: sum(e.kind == k for e in self.events) for k in KINDS}

    def failure_rate(self) -> float:
        """Failures per GPU per second over the trace (at least one failure assumed)."""
        return max(1, len(self.events)) / (self.duration_s * self.gpus)


def _check(nodes: int, gpus_per_node: int, duration_s: float, events: tuple[Failure, ...] | list[Failure]) -> None:
    """Validate a trace's content.

    Raises:
        ConfigError: A field or event is invalid; names it (without the trace).
    """
    finite_positive("nodes", nodes, MAX_GPUS, integer=True)
    finite_positive("gpus_per_node", gpus_per_node, MAX_GPUS, integer=True)
    if nodes * gpus_per_node > MAX_GPUS:
        raise ConfigError(f"{nodes} nodes x {gpus_per_node} GPUs: at most {MAX_GPUS} GPUs can be simulated")
    finite_positive("duration_s", duration_s, MAX_TRACE_S)
    for i, e in enumerate(events):
        if e.kind not in KINDS:
            raise ConfigError(f"event {i}: kind {e.kind!r} is not one of {KINDS}")
        if isinstance(e.node, bool) or not isinstance(e.node, int) or not 0 <= e.node < nodes:
            raise ConfigError(f"event {i}: node {e.node!r} not in 0..{nodes - 1}")
        if not 0 <= e.time_s <= duration_s:  # NaN fails too
            raise ConfigError(f"event {i}: time {e.time_s} outside the trace (0..{duration_s})")
        if e.kind == "sev1" and e.repair_s is None:
            raise ConfigError(f"event {i}: a sev1 failure needs repair_s > 0")
        if e.repair_s is not None:
            try:
                finite_positive("repair_s", e.repair_s, MAX_TRACE_S)
            except ConfigError as exc:
                raise ConfigError(f"event {i}: {exc}") from None


def _place(rng: random.Random, times: list[float], kinds: list[str], nodes: int, repair: tuple[float, float]) -> list[Failure]:
    events: list[Failure] = []
    down_until = [0.0] * nodes
    for t, kind in sorted(zip(times, kinds)):
        up = [n for n in range(nodes) if down_until[n] <= t]
        if not up:
            continue
        node = rng.choice(up)
        repair_s = None
        if kind == "sev1":
            repair_s = rng.uniform(*repair)
            down_until[node] = t + repair_s
        events.append(Failure(round(t, 3), kind, node, None if repair_s is None else round(repair_s, 3)))
    return events


def _other_kind(rng: random.Random) -> str:
    return "sev2" if rng.random() < 2 / 3 else "sev3"


def trace_a(seed: int = 0, nodes: int = 16, gpus_per_node: int = 8) -> Trace:
    """The paper's trace-a, regenerated: 8 weeks, 10 SEV1 and 33 other failures."""
    rng = random.Random(seed)
    duration = 8 * WEEK
    kinds = ["sev1"] * 10 + [_other_kind(rng) for _ in range(33)]
    times = [rng.uniform(0, duration) for _ in kinds]
    events = _place(rng, times, kinds, nodes, (1 * DAY, 7 * DAY))
    return Trace("trace-a", nodes, gpus_per_node, duration, tuple(events))


def trace_b(seed: int = 0, nodes: int = 16, gpus_per_node: int = 8, amplification: float = 20.0) -> Trace:
    """The paper's trace-b: trace-a's failure rate x ``amplification``, Poisson, 7 days."""
    rng = random.Random(seed)
    duration = 1 * WEEK
    rates = {"sev1": 10 / (8 * WEEK) * amplification, "other": 33 / (8 * WEEK) * amplification}
    times, kinds = [], []
    for kind, rate in rates.items():
        t = rng.expovariate(rate)
        while t < duration:
            times.append(t)
            kinds.append("sev1" if kind == "sev1" else _other_kind(rng))
            t += rng.expovariate(rate)
    repair = (1 * DAY / amplification, 7 * DAY / amplification)
    events = _place(rng, times, kinds, nodes, repair)
    return Trace("trace-b", nodes, gpus_per_node, duration, tuple(events))


def _failure(raw: object) -> Failure:
    """One failure from its raw fields (a JSON object or a CSV row).

    Raises:
        ConfigError: A number is not finite or out of range (names the field).
        KeyError, TypeError: A field is missing or of the wrong type.
    """
    if not isinstance(raw, dict):
        raise TypeError(f"expected an object, got {type(raw).__name__}")
    kind, repair = raw["kind"], raw.get("repair_s")
    if not isinstance(kind, str):
        raise TypeError(f"kind {kind!r} is not a string")
    return Failure(
        float(finite_positive("time_s", raw["time_s"], MAX_TRACE_S, allow_zero=True)),
        kind.strip(),
        int(finite_positive("node", raw["node"], MAX_GPUS, allow_zero=True, integer=True)),
        None if repair in (None, "") else float(finite_positive("repair_s", repair, MAX_TRACE_S)),
    )


def _read_json(path: Path, nodes: int, gpus_per_node: int) -> tuple[int, int, float | None, list[Failure]]:
    """``(nodes, gpus_per_node, duration_s or None, events)`` of a JSON trace; ``nodes``/``gpus_per_node`` are defaults.

    Raises:
        ValueError, TypeError, KeyError, OSError, RecursionError: The file is unreadable or malformed.
    """
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict) or not isinstance(doc.get("events"), list):
        raise TypeError('expected an object {"nodes", "gpus_per_node", "duration_s", "events": [...]}')
    events = []
    for i, raw in enumerate(doc["events"]):
        try:
            events.append(_failure(raw))
        except (KeyError, ValueError, TypeError) as exc:
            raise ValueError(f"event {i}: {exc!r}" if isinstance(exc, KeyError) else f"event {i}: {exc}") from None
    nodes = int(finite_positive("nodes", doc.get("nodes", nodes), MAX_GPUS, integer=True))
    gpus_per_node = int(
        finite_positive("gpus_per_node", doc.get("gpus_per_node", gpus_per_node), MAX_GPUS, integer=True)
    )
    duration = float(finite_positive("duration_s", doc["duration_s"], MAX_TRACE_S)) if "duration_s" in doc else None
    return nodes, gpus_per_node, duration, events


def _read_csv(path: Path) -> list[Failure]:
    """The failures of a CSV trace.

    Raises:
        ValueError: A row is malformed (names the line); OSError: the file is unreadable.
    """
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    events = []
    for i, row in enumerate(rows):
        try:
            events.append(_failure(row))
        except ConfigError as exc:
            raise ValueError(f"row {i + 2}: {exc}") from None
        except (KeyError, ValueError, TypeError, AttributeError) as exc:
            raise ValueError(f"row {i + 2}: {exc!r}") from exc
    return events


def load_trace(path: str | Path, nodes: int = 16, gpus_per_node: int = 8) -> Trace:
    """Read a trace from CSV or JSON (see module docstring).

    A CSV trace (or a JSON one without ``duration_s``) lasts until its last
    failure or repair, a day if it has none.

    Raises:
        ConfigError: The file cannot be read, is malformed or nested too deeply,
            or holds a non-finite or out-of-range number; names the file and row.
    """
    path = Path(path)
    try:
        if path.suffix == ".json":
            nodes, gpus_per_node, duration, events = _read_json(path, nodes, gpus_per_node)
        else:
            events, duration = _read_csv(path), None
        if duration is None:
            duration = max((e.time_s + (e.repair_s or 0) for e in events), default=DAY)
        events.sort(key=lambda e: e.time_s)
        _check(nodes, gpus_per_node, duration, events)
    except RecursionError:
        raise ConfigError(f"trace file {path}: JSON nested too deeply") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"trace file {path}: {exc}") from exc
    return Trace(path.stem, nodes, gpus_per_node, duration, tuple(events))


def save_trace(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` as JSON (``.json``) or CSV (anything else)."""
    path = Path(path)
    if path.suffix == ".json":
        doc = {"nodes": trace.nodes, "gpus_per_node": trace.gpus_per_node, "duration_s": trace.duration_s,
               "events": [asdict(e) for e in trace.events]}
        path.write_text(json.dumps(doc, indent=1))
        return
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["time_s", "kind", "node", "repair_s"])
        for e in trace.events:
            writer.writerow([e.time_s, e.kind, e.node, "" if e.repair_s is None else e.repair_s])
