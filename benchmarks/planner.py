"""Planner speed, measured side by side in one run.

Prints: the paper's O(m n^2) DP (``solve_plain``: every k for every (i, j),
vectorised with numpy, no Python loop over j or k) vs our candidate-size DP
on 64 tasks x 4096 GPUs (targets: ours <= 50 ms and >= 100x faster), the
one-step lookup time (target <= 1 ms), and how both grow with m and n.
Every case where both run must give the same optimum (value and assignment);
the benchmark stops with an error otherwise. It exits 1 when a target is not met.

    python benchmarks/planner.py [--quick]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from dataclasses import replace

from _targets import Verdicts, at_least, at_most  # (benchmarks/ is on the path: this script's folder)
from unicron_elastic.planner import (
    GPU_TYPES,
    MODELS,
    CostModel,
    OneStepTable,
    Plan,
    PlanTask,
    Problem,
    ThroughputModel,
    solve,
    solve_plain,
)


def make_problem(m: int, n: int, seed: int = 0) -> Problem:
    rng = random.Random(seed)
    cost = CostModel(ThroughputModel(GPU_TYPES["A800-80GB"]))
    names = list(MODELS)
    tasks = tuple(PlanTask(f"t{i}", MODELS[rng.choice(names)], weight=round(rng.uniform(0.5, 2.0), 2)) for i in range(m))
    return Problem(tasks, n, cost)


def timed(fn, repeat: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def same_optimum(fast: Plan, plain: Plan, case: str) -> None:
    """Stop the benchmark unless both DPs found the same optimum.

    Raises:
        SystemExit: The values differ by more than 1e-9 relative, or the assignments differ.
    """
    if not math.isclose(fast.value, plain.value, rel_tol=1e-9) or fast.assignment != plain.assignment:
        raise SystemExit(f"{case}: the DPs disagree: ours {fast.value!r} {fast.assignment} vs "
                         f"plain {plain.value!r} {plain.assignment}")


#: Targets: our DP at 64 tasks x 4096 GPUs (seconds), its speed-up over the paper's DP, one lookup (seconds).
SOLVE_TARGET_S, SPEEDUP_TARGET, LOOKUP_TARGET_S = 0.050, 100, 1e-3


def solve_verdicts(fast_s: float, ratio: float) -> tuple[str, str]:
    """The verdicts of our DP's time and of its speed-up over the paper's."""
    return at_most(fast_s, SOLVE_TARGET_S), at_least(ratio, SPEEDUP_TARGET)


def lookup_verdict(lookup_s: float) -> str:
    """The verdict of one one-step table lookup's time."""
    return at_most(lookup_s, LOOKUP_TARGET_S)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="skip the plain DP in the growth rows")
    args = parser.parse_args()

    problem = make_problem(64, 4096)
    solve(problem)  # warm the T(t, x) caches: both solvers then time only the DP
    solve_plain(problem)
    fast_t, fast = timed(lambda: solve(problem), 5)
    plain_t, plain = timed(lambda: solve_plain(problem), 3)
    same_optimum(fast, plain, "64 tasks x 4096 GPUs")
    ratio = plain_t / fast_t
    verdicts = Verdicts()
    solved, faster = solve_verdicts(fast_t, ratio)
    print("== 64 tasks x 4096 GPUs ==")
    print(f"O(m n^2) DP, numpy: {plain_t * 1e3:9.1f} ms")
    print(f"ours (candidates) : {fast_t * 1e3:9.1f} ms   target <= 50 ms: {verdicts.note('ours', solved)}")
    print(f"speed-up          : {ratio:9.0f}x   target >= 100x: {verdicts.note('speed-up', faster)}")
    print(f"same optimum      : True (value {fast.value:.6e}, same assignment; checked)")

    current = tuple(replace(t, current=fast.assignment[t.name]) for t in problem.tasks)
    start = time.perf_counter()
    table = OneStepTable(Problem(current, 4096, problem.cost), gpus_per_node=8)
    build = time.perf_counter() - start
    lookups = 100_000
    start = time.perf_counter()
    for i in range(lookups):
        table.on_node_lost(i % 512)
    lookup = (time.perf_counter() - start) / lookups
    print("\n== one-step table (64 tasks, 4096 GPUs, 8 per node) ==")
    print(f"plans precomputed : {len(table)} in {build:.2f} s")
    print(f"lookup            : {lookup * 1e6:9.2f} us   target <= 1 ms: "
          f"{verdicts.note('lookup', lookup_verdict(lookup))}")
    print(f"vs solving anew   : {fast_t / lookup:9.0f}x faster")

    print("\n== growth (plain: the numpy O(m n^2) DP; same optimum checked on every row) ==")
    print(f"{'m':>4} {'n':>6} {'ours ms':>9} {'plain ms':>10} {'ratio':>7}")
    for m, n in [(8, 512), (16, 512), (32, 512), (64, 512), (64, 1024), (64, 2048), (64, 4096), (128, 4096), (64, 8192)]:
        p = make_problem(m, n)
        solve(p)
        t_fast, ours = timed(lambda: solve(p), 3)
        plain_ms, ratio_x = "-", "-"
        if not args.quick:
            solve_plain(p)
            t_plain, reference = timed(lambda: solve_plain(p), 1)
            same_optimum(ours, reference, f"{m} tasks x {n} GPUs")
            plain_ms, ratio_x = f"{t_plain * 1e3:.0f}", f"{t_plain / t_fast:.0f}x"
        print(f"{m:>4} {n:>6} {t_fast * 1e3:>9.1f} {plain_ms:>10} {ratio_x:>7}")
    return verdicts.exit_code()


if __name__ == "__main__":
    sys.exit(main())
