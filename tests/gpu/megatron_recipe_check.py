"""The device check of Megatron-LM's recipe under ``unicron_megatron`` on a lent GPU (not collected by pytest).

Run from the repository root on a machine with one CUDA GPU, after installing the package::

    OUT=/tmp/check python tests/gpu/megatron_recipe_check.py

It checks what no CPU test can, and prints one JSON object (also written to ``$OUT/check.json``):

1. megatron-core's stock CUDA RNG tracker: unseeded, the ``fork`` the stock ``DotProductAttention`` enters fails
   ("model-parallel-rng is not added"); seeded and reseeded per micro-batch by the strategy's functions
   (``unicron_elastic.strategy.lightning.rng``) a micro-batch's draws are the same whoever draws them, and
   differ between tensor ranks;
2. ``examples/megatron_gpt.py --accelerator gpu --llama --qk-layernorm --dropout 0.1`` (the stock local spec:
   megatron-core's ``DotProductAttention`` with attention dropout inside the tracker, bf16-mixed, per-token
   loss, a loss mask with an all-masked micro-batch) trains under ``unicron-run`` (one rank), twice: the two
   runs' parameters and logged losses are compared; and once more with gradient-accumulation fusion through
   ``tests/stand_ins`` (Apex's kernel is not installed there), compared with the unfused run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

OUT = Path(os.environ.get("OUT", "/tmp/check"))
STAND_INS = str(Path(__file__).resolve().parent.parent / "stand_ins")


def tracker_checks() -> dict:
    from megatron.core.tensor_parallel import random as megatron_random

    from unicron_elastic.strategy.lightning.rng import megatron_tracker, micro_batch_rng, seed_tracker

    device = torch.device("cuda", 0)
    megatron_random.initialize_rng_tracker(force_reset=True)
    tracker = megatron_random.get_cuda_rng_tracker()
    try:
        with tracker.fork():
            pass
        unseeded = "no error"
    except Exception as exc:  # noqa: BLE001 - what megatron-core raises is the finding
        unseeded = f"{type(exc).__name__}: {exc}"
    assert megatron_tracker(device) is tracker
    seed_tracker(tracker, 1, tensor_rank=0)

    def draws(tensor_rank: int) -> torch.Tensor:
        with micro_batch_rng(42, device, tracker, tensor_rank), tracker.fork():
            return torch.rand(4, device=device).cpu()

    first = draws(0)
    with tracker.fork():
        torch.rand(1000, device=device)  # the stream moves on between micro-batches
    return {"unseeded_fork": unseeded, "same_micro_batch_same_draws": bool(torch.equal(first, draws(0))),
            "tensor_ranks_draw_differently": not bool(torch.equal(first, draws(1))),
            "tracker": type(tracker).__name__}


def train(name: str, *extra: str, stand_ins: bool = False) -> dict:
    out = OUT / name
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if stand_ins:
        env["PYTHONPATH"] = os.pathsep.join([STAND_INS, env.get("PYTHONPATH", "")])
    cmd = ["unicron-run", "--standalone", "--nproc-per-node=1", "examples/megatron_gpt.py", "--accelerator", "gpu",
           "--llama", "--qk-layernorm", "--dropout", "0.1", "--mask-fraction", "0.33", "--masked-micro-batch", "1",
           "2", "--steps", "6", "--out", str(out), *extra]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    (OUT / f"{name}.log").write_text(proc.stderr[-200_000:])
    result = {"rc": proc.returncode, "seconds": round(time.monotonic() - start, 1)}
    if proc.returncode == 0:
        summary = json.loads((out / "rank0.json").read_text())
        result["logged"] = summary["logged"]
        result["device_seen"] = summary.get("device")
    else:
        result["stderr_tail"] = proc.stderr[-2000:]
    return result


def largest_difference(a: str, b: str) -> float | None:
    try:
        x, y = torch.load(OUT / a / "shards0.pt"), torch.load(OUT / b / "shards0.pt")
    except FileNotFoundError:
        return None
    return max(float((x[n]["tensor"].float() - y[n]["tensor"].float()).abs().max()) for n in x)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    results["tracker"] = tracker_checks()
    results["run1"] = train("run1", "--no-gradient-accumulation-fusion")
    if os.environ.get("CHECK_TWICE"):
        results["run2"] = train("run2", "--no-gradient-accumulation-fusion")
        results["run1_vs_run2_largest_difference"] = largest_difference("run1", "run2")
    results["fused"] = train("fused", "--gradient-accumulation-fusion", stand_ins=True)
    results["run1_vs_fused_largest_difference"] = largest_difference("run1", "fused")
    finite = []
    for name in ("run1", "fused"):
        try:
            finite.append(all(torch.isfinite(v["tensor"]).all() for v in torch.load(OUT / name / "shards0.pt").values()))
        except FileNotFoundError:
            finite.append(None)
    results["finite"] = finite
    text = json.dumps(results, indent=1)
    (OUT / "check.json").write_text(text)
    print(text)
    sys.exit(0 if all(results[n]["rc"] == 0 for n in ("run1", "fused")) else 1)


if __name__ == "__main__":
    main()
