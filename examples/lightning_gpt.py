"""A small GPT-style LightningModule trained with ``strategy="unicron_megatron"``.

Run it under the Unicron agent, e.g. three ranks on one machine, killing rank 2
in the middle of step 3, before its second micro-batch (the 6 micro-batches of a
step are dealt round-robin: rank 2 computes micro-batches 2 and 5)::

    unicron-run --standalone --nproc-per-node=3 examples/lightning_gpt.py \
        --steps 6 --hold-for-joiner 5 --out /tmp/gpt --kill-rank 2 --kill-step 3 --kill-micro-batch 5

The survivors finish step 3 without it (they compute its micro-batches); the
agent restarts rank 2 alone, which rejoins at a step boundary with the state
of a replica (``--hold-for-joiner 5`` waits before step 5 until it is back).
A ``--kill-*`` placement the rank never reaches (a micro-batch it does not
compute at that step) is refused when the run starts. Each rank writes
``OUT/rank<R>.json`` (what each step did; ``"trained": false`` for a rank that
came back after training ended) and, if it trained, ``OUT/params<R>.pt``;
rank 0 also saves ``OUT/final.ckpt`` with ``trainer.save_checkpoint`` and logs
to ``OUT/logs`` (CSV). ``--val-every N`` validates on one batch every N steps
and records, per step, the float64 sum of the parameters it validated with
(``"validated"``).

With ``--tensor-parallel T`` / ``--pipeline-parallel P`` the model is
:class:`MegatronGPT`, built from megatron-core's parallel layers and split
into ``P`` stages; ``T x P`` consecutive ranks make one data-parallel replica.
Eight ranks, TP=2 x PP=2 x DP=2, killing rank 5 (replica 1, stage 0, tensor
rank 1) before its replica's second micro-batch of step 3 (replica 1 computes
micro-batches 1, 3 and 5)::

    unicron-run --standalone --nproc-per-node=8 examples/lightning_gpt.py --tensor-parallel 2 \
        --pipeline-parallel 2 --steps 8 --hold-for-joiner 6 --out /tmp/gpt3d \
        --kill-rank 5 --kill-step 3 --kill-micro-batch 3

Replica 0 computes replica 1's micro-batches; the agent restarts rank 5 and
its replica's three other ranks leave and rejoin (``--hold-for-joiner 6``
keeps the run open until they are back); each receives the state of its shard
from replica 0. ``OUT/shards<R>.pt`` holds each rank's parameters
by name with their tensor-parallel partition (to assemble the whole model).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, get_worker_info

from unicron_elastic.strategy import UnicronMegatronStrategy  # also registers "unicron_megatron"
from unicron_elastic.strategy.engine.microbatch import deal
from unicron_elastic.env import first_incarnation
from unicron_elastic.testing import FAULT_LOG_ENV, FAULTS_ENV, Fault, fail_at, faults_env
from unicron_elastic.worker import get_worker


class Tokens(Dataset):
    """Deterministic sequences with structure to learn: x[t+1] = (a * x[t] + b) mod V."""

    def __init__(self, samples: int = 192, length: int = 16, vocab: int = 32, delay: float = 0.0,
                 record: Path | None = None, deadlock_at: int | None = None) -> None:
        self.delay, self.record = delay, record
        self.deadlock_at, self.loads = deadlock_at, 0  # --deadlock-load: the N-th load of DataLoader worker 0
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
        info = get_worker_info()
        if self.deadlock_at is not None and info is not None and info.id == 0:
            self.loads += 1
            if self.loads == self.deadlock_at and first_incarnation():
                deadlock(self.loads)
        if self.delay:
            time.sleep(self.delay)  # a slow sample (decoding, augmentation...)
        if self.record is not None:  # who loaded it: "pid worker-id index" (worker id -1: the rank itself)
            info = get_worker_info()
            with open(self.record, "a") as f:
                f.write(f"{os.getpid()} {-1 if info is None else info.id} {i}\n")
        return self.data[i, :-1], self.data[i, 1:]


def deadlock(loads: int) -> None:
    """Deadlock this DataLoader worker (a lock taken twice), logged first in ``$UNICRON_FAULT_LOG`` as a fault."""
    path = os.environ.get(FAULT_LOG_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"rank": int(os.environ.get("RANK", "0")), "kind": "data_loader_deadlock",
                                "loads": loads, "pid": os.getpid(), "time": time.time()}) + "\n")
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()


def poisoned(module: pl.LightningModule, micro_batch: int | None) -> bool:
    """Whether this micro-batch's gradients are to be made infinite (``--inf-at``; recorded in ``OUT/inf.log``).

    ``module.inf_at`` is ``(step, micro_batch, log)`` on the rank it names; a
    micro-batch of None (a pipeline stage, which does not know its index)
    matches every micro-batch of the step.
    """
    inf_at = getattr(module, "inf_at", None)
    if inf_at is None or module.trainer.global_step != inf_at[0] or micro_batch not in (inf_at[1], None):
        return False
    with open(inf_at[2], "a") as f:
        f.write(json.dumps({"rank": int(os.environ.get("RANK", "0")), "step": inf_at[0], "micro_batch": micro_batch,
                            "restarts": int(os.environ.get("UNICRON_WORKER_RESTARTS", "0"))}) + "\n")
    return True


class ScaledFloat32(pl.plugins.MixedPrecision):
    """A loss scaler without autocast (``--precision 16-mixed-no-autocast``).

    The CPU stand-in for ``16-mixed`` around megatron-core's parallel layers,
    whose backward re-enters autocast for CUDA only: the loss scaling and the
    ranks' agreement on skipping a step are the same.
    """

    def autocast_context_manager(self) -> torch.autocast:
        return torch.autocast("cpu", enabled=False)


class LossRecord(pl.Callback):
    """This rank's loss of each step (the mean over its micro-batches), for ``OUT/rank<R>.json``."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *args: object) -> None:
        if outputs is not None:
            self.losses[trainer.global_step - 1] = float(outputs["loss"])


