"""Run a benchmark worker with where-the-step-goes timers (``transition.py --only-tp --breakdown``).

``python _step_breakdown.py SCRIPT ARGS...`` runs SCRIPT as ``__main__`` with
wall-clock timers around the forward of each micro-batch, every backward, the
optimizer step and, under the strategy, the engine's reduction (the data-parallel
buckets, the commit over every rank, setting the gradients) and Lightning's
per-batch SIGTERM broadcast (0 under the strategy, which replaces it: the
step's exchange carries SIGTERM). Each timed call is written to
``$BREAKDOWN_OUT/calls<RANK>.json`` as ``[key, start, seconds]`` at exit.
Benchmark-only: it patches classes, which production code never does.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.optim import adam

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import lightning_gpt  # noqa: E402

CALLS: list[tuple[str, float, float]] = []
KEYS = {"forward": "forward of a micro-batch", "backward": "backward", "reduce": "data-parallel all-reduce",
        "commit": "commit over every rank", "set_grads": "setting p.grad", "sigterm": "Lightning's SIGTERM broadcast",
        "optimizer": "the optimizer's update"}


def _timed(owner: Any, name: str, key: str | Callable[..., str]) -> None:
    """Wrap ``owner.name`` so that each call is recorded under ``key`` (or ``key(*args)``)."""
    original = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.time()
        result = original(*args, **kwargs)
        CALLS.append((key(*args) if callable(key) else key, start, time.time() - start))
        return result

    setattr(owner, name, wrapper)


def _instrument_strategy() -> None:
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    from unicron_elastic.strategy.engine.reduction import StepReduction
    from unicron_elastic.strategy.lightning.megatron_strategy import UnicronMegatronStrategy

    _timed(UnicronMegatronStrategy, "_micro_batch_loss", "forward")
    _timed(StepReduction, "reduce", lambda reduction, effect: "commit"
           if effect.bucket == len(reduction.gradients.bounds) else "reduce")
    _timed(StepReduction, "set_gradients", "set_grads")
    _timed(_TrainingEpochLoop, "_broadcast_sigterm_tensor", "sigterm")


def _instrument_plain() -> None:
    from megatron.core import parallel_state

    _timed(lightning_gpt.MegatronGPT, "pipeline_forward", "forward")
    original = dist.all_reduce

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        start = time.time()
        result = original(tensor, *args, **kwargs)
        if kwargs.get("group") is parallel_state.get_data_parallel_group():  # not the tensor-parallel ones
            CALLS.append(("reduce", start, time.time() - start))
        return result

    dist.all_reduce = all_reduce


def main() -> None:
    script, sys.argv = sys.argv[1], sys.argv[1:]
    if script.endswith("lightning_gpt.py"):
        _instrument_strategy()
    else:
        _instrument_plain()
    _timed(torch.Tensor, "backward", "backward")
    _timed(adam, "adam", "optimizer")  # the update itself (Adam.step calls it; Lightning's closure runs before)
    out = Path(os.environ["BREAKDOWN_OUT"])
    atexit.register(lambda: (out / f"calls{os.environ.get('RANK', '0')}.json").write_text(json.dumps(CALLS)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
