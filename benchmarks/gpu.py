"""The strategy on one accelerator against Lightning's ``ddp``: step time, snapshot cost, kill -> next step.

Lightning's demo ``lightning.pytorch.demos.Transformer`` (an ``nn.Transformer``
encoder-decoder language model), world size 1, synthetic tokens, AdamW:

* **step time** at each precision: ``strategy="unicron_megatron"``
  (``UnicronMegatronStrategy(micro_batch, global_batch)`` under
  ``unicron-run``) against ``Trainer(strategy="ddp",
  accumulate_grad_batches=global_batch // micro_batch)`` under ``torchrun``:
  the same model and initial weights, the same data, precision and
  micro-batches per step; runs alternated (ddp, unicron, ddp, unicron, ...).
  Per precision, side by side: the median step (wall time and the worker's
  CPU time) of each and the ratio unicron / ddp (target <= 1.05). Medians are
  over every step from step ``min(10, steps // 4)`` on, of every run pooled,
  measured end to end between consecutive optimizer-step ends (a Lightning
  callback); CPU time is the worker process's (every thread of it; not its
  child processes, such as a snapshot writer, nor the launcher's), the
  steadier figure on a small shared CPU. A third pair of columns compares
  the best runs (the lowest per-run median CPU time of each): a run slowed
  throughout by other work on the machine drops out. The comparison runs
  have no snapshots (``--compare-snapshot-every``); their cost is the next
  section;
* **snapshot cost** (one precision: ``bf16-mixed`` when measured, else the
  first): the strategy with an in-memory snapshot every 10 steps against
  snapshots off, runs alternated: median step of each, their ratio, the
  median of the snapshot steps (a snapshot is taken at the start of every
  step that is a multiple of 10), and the longest step of each run and which
  step it was;
* **kill -> next step**: one run with a snapshot every 5 steps whose only rank
  is SIGKILLed in the middle of step 12 (``unicron_elastic.testing.fail_at``):
  ``unicron-run`` restarts it, it resumes from the in-memory snapshot (in the
  agent, not the worker); printed: seconds from the kill to the restarted
  worker's training start, to its next completed step and to the completion
  of the killed step, and the step it resumed from (and where its state came
  from).

Sizes follow ``torch.cuda.is_available()``. On CUDA: the issue's setup, a
183 M-parameter Transformer (vocab 32,000, width 1024, 4+4 layers, FFN 4096,
16 heads), sequence 256, micro-batch 16, global batch 64 (4 micro-batches per
step), 40 steps, precisions ``32-true,bf16-mixed,16-mixed``, one run of each
(sized to finish within 8 minutes on one GPU; not yet timed on one). Without
CUDA the same comparison on the CPU with a small Transformer (vocab 2,000,
width 128, 2+2 layers, sequence 64, micro-batch 8, global batch 32, ~0.3 s
steps on one thread), 30 steps, 2 alternated runs of ``32-true,bf16-mixed``
(``16-mixed``: Lightning runs ``bf16-mixed`` instead on a CPU, so it is
skipped), about 5-6 minutes on 2 cores; workers get ``OMP_NUM_THREADS=1``
(``--threads``), which leaves the other core to the launchers. Every flag
overrides its default. It installs nothing. A run that fails (e.g. a
precision the strategy refuses) is reported with its error and the others
go on. The machine's load average is printed first and last: other work on
it shows in the step times. The script exits 1 when a ratio misses its target
or a compared run failed.

    python benchmarks/gpu.py [--steps 40] [--runs 2] [--precisions 32-true,bf16-mixed,16-mixed]
                             [--vocab 32000] [--ninp 1024] [--nhead 16] [--nhid 4096] [--layers 4] [--seq 256]
                             [--micro-batch 16] [--global-batch 64] [--threads 1] [--compare-snapshot-every 0]
                             [--skip-compare] [--skip-snapshot] [--skip-kill]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import lightning
import torch

from _targets import Verdicts, at_most, verdict  # (benchmarks/ is on the path: this script's folder)
from unicron_elastic.testing import fail_at, faults_env, kill_node

ROOT = Path(__file__).resolve().parent
WORKER = str(ROOT / "_gpu_worker.py")
BIN = os.path.dirname(sys.executable)
RUN_TIMEOUT = 300  # seconds per launched run (a stuck run is killed and reported)
SNAPSHOT_EVERY = 10  # snapshot-cost section
KILL_SNAPSHOT_EVERY, KILL_STEP, KILL_MICRO_BATCH = 5, 12, 1  # kill section: mid-step 12, snapshot of step 10
TARGET = 1.05

SIZES = {  # defaults by device: the setup on CUDA, a small model on the CPU
    "cuda": dict(steps=40, runs=1, precisions="32-true,bf16-mixed,16-mixed", vocab=32000, ninp=1024, nhead=16,
                 nhid=4096, layers=4, seq=256, micro_batch=16, global_batch=64, threads=0),
    "cpu": dict(steps=30, runs=2, precisions="32-true,bf16-mixed", vocab=2000, ninp=128, nhead=4, nhid=512,
                layers=2, seq=64, micro_batch=8, global_batch=32, threads=1),
}
MODEL_FLAGS = ("vocab", "ninp", "nhead", "nhid", "layers", "seq", "micro_batch", "global_batch", "threads")


class RunFailed(Exception):
    """A launched run did not finish its steps (the message says why)."""


@dataclass
class Run:
    """What one launched run left: its step records (every incarnation), summaries and fault log."""

    records: list[dict] = field(default_factory=list)
    summaries: list[dict] = field(default_factory=list)
    faults: list[dict] = field(default_factory=list)
    snapshots: tuple[int, int] = (0, 0)  # (taken, skipped: the writer was still sending the previous one)

    def steps(self) -> list[dict]:
        return [r for r in self.records if "event" not in r]

    def durations(self, first: int) -> list[tuple[int, float, float]]:
        """``(step, wall seconds, CPU seconds)`` of each step from ``first`` on, within one incarnation each."""
        rows, previous = [], None
        for record in self.steps():
            if (previous is not None and record["pid"] == previous["pid"] and record["step"] == previous["step"] + 1
                    and record["step"] >= first):
                rows.append((record["step"], record["t"] - previous["t"], record["cpu"] - previous["cpu"]))
            previous = record
        return rows


# -- launching -----------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, help="optimizer steps per run (CUDA 40, CPU 30)")
    parser.add_argument("--runs", type=int, help="alternated runs of each strategy per precision (CUDA 1, CPU 2)")
    parser.add_argument("--precisions", help="comma-separated (CUDA 32-true,bf16-mixed,16-mixed; CPU 32-true,bf16-mixed)")
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--ninp", "--width", dest="ninp", type=int, help="model width (d_model)")
    parser.add_argument("--nhead", type=int)
    parser.add_argument("--nhid", type=int, help="feed-forward width")
    parser.add_argument("--layers", type=int, help="encoder layers (and as many decoder layers)")
    parser.add_argument("--seq", type=int, help="tokens per sample")
    parser.add_argument("--micro-batch", type=int)
    parser.add_argument("--global-batch", type=int)
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS of the workers (0: unset; CPU default 1)")
    parser.add_argument("--compare-snapshot-every", type=int, default=0,
                        help="the strategy's snapshot_every in the step-time comparison (0: none; its default is 50)")
    parser.add_argument("--skip-compare", action="store_true", help="no step-time comparison")
    parser.add_argument("--skip-snapshot", action="store_true", help="no snapshot-cost section")
    parser.add_argument("--skip-kill", action="store_true", help="no kill -> next step section")
    args = parser.parse_args()
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    for name, value in SIZES[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.steps < 8 or args.runs < 1:
        parser.error("--steps must be >= 8 and --runs >= 1")
    if args.global_batch % args.micro_batch:
        parser.error(f"--global-batch {args.global_batch} is not a multiple of --micro-batch {args.micro_batch}")
    return args


def first_step(steps: int) -> int:
    """The first step a median counts: 10, or a quarter of the run when it is shorter than 40 steps."""
    return max(2, min(10, steps // 4))


def worker_command(which: str, args: argparse.Namespace, precision: str, out: Path, steps: int,
                   snapshot_every: int, restarts: bool = False) -> list[str]:
    """The launcher command of one run: ``unicron-run`` for the strategy, ``torchrun`` for ddp."""
    if which == "unicron":
        launcher = [os.path.join(BIN, "unicron-run"), "--standalone", "--nproc-per-node=1"]
        if restarts:
            launcher.append("--max-restarts=1")
    else:
        launcher = [os.path.join(BIN, "torchrun"), "--standalone", "--nproc-per-node=1"]
    flags = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in MODEL_FLAGS]
    return [*launcher, WORKER, which, f"--precision={precision}", f"--steps={steps}",
            f"--snapshot-every={snapshot_every}", *flags, f"--out={out}"]


def launch(which: str, args: argparse.Namespace, precision: str, steps: int | None = None,
           snapshot_every: int = 0, faults: list | None = None) -> Run:
    """Launch one run and read what it left.

    Raises:
        RunFailed: The launcher failed, timed out, or the worker did not reach ``steps``.
    """
    steps = steps or args.steps
    out = Path(tempfile.mkdtemp(prefix=f"unicron-gpu-{which}-"))
    env = dict(os.environ, PATH=BIN + os.pathsep + os.environ.get("PATH", ""))
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)  # (else Lightning's DDP sets cores // processes threads)
    if faults:
        env.update(faults_env(faults, str(out / "faults.log")))
    cmd = worker_command(which, args, precision, out, steps, snapshot_every, restarts=bool(faults))
    try:
        with open(out / "launcher.log", "w") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                code = proc.wait(timeout=RUN_TIMEOUT)
            except subprocess.TimeoutExpired:
                kill_node(proc.pid)
                proc.wait()
                raise RunFailed(f"timed out after {RUN_TIMEOUT} s") from None
        run = read_run(out)
        if code != 0 or not any(s.get("global_step") == steps for s in run.summaries):
            raise RunFailed(failure_text(out, code))
        return run
    finally:
        shutil.rmtree(out, ignore_errors=True)


def read_run(out: Path) -> Run:
    """The records of a finished run's folder."""
    def lines(path: Path) -> list[dict]:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

    log = (out / "launcher.log").read_text(errors="replace") if (out / "launcher.log").exists() else ""
    return Run(lines(out / "steps.jsonl"), [json.loads(p.read_text()) for p in sorted(out.glob("summary-*.json"))],
               lines(out / "faults.log"), (log.count("snapshot_saved"), log.count("snapshot_skipped")))


