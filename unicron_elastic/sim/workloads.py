"""The multi-task cases of the paper's Table tasks (six tasks on 128 GPUs)."""

from __future__ import annotations

from unicron_elastic.api import ConfigError
from unicron_elastic.planner.cost_model import PlanTask
from unicron_elastic.planner.throughput import model

_SIZES_A = ("7B",) * 6
_SIZES_B = ("1.3B", "1.3B", "1.3B", "7B", "7B", "13B")
_UNIFORM = (1.0,) * 6
_RISING = (0.5, 0.8, 1.1, 1.4, 1.7, 2.0)
_FALLING = (2.0, 1.7, 1.4, 1.1, 0.8, 0.5)

#: case -> (model sizes, weights), as in Table tasks.
CASES: dict[int, tuple[tuple[str, ...], tuple[float, ...]]] = {
    1: (_SIZES_A, _UNIFORM),
    2: (_SIZES_B, _UNIFORM),
    3: (_SIZES_A, _RISING),
    4: (_SIZES_B, _RISING),
    5: (_SIZES_B, _FALLING),
}


def case_tasks(case: int) -> tuple[PlanTask, ...]:
    """The six tasks of a case (names ``task1``..``task6``).

    Raises:
        ConfigError: ``case`` is not 1..5.
    """
    if case not in CASES:
        raise ConfigError(f"case {case!r} is not one of {sorted(CASES)}")
    sizes, weights = CASES[case]
    return tuple(PlanTask(f"task{i + 1}", model(s), weight=w) for i, (s, w) in enumerate(zip(sizes, weights)))
