"""How many whole nodes each task gets, and which ones: node units, throughput per node count, placement (pure).

Planning unit: a whole node. A task runs ``k`` nodes of ``s`` workers, where
``s`` is the smallest slot count of the usable nodes, so T(t, k) is the task's
throughput on ``k * s`` workers (its calibration table, else the analytic
Megatron model), zero outside ``min_workers..max_workers``, with more
data-parallel replicas than ``global_batch``, or when ``k * s`` is not a whole
number of replicas of ``model_parallel`` (TP x PP) workers
(:func:`replica_sizes`). The simulator sizes its plans through
:func:`plan_sizes` too, so ``unicron simulate`` and a live cluster choose sizes
with the same code.
"""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Mapping

from unicron_elastic.coordinator.api import TaskSpec
from unicron_elastic.planner.cost_model import CostModel, PlanTask
from unicron_elastic.planner.onestep import Event as TableEvent
from unicron_elastic.planner.onestep import OneStepTable
from unicron_elastic.planner.solver import MAX_GPUS, Plan, Problem, solve
from unicron_elastic.planner.throughput import GptModel, TabulatedThroughput, estimate, gpu_type
from unicron_elastic.coordinator.vocabulary import ClusterState


# -- sizing ------------------------------------------------------------------------------------------
def _model(spec: TaskSpec) -> GptModel:
    if isinstance(spec.model, str):
        from unicron_elastic.planner.throughput import model

        return model(spec.model)
    if isinstance(spec.model, dict) and "calibration" not in spec.model:
        doc = dict(spec.model)
        return GptModel(name=str(doc.pop("name", spec.name)), **doc)
    return GptModel(spec.name, 1, 1, 1)


