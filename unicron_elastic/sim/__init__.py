"""Trace-driven cluster simulation that regenerates the paper's evaluation (section 7)."""

from unicron_elastic.sim.engine import POLICIES, Policy, Result, simulate
from unicron_elastic.sim.multitask import compare
from unicron_elastic.sim.trace import Failure, Trace, load_trace, save_trace, trace_a, trace_b
from unicron_elastic.sim.workloads import CASES, case_tasks

__all__ = [
    "CASES",
    "POLICIES",
    "Failure",
    "Policy",
    "Result",
    "Trace",
    "case_tasks",
    "compare",
    "load_trace",
    "save_trace",
    "simulate",
    "trace_a",
    "trace_b",
]