def failure_text(out: Path, code: int) -> str:
    """Why a run failed: the worker's exception (its last line) or the launcher's last lines."""
    error = out / "error.txt"
    if error.exists():
        lines = [line for line in error.read_text().splitlines() if line.strip()]
        last = next((line for line in reversed(lines) if not line.startswith((" ", "pid "))), lines[-1])
        return f"exit {code}: {last}"
    tail = (out / "launcher.log").read_text(errors="replace").strip().splitlines()[-5:]
    return f"exit {code}; launcher's last lines:\n      " + "\n      ".join(line[:300] for line in tail)


# -- reporting -----------------------------------------------------------------------


def median_ms(rows: list[tuple[int, float, float]], column: int) -> float:
    return statistics.median(r[column] for r in rows) * 1e3


def ratio_text(ours: float, base: float) -> str:
    return f"{ours / base:7.3f}" if base else "    n/a"


def header(args: argparse.Namespace) -> None:
    """Device, versions and the setup every section shares."""
    if args.device == "cuda":
        device = f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"
    else:
        device = f"CPU ({os.cpu_count()} cores), workers on {args.threads or 'default'} thread(s)"
    params = model_params(args)
    print(f"device: {device}; torch {torch.__version__}, Lightning {lightning.__version__}, python {sys.version.split()[0]}; "
          f"{load_text()}")
    print(f"model: lightning.pytorch.demos.Transformer, {params / 1e6:.1f} M parameters (vocab {args.vocab}, width "
          f"{args.ninp}, {args.layers}+{args.layers} layers, FFN {args.nhid}, {args.nhead} heads), AdamW; "
          f"sequence {args.seq}, micro-batch {args.micro_batch}, global batch {args.global_batch} "
          f"({args.global_batch // args.micro_batch} micro-batches per step), world size 1, {args.steps} steps per run; "
          f"medians from step {first_step(args.steps)}", flush=True)


