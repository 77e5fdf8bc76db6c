"""Tables and plots of simulation results."""

from __future__ import annotations

import json
from pathlib import Path

from unicron_elastic.sim.engine import Result
from unicron_elastic.sim.multitask import BASELINES, Comparison
from unicron_elastic.sim.trace import DAY, Trace

#: Accumulated-WAF ratios Unicron / baseline reported in the paper (section 7.5).
PAPER_RATIOS = {
    "trace-a": {"megatron": 1.2, "bamboo": 4.6, "oobleck": 3.7, "varuna": 4.8},
    "trace-b": {"megatron": 1.9, "bamboo": 4.8, "oobleck": 3.8, "varuna": 5.8},
}


def multitask_table(rows: list[Comparison]) -> str:
    """Markdown table of WAF (PFLOP/s) per case and strategy."""
    head = "| case | unicron | " + " | ".join(BASELINES) + " | unicron >= all |"
    lines = [head, "|" + " --- |" * (len(BASELINES) + 3)]
    for c in rows:
        best = all(c.unicron >= v - 1e-9 * abs(v) for v in c.baselines.values())
        cells = " | ".join(f"{c.baselines[k] / 1e15:.1f}" for k in BASELINES)
        lines.append(f"| {c.case} | {c.unicron / 1e15:.1f} | {cells} | {'yes' if best else 'NO'} |")
    return "\n".join(lines)


def trace_table(trace: Trace, results: dict[str, Result]) -> str:
    """Markdown table of accumulated WAF and the ratio Unicron / policy, beside the paper's."""
    unicron = results["unicron"].total
    paper = PAPER_RATIOS.get(trace.name, {})
    lines = [
        f"{trace.name}: {trace.gpus} GPUs, {trace.duration_s / DAY:.0f} days, failures {trace.counts()}",
        "",
        "| policy | accumulated WAF (weighted EFLOP) | Unicron / policy | paper |",
        "| --- | --- | --- | --- |",
    ]
    for key, res in results.items():
        ratio = unicron / res.total if res.total else float("inf")
        ref = f"{paper[key]:.1f}x" if key in paper else "-"
        lines.append(f"| {res.policy} | {res.total / 1e18:,.0f} | {ratio:.2f}x | {ref} |")
    return "\n".join(lines)


def save_json(path: Path, trace: Trace, results: dict[str, Result]) -> None:
    """Write the ratios and totals as JSON."""
    unicron = results["unicron"].total
    doc = {
        "trace": trace.name,
        "counts": trace.counts(),
        "accumulated_waf": {k: r.total for k, r in results.items()},
        "ratio_unicron_over": {k: unicron / r.total if r.total else None for k, r in results.items()},
        "paper": PAPER_RATIOS.get(trace.name, {}),
    }
    path.write_text(json.dumps(doc, indent=1))


def plot(path: Path, trace: Trace, results: dict[str, Result]) -> None:
    """PNG like the paper's figure exp-e2e-perf: GPUs, WAF and accumulated WAF over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_gpus, ax_waf, ax_acc) = plt.subplots(1, 3, figsize=(16, 4.2))
    first = next(iter(results.values()))
    days = [t / DAY for t in first.times] + [trace.duration_s / DAY]
    ax_gpus.step(days, first.gpus + [first.gpus[-1]], where="post", color="black")
    ax_gpus.set(title=f"{trace.name}: available GPUs", xlabel="day", ylabel="GPUs")
    # Unicron last and thicker: equal WAF values would otherwise hide it
    for key, res in sorted(results.items(), key=lambda kv: kv[0] == "unicron"):
        t = [x / DAY for x in res.times] + [trace.duration_s / DAY]
        style = {"label": res.policy, "linewidth": 2.2 if key == "unicron" else 1.2, "zorder": 3 if key == "unicron" else 2}
        ax_waf.step(t, [w / 1e15 for w in res.waf] + [res.waf[-1] / 1e15], where="post", **style)
        ax_acc.plot(t, [a / 1e18 for a in res.accumulated()], **style)
    ax_waf.set(title="WAF", xlabel="day", ylabel="weighted PFLOP/s")
    ax_acc.set(title="accumulated WAF", xlabel="day", ylabel="weighted EFLOP")
    ax_acc.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
