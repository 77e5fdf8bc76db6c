"""Baseline for benchmarks/transition.py: the same TinyGPT under plain Lightning DDP.

Same global batch as the unicron run: each rank accumulates its micro-batches
(``accumulate_grad_batches``) and DDP all-reduces once per step. With
``--checkpoint-every N`` a ModelCheckpoint saves ``last.ckpt`` every N steps and
a restarted run (torchrun ``--max-restarts``) resumes from it: the plain
restart-all recovery. Faults fire at the same points as in the strategy
(``unicron_elastic.testing``). Step end times go to ``OUT/times<R>.jsonl``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch.distributed
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from lightning_gpt import StepTimes, TinyGPT, Tokens  # noqa: E402

from unicron_elastic.testing import maybe_fail  # noqa: E402


class Faults(pl.Callback):
    """Micro-batch i of this rank's accumulation is micro-batch i * world + rank (the strategy's deal)."""

    def __init__(self, accumulate: int) -> None:
        self.accumulate = accumulate

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: object, batch_idx: int) -> None:
        maybe_fail(trainer.global_rank, trainer.global_step,
                   micro_batch=(batch_idx % self.accumulate) * trainer.world_size + trainer.global_rank)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--global-batch", type=int, default=24)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    accumulate = args.global_batch // (args.micro_batch * world)
    pl.seed_everything(0, verbose=False)
    callbacks: list[pl.Callback] = [StepTimes(args.out / f"times{rank}.jsonl"), Faults(accumulate)]
    ckpt_dir = args.out / "ddp-ckpt"
    if args.checkpoint_every:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=args.checkpoint_every, save_last=True,
                                         save_top_k=0))
    trainer = pl.Trainer(strategy="ddp", accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                         max_steps=args.steps, accumulate_grad_batches=accumulate, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=bool(args.checkpoint_every), callbacks=callbacks)
    last = ckpt_dir / "last.ckpt"
    trainer.fit(TinyGPT(width=args.width), DataLoader(Tokens(), batch_size=args.micro_batch, shuffle=True),
                ckpt_path=str(last) if last.exists() else None)
    torch.distributed.destroy_process_group()  # else gloo aborts at interpreter exit


if __name__ == "__main__":
    main()