def load_text() -> str:
    """The machine's load average (other work on it shows in the step times)."""
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def model_params(args: argparse.Namespace) -> int:
    from lightning.pytorch.demos import Transformer

    with torch.device("meta"):
        model = Transformer(vocab_size=args.vocab, ninp=args.ninp, nhead=args.nhead, nhid=args.nhid,
                            nlayers=args.layers)
    return sum(p.numel() for p in model.parameters())


def precisions_to_run(args: argparse.Namespace) -> list[str]:
    """The requested precisions, less those this device cannot run (with a note)."""
    kept = []
    for precision in [p.strip() for p in args.precisions.split(",") if p.strip()]:
        if precision == "16-mixed" and args.device == "cpu":
            print("note: 16-mixed skipped on the CPU (fp16 AMP is not supported there: Lightning would run "
                  "bf16-mixed instead)")
            continue
        kept.append(precision)
    return kept


# -- sections ------------------------------------------------------------------------


def compare(args: argparse.Namespace, precisions: list[str]) -> list[str]:
    """Step time, unicron vs ddp, runs alternated, at each precision; the table side by side.

    Returns:
        What missed its target or failed (empty: every target met).
    """
    first = first_step(args.steps)
    rows: dict[str, dict[str, list[list]]] = {p: {"ddp": [], "unicron": []} for p in precisions}
    failed: dict[str, dict[str, str]] = {p: {} for p in precisions}
    print(f"\n== step time: unicron_megatron (unicron-run; snapshot_every={args.compare_snapshot_every}) vs ddp "
          f"(torchrun, accumulate_grad_batches={args.global_batch // args.micro_batch}), {args.runs} alternated "
          f"run(s) per precision ==", flush=True)
    for precision in precisions:
        for run in range(args.runs):
            for which in ("ddp", "unicron"):
                if which in failed[precision]:
                    continue
                started = time.time()
                try:
                    result = launch(which, args, precision, snapshot_every=args.compare_snapshot_every)
                except RunFailed as exc:
                    failed[precision][which] = str(exc)
                    print(f"  {precision:10s} {which:8s} run {run + 1}: FAILED ({exc})", flush=True)
                    continue
                steps = result.durations(first)
                rows[precision][which].append(steps)
                print(f"  {precision:10s} {which:8s} run {run + 1}: median {median_ms(steps, 1):8.1f} ms wall, "
                      f"{median_ms(steps, 2):8.1f} ms CPU ({len(steps)} steps; {time.time() - started:.0f} s)",
                      flush=True)
    return print_table(rows, failed)


