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
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from unicron_elastic.api import ConfigError

DAY = 86400.0
WEEK = 7 * DAY
KINDS = ("sev1", "sev2", "sev3")


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
        ConfigError: Inconsistent content (message names the event).
    """

    name: str
    nodes: int
    gpus_per_node: int
    duration_s: float
    events: tuple[Failure, ...]

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1 or not self.duration_s > 0:
            raise ConfigError(f"trace {self.name!r}: nodes, gpus_per_node and duration must be positive")
        for i, e in enumerate(self.events):
            if e.kind not in KINDS:
                raise ConfigError(f"trace {self.name!r} event {i}: kind {e.kind!r} is not one of {KINDS}")
            if not 0 <= e.node < self.nodes:
                raise ConfigError(f"trace {self.name!r} event {i}: node {e.node} not in 0..{self.nodes - 1}")
            if not 0 <= e.time_s <= self.duration_s:
                raise ConfigError(f"trace {self.name!r} event {i}: time {e.time_s} outside the trace")
            if e.kind == "sev1" and not (e.repair_s is not None and e.repair_s > 0):
                raise ConfigError(f"trace {self.name!r} event {i}: a sev1 failure needs repair_s > 0")

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


def load_trace(path: str | Path, nodes: int = 16, gpus_per_node: int = 8) -> Trace:
    """Read a trace from CSV or JSON (see module docstring).

    Raises:
        ConfigError: The file cannot be read or is malformed; names the file and row.
    """
    path = Path(path)
    try:
        if path.suffix == ".json":
            doc = json.loads(path.read_text())
            events = [Failure(float(e["time_s"]), str(e["kind"]), int(e["node"]),
                              None if e.get("repair_s") in (None, "") else float(e["repair_s"]))
                      for e in doc["events"]]
            nodes, gpus_per_node = int(doc.get("nodes", nodes)), int(doc.get("gpus_per_node", gpus_per_node))
            duration = float(doc["duration_s"]) if "duration_s" in doc else None
        else:
            with path.open(newline="") as f:
                rows = list(csv.DictReader(f))
            events = []
            for i, row in enumerate(rows):
                try:
                    repair = row.get("repair_s") or None
                    events.append(Failure(float(row["time_s"]), row["kind"].strip(), int(row["node"]),
                                          None if repair is None else float(repair)))
                except (KeyError, ValueError, TypeError, AttributeError) as exc:
                    raise ValueError(f"row {i + 2}: {exc!r}") from exc
            duration = None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"trace file {path}: {exc}") from exc
    if duration is None:
        duration = max((e.time_s + (e.repair_s or 0) for e in events), default=DAY)
    return Trace(path.stem, nodes, gpus_per_node, duration, tuple(sorted(events, key=lambda e: e.time_s)))


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
