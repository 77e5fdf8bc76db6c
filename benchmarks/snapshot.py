"""What an in-memory snapshot costs the training step, measured side by side in one run (CPU, no GPU needed).

A training loop of a plain MLP whose state (float32 weights + AdamW's two
moments) is at least 700 MB, with a step of about 1 s, snapshots its state
with :class:`~unicron_elastic.strategy.snapshots.tiers.MemorySnapshot` into a
TCPStore hosted by another process (as an agent's snapshot server is), the
way ``unicron_megatron`` does under ``torchrun``. Blocks of 10 steps
alternate: in an "on" block the first step takes a snapshot (snapshots every
10 steps), in an "off" block none does. Printed:

* the extra time of the step that takes a snapshot (its median over the "on"
  blocks minus the median "off" step), against the time of one plain memory
  copy of the state into a kept buffer, measured in the same run
  (target: extra <= one copy + 50 ms);
* the median step of the "on" blocks against the "off" blocks
  (target: within 2 %);
* wall and CPU time (this process only: the writer's work is in another).

``--thread`` runs the same with the snapshot packed and uploaded by a thread
of the training process (the strategy's way before the snapshot writer), for
comparison. The training step uses ``--threads`` intra-op threads (default
1): on a 2-core machine that leaves a core to the writer and the store, as a
GPU node's spare cores are left while its GPUs compute. A target missed is
printed "NOT met", with "by less than this machine's spread between blocks"
when the miss is within the noise, and the script exits 1.

    python benchmarks/snapshot.py [--mb 720] [--step 1.0] [--blocks 4] [--threads 1] [--thread]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from _targets import NOT_MET, Verdicts, at_most, verdict  # (benchmarks/ is on the path: this script's folder)
from unicron_elastic.strategy.snapshots.tiers import MemorySnapshot

BLOCK = 10  # steps per block; a snapshot every BLOCK steps in the "on" blocks
STORE_SERVER = ("import sys, time, torch.distributed as dist; from datetime import timedelta; "
                "s = dist.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, "
                "timeout=timedelta(seconds=60)); print(s.port, flush=True); time.sleep(3600)")


def build(mb: int, width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """An MLP of ``width``-wide layers whose weights + AdamW moments take ``mb`` MB, AdamW's state created."""
    per_layer = width * width + width
    layers = max(1, round(mb * 1e6 / 12 / per_layer))  # float32 weights + two float32 moments: 12 bytes/parameter
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU())
                                  for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    return model, optimizer


def state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}


