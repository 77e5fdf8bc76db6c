"""One measured run for benchmarks/gpu.py: Lightning's demo ``Transformer`` under one strategy.

``unicron``: ``UnicronMegatronStrategy(micro_batch, global_batch, snapshot_every)``
(run it under ``unicron-run``); ``ddp``: ``Trainer(strategy="ddp",
accumulate_grad_batches=global_batch // micro_batch)`` (run it under
``torchrun``). Both build the same model from the same seed and read the same
synthetic tokens, at the same precision, micro-batch and global batch.

Each finished optimizer step appends ``{"step", "t", "cpu", "pid"}`` to
``OUT/steps.jsonl`` (``t``: ``time.time()``, after ``torch.cuda.synchronize()`` on
CUDA; ``cpu``: this process's CPU seconds, ``time.process_time()``, every
thread of it, children excluded); each
incarnation of the worker appends ``{"event": "start", ...}`` when training
starts and writes ``OUT/summary-<pid>.json`` when ``fit`` returns (unicron:
the step it joined at and where its state came from, after a restart). An
exception is written to ``OUT/error.txt`` (its traceback) before it propagates.
Faults come from ``$UNICRON_FAULTS`` (``unicron_elastic.testing.faults_env``),
fired by the strategy itself.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.demos import Transformer
from torch.utils.data import DataLoader, Dataset

from unicron_elastic.strategy import UnicronMegatronStrategy  # also registers "unicron_megatron"


class RandomTokens(Dataset):
    """``samples`` fixed blocks of random tokens (seeded): ``(inputs, target)``, target shifted by one."""

    def __init__(self, samples: int, seq: int, vocab: int, seed: int = 1) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab, (samples, seq + 1), generator=generator)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.tokens[index]
        return row[:-1], row[1:]


class BenchTransformer(pl.LightningModule):
    """``lightning.pytorch.demos.LightningTransformer``'s training step over a ``Transformer`` of the given size.

    (The demo module builds a fixed-size model and SGD; here the size is chosen
    and the optimizer is AdamW, whose state a snapshot carries.)
    """

    def __init__(self, vocab: int, ninp: int, nhead: int, nhid: int, layers: int, lr: float = 1e-4) -> None:
        super().__init__()
        self.model = Transformer(vocab_size=vocab, ninp=ninp, nhead=nhead, nhid=nhid, nlayers=layers)
        self.lr = lr

    def forward(self, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.model(inputs, target)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, target = batch
        output = self(inputs, target)
        return F.nll_loss(output, target.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=self.lr)


class StepClock(pl.Callback):
    """Appends one line per finished optimizer step (wall and process CPU time) to ``path``."""

    def __init__(self, path: Path) -> None:
        self.path, self.seen = path, -1

    def _write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.seen = trainer.global_step
        self._write({"event": "start", "step": trainer.global_step, "t": time.time(), "cpu": time.process_time(),
                     "pid": os.getpid(), "restarts": int(os.environ.get("UNICRON_WORKER_RESTARTS", "0") or 0)})

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step != self.seen:  # an optimizer step happened (not an accumulation batch)
            self.seen = trainer.global_step
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the step's kernels are done, not just queued
            self._write({"step": trainer.global_step - 1, "t": time.time(), "cpu": time.process_time(),
                         "pid": os.getpid()})


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("strategy", choices=["unicron", "ddp"])
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--ninp", type=int, default=1024)
    parser.add_argument("--nhead", type=int, default=16)
    parser.add_argument("--nhid", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--snapshot-every", type=int, default=50, help="unicron only (0: none)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args()


def trainer_for(args: argparse.Namespace, clock: StepClock) -> tuple[pl.Trainer, UnicronMegatronStrategy | None]:
    """The Trainer of this run (and the unicron strategy, None for ddp)."""
    common = dict(precision=args.precision, max_steps=args.steps, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=[clock],
                  accelerator="cuda" if torch.cuda.is_available() else "cpu", devices=1)
    if args.strategy == "ddp":
        return pl.Trainer(strategy="ddp", accumulate_grad_batches=args.global_batch // args.micro_batch,
                          **common), None
    strategy = UnicronMegatronStrategy(micro_batch=args.micro_batch, global_batch=args.global_batch,
                                       snapshot_every=args.snapshot_every, seed=0)
    return pl.Trainer(strategy=strategy, **common), strategy


def run(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = StepClock(args.out / "steps.jsonl")
    trainer, strategy = trainer_for(args, clock)
    pl.seed_everything(0, verbose=False)
    model = BenchTransformer(args.vocab, args.ninp, args.nhead, args.nhid, args.layers)
    data = DataLoader(RandomTokens(args.steps * args.global_batch, args.seq, args.vocab), batch_size=args.micro_batch)
    trainer.fit(model, data)
    summary = {"pid": os.getpid(), "global_step": trainer.global_step,
               "params": sum(p.numel() for p in model.parameters()),
               "restarts": int(os.environ.get("UNICRON_WORKER_RESTARTS", "0") or 0)}
    if strategy is not None:
        summary.update(joined_at=strategy.joined_at,
                       state_from=strategy.engine.handout.state_source if strategy.engine is not None else None)
    (args.out / f"summary-{os.getpid()}.json").write_text(json.dumps(summary))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # else gloo may abort at interpreter exit


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        run(args)
    except BaseException:
        with open(args.out / "error.txt", "a") as f:
            f.write(f"pid {os.getpid()}:\n{traceback.format_exc()}\n")
        raise


if __name__ == "__main__":
    main()
