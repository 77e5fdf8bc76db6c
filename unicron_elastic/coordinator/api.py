"""The coordinator's records: task specs, node records, the cluster plan, node commands.

A leaf module (no I/O): frozen dataclasses with their JSON form in etcd and
:class:`SpecError`, the one error a bad task spec raises (it names the field).
"""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unicron_elastic.api import ConfigError, MalformedValueError

#: Fields a task spec may have; ``model`` is a catalogue name, a model description or a calibration table.
SPEC_FIELDS = ("name", "command", "weight", "min_workers", "max_workers", "global_batch", "model", "model_parallel")
#: The optional fields of :data:`SPEC_FIELDS`, with their value when absent (a spec without them stays valid).
SPEC_DEFAULTS: dict[str, Any] = {"model_parallel": 1}
#: Task names are rendezvous run ids and etcd key parts.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
#: Largest weight (as the planner's MAX_WEIGHT) and largest worker count.
MAX_WEIGHT = 1e6
MAX_WORKERS = 100_000
#: Largest number in a model description (layers, hidden, heads, seq_len, vocab, global_batch).
MAX_MODEL_SIZE = 10_000_000
#: The weights the paper recommends; outside them a spec is accepted and ``unicron task submit`` warns
#: (:meth:`TaskSpec.weight_warning`).
RECOMMENDED_WEIGHTS = (0.5, 2.0)


class SpecError(ConfigError):
    """A task spec is malformed; the message names the field."""


def _unit(doc: dict[str, Any], low: int, high: int) -> int:
    """Check ``model_parallel`` (TP x PP: workers per data-parallel replica) against the worker bounds.

    Raises:
        SpecError: Not a whole number >= 1, or ``min_workers``/``max_workers`` not a multiple of it.
    """
    unit = _whole("model_parallel", doc.get("model_parallel", SPEC_DEFAULTS["model_parallel"]), 1)
    for name, count in (("min_workers", low), ("max_workers", high)):
        if count % unit:
            raise SpecError(f"field {name!r}: {count} is not a multiple of model_parallel={unit} "
                            "(a data-parallel replica is model_parallel workers)")
    return unit


def _whole(name: str, value: object, low: int, high: int = MAX_WORKERS) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise SpecError(f"field {name!r}: {value!r} must be a whole number in {low}..{high}")
    return value


def _command(value: object, check_exists: bool) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(a, str) for a in value):
        raise SpecError(f"field 'command': {value!r} must be a non-empty list of strings (an argv)")
    if check_exists and shutil.which(value[0]) is None:
        raise SpecError(f"field 'command': {value[0]!r} is not an executable file or a command on PATH")
    return tuple(value)


def _calibration(table: object) -> dict[int, float]:
    if not isinstance(table, dict) or not table:
        raise SpecError("field 'model': 'calibration' must be a non-empty object {workers: flops}")
    out: dict[int, float] = {}
    for workers, flops in table.items():
        try:
            count = int(workers)
        except (TypeError, ValueError):
            count = 0
        if not 1 <= count <= MAX_WORKERS or str(count) != str(workers).strip():
            raise SpecError(f"field 'model': calibration key {workers!r} must be a worker count in 1..{MAX_WORKERS}")
        if isinstance(flops, bool) or not isinstance(flops, (int, float)) or not math.isfinite(flops) or flops < 0:
            hint = " (YAML reads 2.0e12 as text: write 2.0e+12)" if isinstance(flops, str) else ""
            raise SpecError(f"field 'model': calibration of {workers} workers: {flops!r} must be a finite number "
                            f">= 0{hint}")
        out[count] = float(flops)
    return out


