"""A small GPT-style LightningModule trained with ``strategy="unicron_megatron"``.

Run it under the Unicron agent, e.g. three ranks on one machine, killing rank 2
in the middle of step 3 (its second micro-batch)::

    unicron-run --standalone --nproc-per-node=3 examples/lightning_gpt.py \
        --steps 6 --out /tmp/gpt --kill-rank 2 --kill-step 3 --kill-micro-batch 1

The survivors finish step 3 without it (they compute its micro-batches); the
agent restarts rank 2 alone, which rejoins at the next step with the state of
a replica. Each rank writes ``OUT/rank<R>.json`` (what each step did) and
``OUT/params<R>.pt``; rank 0 also saves ``OUT/final.ckpt`` with
``trainer.save_checkpoint`` and logs to ``OUT/logs`` (CSV).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, get_worker_info

from unicron_elastic.strategy import UnicronMegatronStrategy  # also registers "unicron_megatron"
from unicron_elastic.testing import FAULTS_ENV, faults_env, fail_at
from unicron_elastic.worker import get_worker


class Tokens(Dataset):
    """Deterministic sequences with structure to learn: x[t+1] = (a * x[t] + b) mod V."""

    def __init__(self, samples: int = 192, length: int = 16, vocab: int = 32, delay: float = 0.0,
                 record: Path | None = None) -> None:
        self.delay, self.record = delay, record
        generator = torch.Generator().manual_seed(7)
        starts = torch.randint(0, vocab, (samples,), generator=generator)
        steps = torch.randint(1, 4, (samples,), generator=generator)
        seq = [starts]
        for _ in range(length):
            seq.append((seq[-1] * 3 + steps) % vocab)
        self.data = torch.stack(seq, dim=1)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay:
            time.sleep(self.delay)  # a slow sample (decoding, augmentation...)
        if self.record is not None:  # who loaded it: "pid worker-id index" (worker id -1: the rank itself)
            info = get_worker_info()
            with open(self.record, "a") as f:
                f.write(f"{os.getpid()} {-1 if info is None else info.id} {i}\n")
        return self.data[i, :-1], self.data[i, 1:]


class TinyGPT(pl.LightningModule):
    """Token + position embeddings, causal transformer blocks, a language-model head."""

    def __init__(self, vocab: int = 32, width: int = 32, layers: int = 2, heads: int = 2, length: int = 16,
                 dropout: float = 0.1, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(length, width)
        block = nn.TransformerEncoderLayer(width, heads, 2 * width, dropout, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        hidden = self.tokens(x) + self.positions(torch.arange(length))
        mask = nn.Transformer.generate_square_subsequent_mask(length)
        return self.head(self.blocks(hidden, mask=mask, is_causal=True))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, prog_bar=False)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class SlowDown(pl.Callback):
    """Sleep after each step (so a demo's restarted rank has steps left to rejoin)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, *args: object) -> None:
        time.sleep(self.seconds)


class HoldForJoiner(pl.Callback):
    """Before step ``step``, wait (at most ``bound`` s) until ``ranks`` ranks are members or wait to join.

    A restarted rank (or a node started again, or one that grows the run) on a
    slow machine is then admitted before training ends. The wait is a
    declared, bounded pause for the hang detector. ``ranks``: default ``WORLD_SIZE``.
    """

    def __init__(self, step: int, bound: float = 120.0, ranks: int | None = None) -> None:
        self.step, self.bound, self.ranks = step, bound, ranks

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if trainer.global_step != self.step or engine is None or engine.pg is None:
            return
        world = self.ranks or int(os.environ.get("WORLD_SIZE", "1"))
        worker = get_worker()
        worker.set_paused(True, pause_for=self.bound)
        deadline = time.monotonic() + self.bound
        while len(set(engine.members) | set(engine.waiting())) < world and time.monotonic() < deadline:
            time.sleep(0.05)
        worker.set_paused(False)


class HoldUntil(pl.Callback):
    """Before step ``step``, wait (at most ``bound`` s) until the file ``path`` exists (a declared pause).

    Each waiting rank first touches ``<path>.waiting<RANK>``. Lets a test or a
    demo decide when a task may end, instead of racing it.
    """

    def __init__(self, step: int, path: Path, bound: float = 300.0) -> None:
        self.step, self.path, self.bound = step, path, bound

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step != self.step:
            return
        rank = os.environ.get("RANK", "0")
        self.path.with_name(f"{self.path.name}.waiting{rank}").touch()  # who waits, for whoever creates the file
        worker = get_worker()
        worker.set_paused(True, pause_for=self.bound)
        deadline = time.monotonic() + self.bound
        while not self.path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        worker.set_paused(False)


class StepTimes(pl.Callback):
    """Append ``{"step", "t"}`` per finished step to ``OUT/times<R>.jsonl`` (benchmarks)."""

    def __init__(self, path: Path) -> None:
        self.path, self.seen = path, -1

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step != self.seen:  # an optimizer step happened (not an accumulation batch)
            self.seen = trainer.global_step
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": trainer.global_step - 1, "t": time.time()}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--global-batch", type=int, default=24)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--bucket-numel", type=int, default=None)
    parser.add_argument("--snapshot-every", type=int, default=50)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (slow demo)")
    parser.add_argument("--width", type=int, default=32, help="model width")
    parser.add_argument("--grad-dtype", choices=["float32", "float64"], default="float64",
                        help="gradient sums (float64: bit-identical to a failure-free run; the strategy's "
                             "default is float32)")
    parser.add_argument("--record-times", action="store_true", help="write OUT/times<R>.jsonl")
    parser.add_argument("--hold-for-joiner", type=int, default=None, metavar="STEP",
                        help="before STEP, wait (at most 120 s) until every rank is a member or asks to join")
    parser.add_argument("--hold-ranks", type=int, default=None, metavar="N",
                        help="--hold-for-joiner waits for N ranks (default: WORLD_SIZE; more when nodes grow the run)")
    parser.add_argument("--hold-until", type=Path, default=None, metavar="FILE",
                        help="before step --hold-step, wait (at most 300 s) until FILE exists")
    parser.add_argument("--hold-step", type=int, default=0)
    parser.add_argument("--members", default=None, help="initial data-parallel ranks, e.g. 0,1 (default: all)")
    parser.add_argument("--schedule", default="{}", help='JSON {"step": [ranks]}: scale in/out at that step')
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes per rank")
    parser.add_argument("--load-delay", type=float, default=0.0, help="seconds each sample takes to load")
    parser.add_argument("--record-loads", action="store_true", help="append who loaded each sample to OUT/loads<R>.txt")
    parser.add_argument("--kill-rank", type=int, default=None, help="SIGKILL this rank ...")
    parser.add_argument("--kill-step", type=int, default=2, help="... at this step ...")
    parser.add_argument("--kill-micro-batch", type=int, default=0, help="... before computing this micro-batch")
    args = parser.parse_args()
    if args.kill_rank is not None and FAULTS_ENV not in os.environ:
        os.environ.update(faults_env([fail_at(args.kill_rank, args.kill_step, micro_batch=args.kill_micro_batch)],
                                     str(args.out / "faults.log")))

    pl.seed_everything(0, verbose=False)
    model = TinyGPT(width=args.width)
    rank = int(os.environ.get("RANK", "0"))
    args.out.mkdir(parents=True, exist_ok=True)
    callbacks: list[pl.Callback] = [SlowDown(args.step_time)] if args.step_time else []
    if args.record_times:
        callbacks.append(StepTimes(args.out / f"times{rank}.jsonl"))
    if args.hold_for_joiner is not None:
        callbacks.append(HoldForJoiner(args.hold_for_joiner, ranks=args.hold_ranks))
    if args.hold_until is not None:
        callbacks.append(HoldUntil(args.hold_step, args.hold_until))
    strategy = UnicronMegatronStrategy(
        global_batch=args.global_batch, micro_batch=args.micro_batch, bucket_numel=args.bucket_numel, seed=1,
        snapshot_every=args.snapshot_every, checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
        grad_dtype=getattr(torch, args.grad_dtype),
        members=[int(r) for r in args.members.split(",")] if args.members else None,
        schedule={int(k): v for k, v in json.loads(args.schedule).items()})
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", max_steps=args.steps, logger=pl.loggers.CSVLogger(args.out / "logs"),
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    data = Tokens(delay=args.load_delay, record=args.out / f"loads{rank}.txt" if args.record_loads else None)
    trainer.fit(model, DataLoader(data, batch_size=args.micro_batch, num_workers=args.num_workers,
                                  persistent_workers=args.num_workers > 0))
    trainer.save_checkpoint(args.out / "final.ckpt")
    summary = {"joined_at": strategy.joined_at, "state_from": strategy.engine.state_source, "pid": os.getpid(),
               "retired_at": strategy.retired_at, "fed": strategy.feed.fed if strategy.feed else 0,
               "on_demand": strategy.feed.on_demand if strategy.feed else 0,
               "global_step": trainer.global_step, "reports": [vars(r) for r in strategy.reports]}
    (args.out / f"rank{rank}.json").write_text(json.dumps(summary))
    torch.save([p.detach() for p in model.parameters()], args.out / f"params{rank}.pt")


if __name__ == "__main__":
    main()