class ScaleRecord(pl.Callback):
    """The loss scale after each step (16-mixed), for ``OUT/rank<R>.json``."""

    def __init__(self) -> None:
        self.scales: dict[int, float] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        self.scales[trainer.global_step - 1] = trainer.precision_plugin.scaler.get_scale()


class TinyGPT(pl.LightningModule):
    """Token + position embeddings, causal transformer blocks, a language-model head."""

    poison = float("inf")  # what --inf-at multiplies the loss by (--poison)

    def __init__(self, vocab: int = 32, width: int = 32, layers: int = 2, heads: int = 2, length: int = 16,
                 dropout: float = 0.1, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(length, width)
        block = nn.TransformerEncoderLayer(width, heads, 2 * width, dropout, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        self.validated: dict[str, float] = {}  # (--val-every) step -> the parameters' float64 sum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        hidden = self.tokens(x) + self.positions(torch.arange(length))
        mask = nn.Transformer.generate_square_subsequent_mask(length)
        return self.head(self.blocks(hidden, mask=mask, is_causal=True))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, prog_bar=False)
        return loss * self.poison if poisoned(self, batch_idx) else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """(``--val-every``) The parameters validated with, as a float64 sum per step, and the loss."""
        self.validated[str(self.global_step)] = float(sum(p.detach().double().sum() for p in self.parameters()))
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten()))


class ParallelBlock(nn.Module):
    """A pre-norm transformer block from megatron-core's tensor-parallel layers.

    The attention's query/key/value projection is column-parallel with the
    heads laid out ``[head, q|k|v, head_dim]``, so each tensor-parallel rank
    holds whole heads; the output projection and the MLP's second layer are
    row-parallel. Built under ``torch.manual_seed(seed)``: the full weights are
    drawn and split (``use_cpu_initialization``), so the shards equal the
    slices of the same block built on one rank.
    """

    def __init__(self, config: Any, width: int, heads: int, dropout: float, seed: int) -> None:
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        tp = config.tensor_model_parallel_size
        if heads % tp or width % heads:
            raise ValueError(f"{heads} heads of width {width} cannot be split over {tp} tensor-parallel ranks")
        torch.manual_seed(seed)
        init = _normal(0.02)
        self.local_heads, self.head_dim = heads // tp, width // heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = ColumnParallelLinear(width, 3 * width, config=config, init_method=init, bias=True,
                                        gather_output=False)
        self.proj = RowParallelLinear(width, width, config=config, init_method=init, bias=True,
                                      input_is_parallel=True, skip_bias_add=False)
        self.fc1 = ColumnParallelLinear(width, 4 * width, config=config, init_method=init, bias=True,
                                        gather_output=False)
        self.fc2 = RowParallelLinear(4 * width, width, config=config, init_method=init, bias=True,
                                     input_is_parallel=True, skip_bias_add=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        qkv, _ = self.qkv(self.norm1(x))
        q, k, v = qkv.view(batch, length, self.local_heads, 3, self.head_dim).unbind(3)
        attention = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                               v.transpose(1, 2), is_causal=True)
        out, _ = self.proj(attention.transpose(1, 2).reshape(batch, length, self.local_heads * self.head_dim))
        x = x + self.dropout(out)
        hidden, _ = self.fc1(self.norm2(x))
        out, _ = self.fc2(nn.functional.gelu(hidden))
        return x + self.dropout(out)