def state_bytes(state: dict) -> int:
    tensors = list(state["model"].values())
    tensors += [t for s in state["optimizer"]["state"].values() for t in s.values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def plain_copy(state: dict, into: list[torch.Tensor]) -> float:
    """Seconds to copy every tensor of ``state`` once into ``into`` (kept buffers of the same shapes)."""
    tensors = list(state["model"].values())
    tensors += [t for s in state["optimizer"]["state"].values() for t in s.values() if t.dim() > 0]
    if not into:
        into.extend(torch.empty_like(t) for t in tensors)
        for t in into:
            t.fill_(0)  # (first touch: pages mapped, as the snapshot's kept buffer is)
    start = time.perf_counter()
    for dst, src in zip(into, tensors):
        dst.copy_(src)
    return time.perf_counter() - start


def calibrate(model: torch.nn.Module, optimizer: torch.optim.Optimizer, width: int, target: float) -> int:
    """The batch whose whole step (forward, backward, AdamW) takes about ``target`` seconds."""
    batch = 64
    for _ in range(3):
        x = torch.randn(batch, width)
        step(model, optimizer, x)  # (the first steps are slow: pages of the moments and gradients first touched)
        start = time.perf_counter()
        step(model, optimizer, x)
        batch = max(1, round(batch * target / (time.perf_counter() - start)))
    return batch


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def timed(fn, *args) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn(*args)
    return time.perf_counter() - wall, time.process_time() - cpu


def run(args: argparse.Namespace) -> int:
    """Host the store, measure, print; returns the exit code (1: a target not met)."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    server = subprocess.Popen([sys.executable, "-c", STORE_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        worker = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        return measure(args, worker)
    finally:
        server.kill()
        server.wait()


def measure(args: argparse.Namespace, worker: dist.TCPStore) -> int:
    model, optimizer = build(args.mb, args.width)
    batch = calibrate(model, optimizer, args.width, args.step)  # (AdamW's moments exist from here)
    x = torch.randn(batch, args.width)
    size = state_bytes(state_of(model, optimizer, 0))
    snapshot = MemorySnapshot(worker, every=BLOCK, out_of_process=not args.thread)
    print(f"state: {size / 1e6:.0f} MB (weights + AdamW), batch {batch}, {args.threads} intra-op thread(s), "
          f"snapshot {'in a thread of the training process' if args.thread else 'by the writer process'}, "
          f"{os.cpu_count()} cores")
    snapshot.save(state_of(model, optimizer, 0))  # warm-up: the writer started, its buffer sized and touched
    snapshot.wait()
    for _ in range(2):
        step(model, optimizer, x)
    copies, kept = [], []
    on, off, taking, blocked, taken = [], [], [], [], []
    for block in range(2 * args.blocks):
        copies.append(plain_copy(state_of(model, optimizer, 0), kept))
        snapshots = block % 2 == 0
        for i in range(BLOCK):
            s = block * BLOCK + i
            if snapshots and i == 0:
                cost = timed(lambda: taken.append(snapshot.save(state_of(model, optimizer, s))))
                rest = timed(step, model, optimizer, x)
                blocked.append(cost[0])
                took = (cost[0] + rest[0], cost[1] + rest[1])
                taking.append(took)
            else:
                took = timed(step, model, optimizer, x)
            (on if snapshots else off).append(took)
        print(f"  block {block}: {'snapshot at its first step' if snapshots else 'no snapshot'}, "
              f"median step {statistics.median(t[0] for t in (on if snapshots else off)[-BLOCK:]):.3f} s")
    snapshot.close()
    code = report(copies, on, off, taking, blocked)
    print(f"snapshots taken: {sum(taken)} of {len(taken)} due (one is skipped while the previous is still sent)")
    return code


def report(copies: list[float], on: list[tuple[float, float]], off: list[tuple[float, float]],
           taking: list[tuple[float, float]], blocked: list[float]) -> int:
    """Print the table and the targets' verdicts from the measured times (seconds; ``(wall, cpu)`` pairs).

    Returns:
        1 when a target was not met, else 0 (the script's exit code).
    """
    copy = statistics.median(copies)
    rows = []
    for kind, index in (("wall", 0), ("cpu", 1)):
        plain = statistics.median(t[index] for t in off)
        with_snapshots = statistics.median(t[index] for t in on)
        extra = statistics.median(t[index] for t in taking) - plain
        longest = max(t[index] for t in on)
        rows.append((kind, plain, with_snapshots, with_snapshots / plain, extra, longest))
    print(f"\none plain copy of the state: {copy * 1e3:.0f} ms (median of {len(copies)})")
    print(f"{'time':<6}{'step, off':>12}{'step, every 10':>16}{'ratio':>8}{'snapshot step extra':>21}"
          f"{'longest step':>14}")
    for kind, plain, with_snapshots, ratio, extra, longest in rows:
        print(f"{kind:<6}{plain:>11.3f}s{with_snapshots:>15.3f}s{ratio:>8.3f}{extra * 1e3:>19.0f}ms{longest:>13.3f}s")
    _, plain, _, ratio, extra, _ = rows[0]
    save = statistics.median(blocked)
    spread = block_spread(off)
    print(f"\nthe step blocked in save() (the copy into the kept buffer, the hand-off): median {save * 1e3:.0f} ms, "
          f"longest {max(blocked) * 1e3:.0f} ms")
    print(f"snapshot-free blocks' medians differ by up to {spread * 100:.1f} % between blocks on this machine")
    verdicts = Verdicts()
    blocked_said = verdicts.note("blocked in save()", at_most(save, copy + 0.05))
    step_said = verdicts.note("whole snapshot step", noisy_verdict(extra - copy - 0.05, spread * plain))
    ratio_said = verdicts.note("median step with snapshots", noisy_verdict(abs(ratio - 1) - 0.02, spread))
    print(f"\ntarget: snapshot step's extra time <= one copy + 50 ms ({copy * 1e3 + 50:.0f} ms): "
          f"blocked in save() {save * 1e3:.0f} ms: {blocked_said}; "
          f"whole step vs the median step {extra * 1e3:.0f} ms: {step_said}")
    print(f"target: median step with snapshots every 10 within 2 % of off: {ratio:.3f}: {ratio_said}")
    return verdicts.exit_code()


def block_spread(steps: list[tuple[float, float]]) -> float:
    """How far the medians of the blocks of ``steps`` lie apart, relative to their median (wall time)."""
    medians = [statistics.median(t[0] for t in steps[i : i + BLOCK]) for i in range(0, len(steps), BLOCK)]
    return (max(medians) - min(medians)) / statistics.median(medians)


def noisy_verdict(over: float, noise: float) -> str:
    """``over``: by how much the figure misses its target (<= 0: met); ``noise``: this machine's spread, same unit.

    A miss is not met whatever its size; one smaller than the noise says so beside the verdict.
    """
    if over <= 0:
        return verdict(True)
    return f"{NOT_MET}, by less than this machine's spread between blocks" if over < noise else NOT_MET


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=720, help="state size (weights + AdamW moments), MB")
    parser.add_argument("--width", type=int, default=2048, help="MLP width")
    parser.add_argument("--step", type=float, default=1.0, help="seconds per training step (approximately)")
    parser.add_argument("--blocks", type=int, default=4, help="blocks of 10 steps with snapshots (and as many off)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of the training step")
    parser.add_argument("--thread", action="store_true", help="snapshot in a thread of the training process instead")
    sys.exit(run(parser.parse_args()))


if __name__ == "__main__":
    main()
