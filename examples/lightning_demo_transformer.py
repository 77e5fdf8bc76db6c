"""Lightning's own demo model (``lightning.pytorch.demos.LightningTransformer``) under ``unicron_megatron``.

A third-party model, unchanged in its training code: its ``training_step``,
``forward`` (an ``nn.Transformer`` encoder-decoder with dropout) and SGD
optimizer are Lightning's. Only what cannot run here is replaced: the
``Transformer`` is built tiny (a few thousand parameters, so a step takes
milliseconds) and ``WikiText2`` (a download) by a deterministic synthetic token
stream. Run it under the Unicron agent, e.g. three ranks, killing rank 0 in
step 1 before its second micro-batch::

    unicron-run --standalone --nproc-per-node=3 examples/lightning_demo_transformer.py \
        --steps 5 --out /tmp/demo --kill-rank 0 --kill-step 1 --kill-micro-batch 3 --hold-for-joiner 3

The survivors finish step 1 without it; the agent restarts rank 0 alone, which
rejoins with the state of a replica. Each rank writes ``OUT/rank<R>.json``
(trained, joined_at, state_from, global_step, what each step did) and, if it trained,
``OUT/params<R>.pt``; a ``--kill-*`` placement the rank never reaches is refused at the start;
``--record-times`` adds ``OUT/times<R>.jsonl`` (when each step ended).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.demos import LightningTransformer, Transformer
from torch.utils.data import DataLoader, Dataset

from lightning_gpt import HoldForJoiner, SlowDown, StepTimes, kill_fault  # the example beside this one (same directory)
from unicron_elastic.strategy import UnicronMegatronStrategy  # also registers "unicron_megatron"
from unicron_elastic.testing import FAULTS_ENV, faults_env


class SyntheticTokens(Dataset):
    """WikiText2's ``(inputs, target)`` blocks over a deterministic token stream (no download).

    The stream follows ``x[t+1] = (5 * x[t] + c) mod V`` (V a power of two, c
    odd: no fixed point) with ``c`` changing every block, so there is something
    to learn; ``target`` is ``inputs`` shifted by one token, as in ``WikiText2``.
    """

    def __init__(self, samples: int = 192, block_size: int = 8, vocab: int = 32) -> None:
        generator = torch.Generator().manual_seed(7)
        tokens = [int(torch.randint(0, vocab, (1,), generator=generator))]
        for block in range(samples + 1):
            c = 2 * int(torch.randint(0, 3, (1,), generator=generator)) + 1
            for _ in range(block_size):
                tokens.append((tokens[-1] * 5 + c) % vocab)
        self.data = torch.tensor(tokens, dtype=torch.int64)
        self.samples, self.block_size, self.vocab_size = samples, block_size, vocab

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block_size
        return self.data[start : start + self.block_size], self.data[start + 1 : start + self.block_size + 1]


class DemoTransformer(LightningTransformer):
    """``LightningTransformer`` with a tiny ``Transformer`` and the synthetic data (its training code as shipped)."""

    def __init__(self, vocab: int = 32, ninp: int = 16, nhead: int = 2, nhid: int = 32, nlayers: int = 1,
                 micro_batch: int = 4) -> None:
        super().__init__(vocab_size=vocab)
        self.model = Transformer(vocab_size=vocab, ninp=ninp, nhead=nhead, nhid=nhid, nlayers=nlayers)
        self.vocab, self.micro_batch = vocab, micro_batch

    def prepare_data(self) -> None:
        """No download (``LightningTransformer`` fetches WikiText2 here)."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(SyntheticTokens(vocab=self.vocab), batch_size=self.micro_batch)


def build_parser() -> argparse.ArgumentParser:
    """This script's command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=24)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--bucket-numel", type=int, default=None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (slow demo)")
    parser.add_argument("--grad-dtype", choices=["float32", "float64"], default="float64",
                        help="gradient sums (float64: bit-identical to a failure-free run; the strategy's "
                             "default is float32)")
    parser.add_argument("--record-times", action="store_true", help="write OUT/times<R>.jsonl")
    parser.add_argument("--hold-for-joiner", type=int, default=None, metavar="STEP",
                        help="before STEP, wait (at most 120 s) until every rank is a member or asks to join")
    parser.add_argument("--kill-rank", type=int, default=None, help="SIGKILL this rank ...")
    parser.add_argument("--kill-step", type=int, default=1, help="... at this step ...")
    parser.add_argument("--kill-micro-batch", type=int, default=0, help="... before computing this micro-batch")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.kill_rank is not None and FAULTS_ENV not in os.environ:
        fault = kill_fault(parser, args.kill_rank, args.kill_step, args.kill_micro_batch, steps=args.steps,
                           world=int(os.environ.get("WORLD_SIZE", "1")),
                           micro_batches=args.global_batch // args.micro_batch)
        os.environ.update(faults_env([fault], str(args.out / "faults.log")))

    pl.seed_everything(0, verbose=False)
    model = DemoTransformer(micro_batch=args.micro_batch)
    rank = int(os.environ.get("RANK", "0"))
    args.out.mkdir(parents=True, exist_ok=True)
    callbacks: list[pl.Callback] = [SlowDown(args.step_time)] if args.step_time else []
    if args.record_times:
        callbacks.append(StepTimes(args.out / f"times{rank}.jsonl"))
    if args.hold_for_joiner is not None:
        callbacks.append(HoldForJoiner(args.hold_for_joiner))
    strategy = UnicronMegatronStrategy(
        global_batch=args.global_batch, micro_batch=args.micro_batch, bucket_numel=args.bucket_numel, seed=1,
        grad_dtype=getattr(torch, args.grad_dtype))
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", max_steps=args.steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0, callbacks=callbacks,
    )
    trainer.fit(model)
    trained = not strategy.finished_before_join  # a rank that came back after training ended holds no result
    summary = {"trained": trained, "joined_at": strategy.joined_at, "state_from": strategy.engine.handout.state_source,
               "pid": os.getpid(), "global_step": trainer.global_step, "reports": [vars(r) for r in strategy.reports]}
    (args.out / f"rank{rank}.json").write_text(json.dumps(summary))
    if trained:
        torch.save([p.detach() for p in model.parameters()], args.out / f"params{rank}.pt")


if __name__ == "__main__":
    main()
