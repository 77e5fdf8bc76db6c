"""The planner of paper section 5: throughput model, cost model, solver, one-step table.

Pure computation (numpy); no etcd and no torch processes.
"""

from unicron_elastic.planner.cost_model import CostModel, PlannerError, PlanTask
from unicron_elastic.planner.onestep import Event, OneStepTable, UnknownNodeError
from unicron_elastic.planner.solver import Plan, Problem, evaluate, solve, solve_plain
from unicron_elastic.planner.throughput import (
    GPU_TYPES,
    MAX_GPUS,
    MODELS,
    Estimate,
    GpuType,
    GptModel,
    ParallelConfig,
    ThroughputModel,
    estimate,
    gpu_type,
    model,
)

__all__ = [
    "GPU_TYPES",
    "MAX_GPUS",
    "MODELS",
    "CostModel",
    "Estimate",
    "Event",
    "GpuType",
    "GptModel",
    "OneStepTable",
    "ParallelConfig",
    "Plan",
    "PlanTask",
    "PlannerError",
    "Problem",
    "ThroughputModel",
    "UnknownNodeError",
    "estimate",
    "evaluate",
    "gpu_type",
    "model",
    "solve",
    "solve_plain",
]