def _normal(std: float) -> Any:
    return lambda tensor: nn.init.normal_(tensor, 0.0, std)


class MegatronGPT(pl.LightningModule):
    """TinyGPT's shape from megatron-core's parallel layers, in tensor-parallel shards and pipeline stages.

    ``configure_model()`` builds this rank's stage (``parallel_state`` is
    initialized by the strategy by then): stage 0 the embeddings, every stage
    ``layers / PP`` blocks, the last stage the final norm and the head. With
    PP = 1 ``training_step`` runs it; with PP > 1 the strategy calls
    ``pipeline_forward(batch, input_tensor)`` on each stage. Every layer is
    built under a seed of its own, so the model is the same whatever TP and PP.
    """

    poison = float("inf")  # what --inf-at multiplies a stage's gradients by (--poison)

    def __init__(self, vocab: int = 32, width: int = 32, layers: int = 2, heads: int = 2, length: int = 16,
                 dropout: float = 0.1, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.first = self.last = True

    def configure_model(self) -> None:
        from megatron.core import parallel_state
        from megatron.core.model_parallel_config import ModelParallelConfig
        from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding

        if hasattr(self, "blocks"):
            return
        h = self.hparams
        tp = parallel_state.get_tensor_model_parallel_world_size()
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        stage = parallel_state.get_pipeline_model_parallel_rank()
        if h.layers % pp:
            raise ValueError(f"{h.layers} layers cannot be split into {pp} pipeline stages")
        config = ModelParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     use_cpu_initialization=True, gradient_accumulation_fusion=False,
                                     params_dtype=torch.float32, pipeline_dtype=torch.float32)
        self.first, self.last = stage == 0, stage == pp - 1
        per_stage = h.layers // pp
        if self.first:
            torch.manual_seed(1)
            self.tokens = VocabParallelEmbedding(h.vocab, h.width, init_method=_normal(0.02), config=config)
            self.positions = nn.Embedding(h.length, h.width)
        self.blocks = nn.ModuleList(ParallelBlock(config, h.width, h.heads, h.dropout, seed=100 + stage * per_stage + i)
                                    for i in range(per_stage))
        if self.last:
            torch.manual_seed(2)
            self.norm = nn.LayerNorm(h.width)
            self.head = ColumnParallelLinear(h.width, h.vocab, config=config, init_method=_normal(0.02), bias=True,
                                             gather_output=False)  # (megatron-core's gathers call CUDA)

    def pipeline_forward(self, batch: tuple[torch.Tensor, torch.Tensor],
                         input_tensor: torch.Tensor | None) -> torch.Tensor:
        """This stage on one micro-batch: the activations for the next stage, or (last stage) the loss."""
        x, y = batch
        hidden = self.tokens(x) + self.positions(torch.arange(x.shape[1], device=x.device)) if self.first \
            else input_tensor
        if self.first and poisoned(self, None):  # this stage's gradients only: the other stages' stay finite
            hidden.register_hook(lambda grad: grad * self.poison)
        for block in self.blocks:
            hidden = block(hidden)
        if not self.last:
            return hidden
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        logits, _ = self.head(self.norm(hidden))  # this tensor-parallel rank's part of the vocabulary
        return vocab_parallel_cross_entropy(logits, y).mean()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.pipeline_forward(batch, None)  # PP = 1: one stage is the whole model

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Log the step's loss once per optimizer step: the mean over this rank's micro-batches (the last stage's).

        Not in ``pipeline_forward``: under ``unicron_megatron`` that runs once
        per micro-batch, each ``self.log`` call costs Lightning's metric
        bookkeeping, and the step's value would be its last micro-batch's
        (``benchmarks/transition.py --ab log`` measures the logging's cost).
        """
        if self.last and outputs is not None:
            self.log("train_loss", outputs["loss"], prog_bar=False)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def shard_parameters(module: nn.Module) -> dict[str, dict[str, Any]]:
    """This rank's parameters by name, with their tensor-parallel partition dimension (-1: replicated)."""
    return {name: {"tensor": p.detach().clone(),
                   "partition_dim": int(p.partition_dim) if getattr(p, "tensor_model_parallel", False) else -1}
            for name, p in module.named_parameters()}


class SlowDown(pl.Callback):
    """Sleep after each step (so a demo's restarted rank has steps left to rejoin)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, *args: object) -> None:
        time.sleep(self.seconds)


class HoldForJoiner(pl.Callback):
    """Before step ``step``, wait (at most ``bound`` s) until ``ranks`` ranks' replicas are members or wait to join.

    A restarted rank (or a node started again, or one that grows the run) on a
    slow machine is then admitted before training ends. The wait is a
    declared, bounded pause for the hang detector. ``ranks``: default ``WORLD_SIZE``.
    """

    def __init__(self, step: int, bound: float = 120.0, ranks: int | None = None) -> None:
        self.step, self.bound, self.ranks = step, bound, ranks

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if trainer.global_step != self.step or engine is None or not engine.groups.held:
            return
        world = (self.ranks or int(os.environ.get("WORLD_SIZE", "1"))) // engine.layout.size  # replicas
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
    """Append ``{"step", "t", "pid"}`` per finished step to ``OUT/times<R>.jsonl`` (benchmarks, tests)."""

    def __init__(self, path: Path) -> None:
        self.path, self.seen = path, -1

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step != self.seen:  # an optimizer step happened (not an accumulation batch)
            self.seen = trainer.global_step
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": trainer.global_step - 1, "t": time.time(), "pid": os.getpid()}) + "\n")


def add_kill_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--kill-*`` flags: one SIGKILL placed by rank, step and micro-batch (:func:`plan_kill`)."""
    parser.add_argument("--kill-rank", type=int, default=None, help="SIGKILL this rank ...")
    parser.add_argument("--kill-step", type=int, default=2, help="... at this step ...")
    parser.add_argument("--kill-micro-batch", type=int, default=0, help="... before computing this micro-batch")


def plan_kill(parser: argparse.ArgumentParser, args: argparse.Namespace, **shape: Any) -> None:
    """Put the fault the ``--kill-*`` flags place in the environment the strategy reads (once per job: a
    restarted rank inherits it), refused where it could never fire (:func:`kill_fault`, with ``shape``'s
    members and member schedule)."""
    if args.kill_rank is None or FAULTS_ENV in os.environ:
        return
    fault = kill_fault(parser, args.kill_rank, args.kill_step, args.kill_micro_batch, steps=args.steps,
                       world=int(os.environ.get("WORLD_SIZE", "1")),
                       micro_batches=args.global_batch // args.micro_batch,
                       replica_size=args.tensor_parallel * args.pipeline_parallel, **shape)
    os.environ.update(faults_env([fault], str(args.out / "faults.log")))


def kill_fault(parser: argparse.ArgumentParser, rank: int, step: int, micro_batch: int, *, steps: int, world: int,
               micro_batches: int, replica_size: int = 1, members: list[int] | None = None,
               member_schedule: dict[int, list[int]] | None = None) -> Fault:
    """The fault the ``--kill-*`` flags place, refused (a usage error) where it could never fire.

    At ``step`` the micro-batches ``0..micro_batches-1`` are dealt round-robin
    over the data-parallel members of that step (``members``, then
    ``member_schedule``; replicas of ``replica_size`` ranks); a rank computes its
    replica's share. A kill placed on a micro-batch the rank does not compute,
    at a step the run does not reach, or on a rank that does not exist would
    let the run end as if the fault had been tried.

    Raises:
        SystemExit: The placement cannot fire (``parser.error``: exit code 2, the reason on stderr).
    """
    if not 0 <= rank < world:
        parser.error(f"--kill-rank {rank}: the run has ranks 0..{world - 1}")
    if not 0 <= step < steps:
        parser.error(f"--kill-step {step}: the run trains steps 0..{steps - 1}")
    current = list(range(world // replica_size)) if members is None else list(members)
    for starts, planned in sorted((member_schedule or {}).items()):
        if starts <= step:
            current = list(planned)
    own = deal(micro_batches, current).get(rank // replica_size, [])
    if micro_batch not in own:
        parser.error(f"--kill-rank {rank} --kill-step {step} --kill-micro-batch {micro_batch} would never fire: at "
                     f"step {step} rank {rank} computes micro-batches {own} of 0..{micro_batches - 1} (dealt "
                     f"round-robin over the data-parallel members {current}); choose one of those")
    return fail_at(rank, step, micro_batch=micro_batch)


def build_parser() -> argparse.ArgumentParser:
    """This script's command line."""
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
    parser.add_argument("--member-schedule", default="{}", help='JSON {"step": [ranks]}: scale in/out at that step')
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes per rank")
    parser.add_argument("--load-delay", type=float, default=0.0, help="seconds each sample takes to load")
    parser.add_argument("--deadlock-load", type=int, nargs=2, default=None, metavar=("RANK", "N"),
                        help="DataLoader worker 0 of RANK deadlocks at its N-th sample (first incarnation only)")
    parser.add_argument("--collective-timeout", type=float, default=60.0,
                        help="the strategy's collective timeout, seconds")
    parser.add_argument("--record-loads", action="store_true", help="append who loaded each sample to OUT/loads<R>.txt")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="TP size (MegatronGPT)")
    parser.add_argument("--pipeline-parallel", type=int, default=1, help="PP size (MegatronGPT)")
    parser.add_argument("--megatron", action="store_true", help="MegatronGPT even with TP = PP = 1")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--pipeline-schedule", choices=["1f1b", "gpipe"], default="1f1b")
    parser.add_argument("--distributed-optimizer", action="store_true",
                        help="shard AdamW's state over the data-parallel ranks (Megatron-LM's distributed optimizer)")
    parser.add_argument("--optimizer-instances", type=int, default=1,
                        help="--distributed-optimizer: instances that each hold the whole state")
    parser.add_argument("--overlap-param-gather", action="store_true",
                        help="--distributed-optimizer: gather the updated parameters into the next step's forward")
    parser.add_argument("--ckpt-path", type=Path, default=None, help="resume from this checkpoint (Lightning's)")
    parser.add_argument("--val-every", type=int, default=None, metavar="STEPS",
                        help="validate on one batch every STEPS steps (TinyGPT; the summary's \"validated\")")
    parser.add_argument("--clip-grad", type=float, default=None, help="Lightning's gradient_clip_val (by norm)")
    parser.add_argument("--precision", default="32-true", help="Lightning's precision (16-mixed: a CPU GradScaler)")
    parser.add_argument("--init-scale", type=float, default=2.0**16, help="16-mixed: the GradScaler's initial scale")
    parser.add_argument("--inf-at", default=None, metavar="RANK:STEP:MB",
                        help="make this rank's gradients infinite in this micro-batch of this step (first incarnation)")
    parser.add_argument("--poison", choices=["inf", "nan"], default="inf",
                        help="what --inf-at multiplies the loss (or a stage's gradients) by")
    parser.add_argument("--preemption-checkpoint", type=Path, default=None, metavar="FILE",
                        help="on a stop (SIGTERM; SLURM's warning), write the step to FILE and requeue a SLURM job; "
                             "resume from FILE when it exists (docs/slurm.md)")
    add_kill_arguments(parser)
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    plan_kill(parser, args, members=[int(r) for r in args.members.split(",")] if args.members else None,
              member_schedule={int(k): v for k, v in json.loads(args.member_schedule).items()})

    pl.seed_everything(0, verbose=False)
    megatron = args.megatron or args.tensor_parallel * args.pipeline_parallel > 1
    model = (MegatronGPT(width=args.width, layers=args.layers, dropout=args.dropout) if megatron
             else TinyGPT(width=args.width, layers=args.layers, dropout=args.dropout))
    rank = int(os.environ.get("RANK", "0"))
    args.out.mkdir(parents=True, exist_ok=True)
    callbacks: list[pl.Callback] = [SlowDown(args.step_time)] if args.step_time else []
    precision: dict[str, Any] = {"precision": args.precision}
    scales, losses = ScaleRecord(), LossRecord()
    callbacks.append(losses)
    if args.precision.startswith("16-mixed"):  # (Lightning's "16-mixed" is for GPUs: a CPU scaler, as a plugin)
        scaler = torch.amp.GradScaler("cpu", init_scale=args.init_scale)
        kind = ScaledFloat32 if args.precision == "16-mixed-no-autocast" else pl.plugins.MixedPrecision
        precision = {"plugins": [kind("16-mixed", "cpu", scaler=scaler)]}
        callbacks.append(scales)
    if args.inf_at is not None:
        inf_rank, inf_step, inf_mb = (int(v) for v in args.inf_at.split(":"))
        if inf_rank == rank and os.environ.get("UNICRON_WORKER_RESTARTS", "0") == "0":
            model.inf_at = (inf_step, inf_mb, args.out / "inf.log")
            model.poison = float(args.poison)
    if args.record_times:
        callbacks.append(StepTimes(args.out / f"times{rank}.jsonl"))
    if args.hold_for_joiner is not None:
        callbacks.append(HoldForJoiner(args.hold_for_joiner, ranks=args.hold_ranks))
    if args.hold_until is not None:
        callbacks.append(HoldUntil(args.hold_step, args.hold_until))
    preempted = None
    if args.preemption_checkpoint is not None:
        from unicron_elastic.slurm.preemption import PreemptionCheckpoint

        preempted = PreemptionCheckpoint(args.preemption_checkpoint)
        callbacks.append(preempted)
    strategy = UnicronMegatronStrategy(
        global_batch=args.global_batch, micro_batch=args.micro_batch, bucket_numel=args.bucket_numel, seed=1,
        snapshot_every=args.snapshot_every, checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
        grad_dtype=getattr(torch, args.grad_dtype), tensor_model_parallel_size=args.tensor_parallel,
        pipeline_model_parallel_size=args.pipeline_parallel, pipeline_schedule=args.pipeline_schedule,
        members=[int(r) for r in args.members.split(",")] if args.members else None,
        member_schedule={int(k): v for k, v in json.loads(args.member_schedule).items()},
        timeout=timedelta(seconds=args.collective_timeout), distributed_optimizer=args.distributed_optimizer,
        optimizer_instances=args.optimizer_instances, overlap_param_gather=args.overlap_param_gather)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", max_steps=args.steps, logger=pl.loggers.CSVLogger(args.out / "logs"),
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
        callbacks=callbacks, gradient_clip_val=args.clip_grad, **precision,
        **({} if args.val_every is None else dict(val_check_interval=args.val_every, check_val_every_n_epoch=None,
                                                   limit_val_batches=1)),
    )
    deadlock_at = args.deadlock_load[1] if args.deadlock_load and args.deadlock_load[0] == rank else None
    data = Tokens(delay=args.load_delay, record=args.out / f"loads{rank}.txt" if args.record_loads else None,
                  deadlock_at=deadlock_at)
    validation = None if args.val_every is None else DataLoader(Tokens(samples=8), batch_size=args.micro_batch)
    trainer.fit(model, DataLoader(data, batch_size=args.micro_batch, num_workers=args.num_workers,
                                  persistent_workers=args.num_workers > 0), validation,
                ckpt_path=preempted.resume_path if preempted is not None else args.ckpt_path)
    trainer.save_checkpoint(args.out / "final.ckpt")  # (the strategy writes none for a rank that trained nothing)
    trained = not strategy.finished_before_join  # a rank that came back after training ended holds no result
    summary = {"trained": trained, "joined_at": strategy.joined_at, "state_from": strategy.engine.handout.state_source,
               "pid": os.getpid(),
               "retired_at": strategy.retired_at, "fed": strategy.feed.fed if strategy.feed else 0,
               "on_demand": strategy.feed.on_demand if strategy.feed else 0,
               "global_step": trainer.global_step, "reports": [vars(r) for r in strategy.reports],
               "forward_only": strategy.engine.computation.forward_only if strategy.engine else [],
               "scales": scales.scales, "precision_state": trainer.precision_plugin.state_dict(),
               "losses": losses.losses, "validated": getattr(model, "validated", {}), "environment": type(trainer.strategy.cluster_environment).__name__}
    (args.out / f"rank{rank}.json").write_text(json.dumps(summary))
    if not trained:
        return  # its parameters are untrained: not a result
    torch.save([p.detach() for p in model.parameters()], args.out / f"params{rank}.pt")
    if megatron:
        torch.save(shard_parameters(model), args.out / f"shards{rank}.pt")


if __name__ == "__main__":
    main()