def ratio_verdicts(cpu: dict[str, float], best: dict[str, float], verdicts: Verdicts, precision: str) -> str:
    """The verdicts of unicron / ddp CPU time against :data:`TARGET`, pooled and best runs, in words."""
    return ", ".join(f"{name} {verdicts.note(f'{precision} {name}', at_most(ours / base, TARGET))}"
                     for name, ours, base in (("pooled", cpu["unicron"], cpu["ddp"]),
                                              ("best runs", best["unicron"], best["ddp"])))


def print_table(rows: dict[str, dict[str, list[list]]], failed: dict[str, dict[str, str]]) -> list[str]:
    """Per precision: each strategy's median step (wall, CPU) and the ratios unicron / ddp, side by side.

    Pooled: the median of every measured step of every run. Best runs: the
    lowest per-run median CPU time of each (a run slowed throughout by other
    work on the machine drops out).

    Returns:
        What missed its target or failed (empty: every target met).
    """
    verdicts = Verdicts()
    print(f"\n{'precision':11s}| {'wall ms: ddp':>12s} {'unicron':>8s} {'ratio':>7s} | {'CPU ms: ddp':>11s} "
          f"{'unicron':>8s} {'ratio':>7s} | {'best runs, CPU: ddp':>19s} {'unicron':>8s} {'ratio':>7s} | "
          f"CPU ratio <= {TARGET}")
    for precision, by in rows.items():
        if failed[precision] or not by["ddp"] or not by["unicron"]:
            why = "; ".join(f"{w} failed" for w in failed[precision]) or "no runs"
            print(f"{precision:11s}| {why}: {verdicts.note(f'{precision}: {why}', verdict(False))}")
            continue
        pooled = {w: [r for run in runs for r in run] for w, runs in by.items()}
        wall = {w: median_ms(p, 1) for w, p in pooled.items()}
        cpu = {w: median_ms(p, 2) for w, p in pooled.items()}
        best = {w: min(median_ms(run, 2) for run in runs) for w, runs in by.items()}
        said = ratio_verdicts(cpu, best, verdicts, precision)
        print(f"{precision:11s}| {wall['ddp']:12.1f} {wall['unicron']:8.1f} {ratio_text(wall['unicron'], wall['ddp'])} | "
              f"{cpu['ddp']:11.1f} {cpu['unicron']:8.1f} {ratio_text(cpu['unicron'], cpu['ddp'])} | "
              f"{best['ddp']:19.1f} {best['unicron']:8.1f} {ratio_text(best['unicron'], best['ddp'])} | {said}")
    print("(wall and CPU: medians of every measured step of every run pooled; per-run medians, wall/CPU ms:")
    for precision, by in rows.items():
        for which, runs in by.items():
            if runs:
                medians = ", ".join(f"{median_ms(r, 1):.1f}/{median_ms(r, 2):.1f}" for r in runs)
                print(f"   {precision:10s} {which:8s} {medians}")
    print(")", flush=True)
    return verdicts.missed