def _model(value: object) -> str | dict[str, Any]:
    """Check ``model``: a catalogue name, ``{"calibration": {...}}`` or GptModel fields."""
    from unicron_elastic.planner.throughput import MODELS, GptModel

    if isinstance(value, str):
        if value not in MODELS:
            raise SpecError(f"field 'model': unknown model {value!r}; known: {', '.join(MODELS)}")
        return value
    if not isinstance(value, dict):
        raise SpecError(f"field 'model': {value!r} must be a model name, a description or a calibration table")
    if "calibration" in value:
        if set(value) != {"calibration"}:
            raise SpecError(f"field 'model': a calibration table has no other keys (got {sorted(value)})")
        return {"calibration": {str(k): v for k, v in _calibration(value["calibration"]).items()}}
    sizes = {k: v for k, v in value.items() if k != "name"}
    for key, number in sizes.items():
        if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= MAX_MODEL_SIZE:
            raise SpecError(f"field 'model': {key}={number!r} must be a whole number in 1..{MAX_MODEL_SIZE}")
    try:
        GptModel(name=str(value.get("name", "model")), **sizes)
    except (TypeError, ValueError) as exc:
        raise SpecError(f"field 'model': not a model description: {exc}") from None
    return dict(value)


@dataclass(frozen=True)
class TaskSpec:
    """One task of the cluster, as submitted.

    Attributes:
        name: Unique name (letters, digits, ``_.-``; at most 63 characters).
        command: The worker's argv (what ``torchrun`` would run).
        weight: w(t), the price of its throughput (> 0; 0.5-2.0 recommended).
        min_workers: Fewest workers it trains on (T = 0 below).
        max_workers: Most workers it may use.
        global_batch: Micro-batches per step (the same at every size); at
            most this many data-parallel replicas.
        model: A model name of the planner's catalogue, a description
            (:class:`~unicron_elastic.planner.GptModel` fields) or
            ``{"calibration": {"<workers>": flops}}``.
        model_parallel: Workers per data-parallel replica (TP x PP, optional,
            default 1): the task runs on a whole number of replicas only.
    """

    name: str
    command: tuple[str, ...]
    weight: float
    min_workers: int
    max_workers: int
    global_batch: int
    model: str | dict[str, Any]
    model_parallel: int = 1

    @classmethod
    def from_dict(cls, doc: object, check_command: bool = True) -> TaskSpec:
        """Validate a spec document.

        Args:
            doc: The parsed JSON/YAML.
            check_command: Require ``command[0]`` to exist on this machine.

        Raises:
            SpecError: An unknown or missing field, or a bad value (names it).
        """
        if not isinstance(doc, dict):
            raise SpecError(f"a task spec is an object with fields {', '.join(SPEC_FIELDS)}; got {type(doc).__name__}")
        unknown = sorted(set(doc) - set(SPEC_FIELDS))
        if unknown:
            raise SpecError(f"unknown field {unknown[0]!r}; a task spec has {', '.join(SPEC_FIELDS)}")
        missing = [f for f in SPEC_FIELDS if f not in doc and f not in SPEC_DEFAULTS]
        if missing:
            raise SpecError(f"missing field {missing[0]!r}")
        name = doc["name"]
        if not isinstance(name, str) or not _NAME.match(name):
            raise SpecError(f"field 'name': {name!r} must be 1-63 letters, digits, '_', '.' or '-'")
        weight = doc["weight"]
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (0 < weight <= MAX_WEIGHT):
            raise SpecError(f"field 'weight': {weight!r} must be a number > 0 and at most {MAX_WEIGHT:g}")
        low = _whole("min_workers", doc["min_workers"], 1)
        high = _whole("max_workers", doc["max_workers"], 1)
        if low > high:
            raise SpecError(f"field 'min_workers': {low} is more than max_workers={high}")
        unit = _unit(doc, low, high)
        batch = _whole("global_batch", doc["global_batch"], low // unit, 10**9)
        return cls(name, _command(doc["command"], check_command), float(weight), low, high, batch, _model(doc["model"]),
                   unit)

    def weight_warning(self) -> str | None:
        """The warning for a weight outside :data:`RECOMMENDED_WEIGHTS`, or ``None`` inside them.

        Such a weight is valid; it lets one task outbid the others by more than
        the paper's range (a weight of 10 buys a GPU for it over a throughput 10x
        higher elsewhere).
        """
        low, high = RECOMMENDED_WEIGHTS
        if low <= self.weight <= high:
            return None
        return f"task {self.name!r}: weight {self.weight:g} is outside the recommended {low:g}-{high:g}"

    @classmethod
    def from_file(cls, path: str | Path) -> TaskSpec:
        """Read and validate ``SPEC.json`` or ``SPEC.yaml``.

        Raises:
            SpecError: The file cannot be read or parsed, or the spec is bad.
        """
        path = Path(path)
        try:
            text = path.read_text()
            if path.suffix in (".yaml", ".yml"):
                import yaml

                doc = yaml.safe_load(text)
            else:
                doc = json.loads(text)
        except (OSError, ValueError, RecursionError) as exc:
            raise SpecError(f"task spec {path}: {exc}") from None
        except Exception as exc:  # yaml.YAMLError is not a ValueError
            raise SpecError(f"task spec {path}: {exc}") from None
        return cls.from_dict(doc)

    def to_dict(self) -> dict[str, Any]:
        """The JSON document stored at ``tasks/<name>/spec``.

        An optional field at its default is left out: a spec without it is stored as before.
        """
        doc = {"name": self.name, "command": list(self.command), "weight": self.weight,
               "min_workers": self.min_workers, "max_workers": self.max_workers,
               "global_batch": self.global_batch, "model": self.model, "model_parallel": self.model_parallel}
        return {k: v for k, v in doc.items() if k not in SPEC_DEFAULTS or v != SPEC_DEFAULTS[k]}

    @property
    def calibration(self) -> dict[int, float] | None:
        """The calibration table by worker count, if the model is one."""
        if isinstance(self.model, dict) and "calibration" in self.model:
            return {int(k): float(v) for k, v in self.model["calibration"].items()}
        return None


def _doc(raw: str | bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError, UnicodeDecodeError) as exc:
        raise MalformedValueError(f"not a {what} document: {exc}") from None
    if not isinstance(doc, dict):
        raise MalformedValueError(f"not a {what} document: {type(doc).__name__}")
    return doc


@dataclass(frozen=True)
class NodeRecord:
    """A node daemon's registration (``nodes/<name>``, on the node's lease).

    Attributes:
        name: Node name.
        slots: Workers it can run (GPUs).
        host: Host name, for people.
        pid: The daemon's PID, for people.
    """

    name: str
    slots: int
    host: str = ""
    pid: int = 0

    def to_json(self, state: str = "up") -> str:
        """JSON form; ``state`` is ``up``, or ``leaving`` just before a daemon that stops revokes its lease."""
        return json.dumps({"name": self.name, "slots": self.slots, "host": self.host, "pid": self.pid,
                           "state": state}, sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> NodeRecord:
        """Parse a node record.

        Raises:
            MalformedValueError: Wrong shape.
        """
        return cls.from_doc(_doc(raw, "node record"), raw)

    @classmethod
    def from_doc(cls, doc: Any, raw: str | bytes = b"") -> NodeRecord:
        """A node record from its parsed JSON (``raw``: the value, for the error message).

        Raises:
            MalformedValueError: Wrong shape.
        """
        if not isinstance(doc, dict):
            raise MalformedValueError(f"not a node record: {str(raw)[:80]!r}")
        slots, pid = doc.get("slots"), doc.get("pid", 0)
        if not isinstance(doc.get("name"), str) or isinstance(slots, bool) or not isinstance(slots, int) \
                or not 1 <= slots <= MAX_WORKERS or not isinstance(pid, int):
            raise MalformedValueError(f"not a node record: {str(raw)[:80]!r}")
        return cls(doc["name"], slots, str(doc.get("host", "")), pid)


@dataclass(frozen=True)
class TaskPlan:
    """One task's share of the plan.

    Attributes:
        nodes: The nodes it runs on (sorted).
        workers: Workers in all (the data-parallel size on CPU).
        waf: F(t, x) at that size (weighted throughput).
        parallel: The parallel configuration, e.g. ``dp=4`` or ``tp=2 pp=1 dp=2``.
    """

    nodes: tuple[str, ...]
    workers: int
    waf: float
    parallel: str = ""


@dataclass(frozen=True)
class ClusterPlan:
    """The coordinator's plan (``plan``), one generation.

    Attributes:
        generation: Increases by one with every plan.
        tasks: Each active task's share (a task with no nodes is waiting).
        nodes: The usable nodes the plan was made for, with their slots.
        isolated: Nodes taken out of service (SEV1 or repeated failures).
        finished: Tasks that finished, were cancelled or failed (never planned again).
        reason: The event that led to this plan, for people.
        failed: The tasks of ``finished`` that failed (taken out after failing on several nodes).
    """

    generation: int
    tasks: dict[str, TaskPlan]
    nodes: dict[str, int]
    isolated: tuple[str, ...] = ()
    finished: tuple[str, ...] = ()
    reason: str = ""
    failed: tuple[str, ...] = ()

    @property
    def waf(self) -> float:
        """Cluster WAF: sum of the tasks' F."""
        return sum(t.waf for t in self.tasks.values())

    def task_of(self, node: str) -> str | None:
        """The task ``node`` runs under this plan, if any."""
        for name, share in self.tasks.items():
            if node in share.nodes:
                return name
        return None

    def to_json(self) -> str:
        """The JSON document stored at ``plan``."""
        return json.dumps({
            "generation": self.generation,
            "tasks": {n: {"nodes": list(t.nodes), "workers": t.workers, "waf": t.waf, "parallel": t.parallel}
                      for n, t in self.tasks.items()},
            "nodes": self.nodes, "isolated": list(self.isolated), "finished": list(self.finished),
            "reason": self.reason, "failed": list(self.failed),
        }, sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> ClusterPlan:
        """Parse a stored plan.

        Raises:
            MalformedValueError: Wrong shape.
        """
        doc = _doc(raw, "plan")
        try:
            tasks = {str(n): TaskPlan(tuple(str(x) for x in t["nodes"]), int(t["workers"]), float(t["waf"]),
                              str(t.get("parallel", ""))) for n, t in doc["tasks"].items()}
            return cls(int(doc["generation"]), tasks, {str(k): int(v) for k, v in doc["nodes"].items()},
                       tuple(doc.get("isolated", ())), tuple(doc.get("finished", ())), str(doc.get("reason", "")),
                       tuple(str(x) for x in doc.get("failed", ())))
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise MalformedValueError(f"not a plan document: {exc}") from None


@dataclass(frozen=True)
class Command:
    """What one node daemon must run (``commands/<node>/<generation>``).

    Attributes:
        node: The node.
        generation: The plan generation it belongs to.
        task: The task to run, or None: run nothing (stop what runs).
        nodes: How many nodes the task has under this plan.
        workers: The task's workers in all under this plan.
    """

    node: str
    generation: int
    task: str | None
    nodes: int = 0
    workers: int = 0

    def to_json(self) -> str:
        """JSON form."""
        return json.dumps({"node": self.node, "generation": self.generation, "task": self.task,
                           "nodes": self.nodes, "workers": self.workers}, sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> Command:
        """Parse a command.

        Raises:
            MalformedValueError: Wrong shape.
        """
        doc = _doc(raw, "command")
        try:
            task = doc["task"]
            return cls(str(doc["node"]), int(doc["generation"]), None if task is None else str(task),
                       int(doc.get("nodes", 0)), int(doc.get("workers", 0)))
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise MalformedValueError(f"not a command document: {exc}") from None