def replica_sizes(slots: int, model_parallel: int, low: int, high: int) -> tuple[int, ...]:
    """The node counts ``k`` in ``low..high`` (k >= 1) whose ``k * slots`` workers are whole replicas.

    A data-parallel replica is ``model_parallel`` (TP x PP) workers and may span
    nodes, so ``k`` must be a multiple of lcm(slots, model_parallel) / slots:
    any ``k`` when ``model_parallel`` divides ``slots``,
    ``model_parallel / slots`` when ``slots`` divides ``model_parallel``.

    Args:
        slots: Workers per node (0: no usable node, no size).
        model_parallel: Workers per replica.
        low: Fewest nodes.
        high: Most nodes.

    Returns:
        The node counts, ascending.

    Raises:
        ValueError: ``model_parallel`` below 1 or ``slots`` negative.
    """
    if model_parallel < 1 or slots < 0:
        raise ValueError(f"need model_parallel >= 1 and slots >= 0 (got {model_parallel}, {slots})")
    if slots == 0:
        return ()
    step = model_parallel // math.gcd(slots, model_parallel)
    first = -(-max(low, 1) // step) * step
    return tuple(range(first, high + 1, step))


def _throughput_at(spec: TaskSpec, workers: int, gpu: str) -> tuple[float, str]:
    """T(t) on ``workers`` workers (a whole number of replicas) and the parallel config shown for it.

    A calibration table says nothing of TP and PP: with ``model_parallel`` > 1
    the config shows their product (``tp*pp=4 dp=2``). The analytic model picks
    TP and PP itself when ``model_parallel`` is 1, else splits ``model_parallel``.
    """
    unit = spec.model_parallel
    calibration = spec.calibration
    if calibration is not None:
        shown = f"dp={workers}" if unit == 1 else f"tp*pp={unit} dp={workers // unit}"
        return calibration.get(workers, 0.0), shown
    m, g = _model(spec), gpu_type(gpu)
    est = estimate(m, g, workers, 0 if unit == 1 else unit)
    return est.flops, "" if est.config is None else f"tp={est.config.tp} pp={est.config.pp} dp={est.config.dp}"


#: The latest :func:`task_throughput` results, by (spec object, slots, nodes, GPU): a re-plan asks for the same
#: tasks' tables again and again (the analytic model costs milliseconds per size).
_THROUGHPUT: collections.OrderedDict = collections.OrderedDict()
_THROUGHPUT_KEPT = 1024
_THROUGHPUT_LOCK = threading.Lock()


def task_throughput(spec: TaskSpec, slots: int, nodes: int, gpu: str) -> tuple[dict[int, float], dict[int, str]]:
    """T(t, k) for k = 1..``nodes`` nodes of ``slots`` workers, and the parallel config at each.

    Only node counts of whole replicas (:func:`replica_sizes`) are tabulated:
    T is zero at the others, outside ``min_workers..max_workers`` and with
    more replicas than ``global_batch``. Pure; the latest results are kept
    (callers must not change the dictionaries returned).
    """
    if slots >= 1:
        nodes = min(nodes, spec.max_workers // slots)  # (no size past max_workers: the same table for any horizon)
    key = (id(spec), slots, nodes, gpu)
    with _THROUGHPUT_LOCK:
        hit = _THROUGHPUT.get(key)
        if hit is not None and hit[0] is spec:
            _THROUGHPUT.move_to_end(key)
            return hit[1]
    result = _task_throughput(spec, slots, nodes, gpu)
    with _THROUGHPUT_LOCK:
        _THROUGHPUT[key] = (spec, result)
        while len(_THROUGHPUT) > _THROUGHPUT_KEPT:
            _THROUGHPUT.popitem(last=False)
    return result


def _task_throughput(spec: TaskSpec, slots: int, nodes: int, gpu: str) -> tuple[dict[int, float], dict[int, str]]:
    table, configs = {}, {}
    if slots < 1:
        return table, configs
    low, high = max(1, -(-spec.min_workers // slots)), min(nodes, spec.max_workers // slots)
    for k in replica_sizes(slots, spec.model_parallel, low, high):  # (only the sizes in min..max_workers)
        workers = k * slots
        if workers // spec.model_parallel > spec.global_batch:
            continue
        flops, config = _throughput_at(spec, workers, gpu)
        if flops > 0:
            table[k], configs[k] = flops, config
    return table, configs


def problem_of(state: ClusterState, tasks: tuple[TaskSpec, ...], n: int, faulted: frozenset[str],
             horizon: int | None = None) -> Problem:
    """The planning problem in node units; x of each task is its node count under the current plan.

    Args:
        horizon: Largest node count T is tabulated for (default ``n``).
    """
    slots = state.slots()
    held = {} if state.plan is None else {name: len(share.nodes) for name, share in state.plan.tasks.items()}
    table = {t.name: task_throughput(t, slots, max(horizon or n, 1), state.config.gpu)[0] for t in tasks}
    cost = CostModel(TabulatedThroughput(table), state.config.failure_rate, state.config.d_transition)
    plan_tasks = tuple(
        PlanTask(t.name, GptModel(t.name, 1, 1, 1), t.weight, 1, held.get(t.name, 0), t.name in faulted)
        for t in tasks
    )
    return Problem(plan_tasks, min(n, MAX_GPUS), cost)


def current_nodes(state: ClusterState) -> dict[str, tuple[str, ...]]:
    """Each task's nodes under the current plan that are still usable."""
    if state.plan is None:
        return {}
    usable = set(state.usable())
    return {name: tuple(n for n in share.nodes if n in usable) for name, share in state.plan.tasks.items()}


def place(counts: Mapping[str, int], current: Mapping[str, tuple[str, ...]], usable: list[str]) -> dict[str, tuple[str, ...]]:
    """Put each task on ``counts[task]`` nodes, keeping it where it runs.

    A task keeps its first current nodes (sorted) up to its count; the free
    nodes (sorted) then fill the remaining counts in task order.

    Raises:
        ValueError: The counts need more nodes than ``usable`` has.
    """
    if sum(counts.values()) > len(usable):
        raise ValueError(f"the plan needs {sum(counts.values())} nodes but only {len(usable)} are usable")
    allowed = set(usable)
    kept = {name: tuple(sorted(n for n in current.get(name, ()) if n in allowed))[:k] for name, k in counts.items()}
    taken = {n for nodes in kept.values() for n in nodes}
    free = [n for n in usable if n not in taken]
    out = {}
    at = 0
    for name, k in counts.items():
        extra = free[at: at + k - len(kept[name])]
        at += len(extra)
        out[name] = tuple(sorted(kept[name] + tuple(extra)))
    return out


def plan_sizes(problem: Problem, table: OneStepTable | DeferredTable | None = None,
               event: TableEvent | None = None) -> dict[str, int]:
    """The planner's sizes for ``problem``: from the one-step table when it holds ``event``, else solved.

    The coordinator (node units) and the simulator (GPU units) both re-plan through this.
    """
    if event is not None and table is not None:
        try:
            counts = dict(table.lookup(event).assignment)
        except KeyError:
            counts = None
        if counts is not None and set(counts) == {t.name for t in problem.tasks}:
            return counts
    return dict(solve(problem).assignment)


class DeferredTable:
    """A state's one-step table, built ahead in a thread (:meth:`build_in_background`), or never.

    Building the table solves one problem per one-step event (a node lost for each set of tasks on a node,
    a node joined, each task finished): 141 solves, 0.8 s, for 2,048 nodes and 100 tasks. The coordinator
    writes a plan first and builds the table for the next event afterwards; an event that comes while it
    is still being built, or for a state whose table was not built ahead (the states between the events
    of one step), is solved directly: one solve, the same sizes (the table only holds solves made ahead).
    A table serves one event, so building it on demand would cost every solve to answer one.

    Args:
        state: The state whose plan the table starts from.
    """

    def __init__(self, state: ClusterState) -> None:
        self._state = state
        self._lock = threading.Lock()
        self._table: OneStepTable | None = None

    def build(self) -> OneStepTable:
        """The table (built now if it is not yet; waits for a build in progress)."""
        with self._lock:
            if self._table is None:
                n = len(self._state.usable())
                self._table = OneStepTable(problem_of(self._state, self._state.tasks, n, frozenset(), horizon=n + 1), 1)
                self._state = None  # type: ignore[assignment] - (no reference kept to older states)
            return self._table

    def build_in_background(self) -> threading.Thread:
        """Build the table in a daemon thread; :meth:`lookup` does not wait for it meanwhile."""
        thread = threading.Thread(target=self.build, name="unicron-one-step-table", daemon=True)
        thread.start()
        return thread

    def lookup(self, event: TableEvent) -> Plan:
        """The plan for ``event`` (see :meth:`OneStepTable.lookup`).

        Raises:
            KeyError: Not precomputed, or the table is not built yet (solve directly).
        """
        table = self._table
        if table is None:
            raise KeyError(f"the one-step table is not built (yet): {event} is solved directly")
        return table.lookup(event)


def one_step_table(state: ClusterState) -> DeferredTable | None:
    """The one-step table from ``state``'s plan, in node units (T tabulated up to one node more), built on first use."""
    if state.plan is None:
        return None
    return DeferredTable(state)