def snapshot_cost(args: argparse.Namespace, precision: str) -> None:
    """Median step with a snapshot every 10 steps against snapshots off (runs alternated); the longest steps."""
    first = first_step(args.steps)
    print(f"\n== snapshot cost: unicron_megatron at {precision}, snapshot_every={SNAPSHOT_EVERY} vs 0, "
          f"{args.runs} alternated run(s) of {args.steps} steps ==", flush=True)
    if args.steps <= SNAPSHOT_EVERY:
        print(f"  skipped: --steps must be above {SNAPSHOT_EVERY}")
        return
    runs: dict[int, list[list]] = {0: [], SNAPSHOT_EVERY: []}
    for run in range(args.runs):
        for every in (0, SNAPSHOT_EVERY):
            try:
                result = launch("unicron", args, precision, snapshot_every=every)
                steps = result.durations(first)
            except RunFailed as exc:
                print(f"  snapshot_every={every:2d} run {run + 1}: FAILED ({exc})", flush=True)
                return
            runs[every].append(steps)
            longest = max(steps, key=lambda r: r[1])
            print(f"  snapshot_every={every:2d} run {run + 1}: median {median_ms(steps, 1):8.1f} ms wall, "
                  f"{median_ms(steps, 2):8.1f} ms CPU; longest step {longest[0]}: {longest[1] * 1e3:.1f} ms; "
                  f"snapshots taken {result.snapshots[0]}, skipped {result.snapshots[1]}", flush=True)
    on = [r for run in runs[SNAPSHOT_EVERY] for r in run]
    off = [r for run in runs[0] for r in run]
    snap = [r for r in on if r[0] % SNAPSHOT_EVERY == 0]
    for name, column in (("wall", 1), ("CPU", 2)):
        a, b = median_ms(on, column), median_ms(off, column)
        print(f"median step ({name:4s}), snapshots every {SNAPSHOT_EVERY:2d} : {a:8.1f} ms   off: {b:8.1f} ms   "
              f"ratio {ratio_text(a, b)}")
    if snap:
        print(f"median of the snapshot steps ({', '.join(str(s) for s in sorted({r[0] for r in snap}))}): "
              f"{median_ms(snap, 1):8.1f} ms wall, {median_ms(snap, 2):8.1f} ms CPU")
    for every, name in ((SNAPSHOT_EVERY, "with snapshots"), (0, "snapshots off ")):
        for i, steps in enumerate(runs[every]):
            step, wall, cpu = max(steps, key=lambda r: r[1])
            print(f"longest step, {name} run {i + 1}: step {step:3d}: {wall * 1e3:8.1f} ms wall, {cpu * 1e3:8.1f} ms CPU"
                  + ("  (a snapshot step)" if every and step % every == 0 else ""))
    print(flush=True)


def kill_next_step(args: argparse.Namespace, precision: str) -> None:
    """The only rank SIGKILLed mid-step; unicron-run restarts it from the in-memory snapshot."""
    steps = max(KILL_STEP + 4, min(args.steps, KILL_STEP + 6))
    print(f"\n== kill -> next step: unicron_megatron at {precision}, snapshot every {KILL_SNAPSHOT_EVERY}, "
          f"rank 0 SIGKILLed before micro-batch {KILL_MICRO_BATCH} of step {KILL_STEP} ({steps} steps) ==", flush=True)
    fault = fail_at(rank=0, step=KILL_STEP, micro_batch=KILL_MICRO_BATCH)
    try:
        run = launch("unicron", args, precision, steps=steps, snapshot_every=KILL_SNAPSHOT_EVERY, faults=[fault])
    except RunFailed as exc:
        print(f"  FAILED ({exc})", flush=True)
        return
    if not run.faults:
        print("  the fault did not fire: no kill happened")
        return
    killed = run.faults[0]["time"]
    after = [r for r in run.steps() if r["t"] > killed]
    starts = [r for r in run.records if r.get("event") == "start" and r["t"] > killed]
    restarted = next((s for s in run.summaries if s["restarts"] > 0), None)
    last_before = max((r for r in run.steps() if r["t"] <= killed), key=lambda r: r["t"], default=None)
    if last_before is not None:
        print(f"{'last step done before the kill':38s}: step {last_before['step']} "
              f"({(killed - last_before['t']) * 1e3:.0f} ms before it)")
    if starts:
        print(f"{'kill -> restarted worker trains':38s}: {starts[0]['t'] - killed:8.2f} s   "
              f"(its loop starts at step {starts[0]['step']})")
    if after:
        print(f"{'kill -> next completed step':38s}: {after[0]['t'] - killed:8.2f} s   (step {after[0]['step']})")
    redone = [r for r in after if r["step"] == KILL_STEP]
    if redone:
        print(f"{f'kill -> killed step {KILL_STEP} completed':38s}: {redone[0]['t'] - killed:8.2f} s")
    if restarted is not None:
        resumed = restarted.get("joined_at")
        print(f"{'resumed from':38s}: step {resumed}, state from {restarted.get('state_from')} "
              f"(the newest snapshot before the kill: step {KILL_STEP // KILL_SNAPSHOT_EVERY * KILL_SNAPSHOT_EVERY}, "
              f"if its upload had finished; not step 0); finished at step {restarted['global_step']}")
    else:
        print("the restarted worker left no summary")
    print(flush=True)


def main() -> int:
    args = parse_args()
    started = time.time()
    header(args)
    precisions = precisions_to_run(args)
    missed = compare(args, precisions) if not args.skip_compare and precisions else []
    one = "bf16-mixed" if "bf16-mixed" in precisions else (precisions[0] if precisions else "32-true")
    if not args.skip_snapshot:
        snapshot_cost(args, one)
    if not args.skip_kill:
        kill_next_step(args, one)
    print(f"total: {time.time() - started:.0f} s; {load_text()}")
    if missed:
        print("NOT met: " + "; ".join(missed))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
