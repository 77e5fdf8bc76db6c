"""megatron-core's ``GPTModel``, written as a Megatron-LM user writes it, trained with ``strategy="unicron_megatron"``.

The LightningModule builds ``GPTModel(config, layer_spec, vocab_size, max_sequence_length, pre_process,
post_process, share_embeddings_and_output_weights=True)`` in ``configure_model`` from ``parallel_state`` (the
strategy built the world by then) and gives the strategy its step in Megatron-LM's shape,
``forward_step(data_iterator, model) -> (output_tensor, loss_func)`` as in ``pretrain_gpt.py``. With pipeline
parallelism the strategy runs each stage through the model's ``set_input_tensor``, sums the tied word
embedding's gradients of the first and the last stage every step, and clips by the norm of the whole replica
(``--clip-grad``). Eight ranks, TP=2 x PP=2 x DP=2, killing rank 5 (replica 1, stage 0, tensor rank 1) before
its replica's first micro-batch of step 3 (replica 1 computes micro-batches 1, 3 and 5)::

    unicron-run --standalone --nproc-per-node=8 examples/megatron_gpt.py --tensor-parallel 2 \\
        --pipeline-parallel 2 --clip-grad 0.05 --steps 8 --hold-for-joiner 6 --out /tmp/megatron-gpt \\
        --kill-rank 5 --kill-step 3 --kill-micro-batch 1

On a CPU the layer spec's core attention is :class:`SdpaCoreAttention` (the stock ``DotProductAttention`` takes
its buffer from megatron-core's global memory buffer on the CUDA device), and the model is built with a process
group collection without the embedding group (megatron-core's constructor moves the tied weight to CUDA for
its initial all-reduce; the strategy makes the two copies equal itself). On a GPU the stock local spec and
megatron-core's own groups are used unchanged.

Each rank writes ``OUT/rank<R>.json`` (what each step did, the norm the gradients were clipped by;
``"trained": false`` for a rank that came back after training ended) and, if it trained, ``OUT/shards<R>.pt``:
its parameters by their name in the whole model (layers numbered globally), with their tensor-parallel
partition, so a test assembles the whole model from the shards.
"""

from __future__ import annotations

import argparse
import json
import os
import zlib
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_gpt import HoldForJoiner, LossRecord, SlowDown, Tokens, add_kill_arguments, plan_kill
from unicron_elastic.strategy import UnicronMegatronStrategy, run_forward_step  # also registers the strategy


def sdpa_core_attention() -> type:
    """megatron-core's ``DotProductAttention`` computed by ``scaled_dot_product_attention`` (causal, on any device)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SdpaCoreAttention(DotProductAttention):
        def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                    attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> Any:
            # [s, b, heads, head_dim] -> [b, heads, s, head_dim] and back to [s, b, heads * head_dim]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
            return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    return SdpaCoreAttention


def layer_spec(cpu: bool) -> Any:
    """megatron-core's local GPT layer spec; on a CPU with the core attention above."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec()
    if cpu:
        spec.submodules.self_attention.submodules.core_attention = sdpa_core_attention()
    return spec


def full_name(name: str, layer_offset: int) -> str:
    """A stage's parameter name in the whole model: its layers numbered from ``layer_offset``."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + layer_offset)
    return ".".join(parts)


def init_as_full_model(model: nn.Module, layer_offset: int, tied: bool, seed: int = 0) -> None:
    """Every matrix of this shard becomes its part of one whole model, drawn from a seed per name.

    So a stage, a tensor-parallel shard and the model on one rank start from the same weights, whatever the
    layout; the other parameters (norms, biases) are megatron-core's deterministic ones. With tied
    embeddings the last stage's output weight is drawn as the word embedding.
    """
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() < 2:
                continue
            whole = full_name(name, layer_offset)
            if tied and whole == "output_layer.weight":
                whole = "embedding.word_embeddings.weight"
            dim = int(p.partition_dim) if getattr(p, "tensor_model_parallel", False) else None
            shape = list(p.shape)
            if dim is not None:
                shape[dim] *= tp_size
            generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(whole.encode()))
            full = torch.empty(shape).normal_(0.0, 0.02, generator=generator)
            p.copy_(full if dim is None else full.narrow(dim, tp_rank * p.shape[dim], p.shape[dim]))


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``pretrain_gpt.py``'s: the micro-batch's summed token loss, its token count and what to report."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1)])}


class GPTModule(pl.LightningModule):
    """A Lightning wrapper of megatron-core's ``GPTModel``: built in ``configure_model``, run by ``forward_step``."""

    def __init__(self, vocab: int = 32, width: int = 32, layers: int = 4, heads: int = 4, length: int = 16,
                 lr: float = 0.1, optimizer: str = "sgd", tied: bool = True) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: nn.Module | None = None
        self.layer_offset = 0

    def configure_model(self) -> None:
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.transformer_config import TransformerConfig

        if self.model is not None:
            return
        h = self.hparams
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        config = TransformerConfig(
            num_layers=h.layers, hidden_size=h.width, num_attention_heads=h.heads,
            tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
            pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32, use_cpu_initialization=True,
            hidden_dropout=0.0, attention_dropout=0.0, gradient_accumulation_fusion=False)
        cpu = not torch.cuda.is_available()
        groups = None
        if cpu:  # megatron-core's initial all-reduce of the tied weight runs on CUDA: the strategy ties them itself
            groups = ProcessGroupCollection.use_mpu_process_groups()
            groups.embd = None
        self.layer_offset = parallel_state.get_pipeline_model_parallel_rank() * (h.layers // pp)
        self.model = GPTModel(config, layer_spec(cpu), h.vocab, h.length,
                              pre_process=parallel_state.is_pipeline_first_stage(),
                              post_process=parallel_state.is_pipeline_last_stage(),
                              share_embeddings_and_output_weights=h.tied, pg_collection=groups)
        init_as_full_model(self.model, self.layer_offset, h.tied)

    def forward_step(self, data_iterator: Any, model: nn.Module) -> tuple[torch.Tensor, Any]:
        """Megatron-LM's stage step: this micro-batch through this stage, and how its loss is taken."""
        tokens, labels = next(data_iterator)
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
        output = model(tokens, positions, None, labels=labels)  # (causal: the core attention's mask type)
        return output, partial(loss_func, torch.ones_like(labels))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """PP = 1 (and other strategies): the same ``forward_step``, its loss as the strategy takes it."""
        return run_forward_step(self.forward_step, batch, self.model)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.hparams.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class NormRecord(pl.Callback):
    """The gradient norm each step is clipped by (``OUT/rank<R>.json``'s ``"grad_norms"``), before clipping."""

    def __init__(self) -> None:
        self.norms: dict[int, float] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, *args: object) -> None:
        norm = trainer.strategy.grad_norm  # (None where one rank holds the whole model: Lightning's own norm)
        if norm is None:
            norm = torch.nn.utils.get_total_norm([p.grad for p in module.parameters() if p.grad is not None])
        self.norms[trainer.global_step] = float(norm)


def shard_parameters(module: GPTModule) -> dict[str, dict[str, Any]]:
    """This rank's parameters by their name in the whole model, with their tensor-parallel partition (-1: none)."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank() if parallel_state.model_parallel_is_initialized() else 0
    return {full_name(name, module.layer_offset): {
                "tensor": p.detach().clone(), "tp_rank": tp_rank, "name": name,
                "partition_dim": int(p.partition_dim) if getattr(p, "tensor_model_parallel", False) else -1}
            for name, p in module.model.named_parameters()}


def build_parser() -> argparse.ArgumentParser:
    """This script's command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--global-batch", type=int, default=24)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--bucket-numel", type=int, default=None)
    parser.add_argument("--tensor-parallel", type=int, default=1)
    parser.add_argument("--pipeline-parallel", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--clip-grad", type=float, default=None, help="clip by the global gradient norm")
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--untied", action="store_true", help="share_embeddings_and_output_weights=False")
    parser.add_argument("--grad-dtype", choices=["float32", "float64"], default="float64")
    parser.add_argument("--snapshot-every", type=int, default=50)
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (slow demo)")
    parser.add_argument("--hold-for-joiner", type=int, default=None, metavar="STEP",
                        help="before STEP, wait (at most 120 s) until every rank is a member or asks to join")
    parser.add_argument("--out", type=Path, required=True)
    add_kill_arguments(parser)
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    plan_kill(parser, args)
    pl.seed_everything(0, verbose=False)
    rank = int(os.environ.get("RANK", "0"))
    args.out.mkdir(parents=True, exist_ok=True)
    module = GPTModule(layers=args.layers, lr=args.lr, optimizer=args.optimizer, tied=not args.untied)
    losses, norms = LossRecord(), NormRecord()
    callbacks: list[pl.Callback] = [losses, norms]
    if args.step_time:
        callbacks.append(SlowDown(args.step_time))
    if args.hold_for_joiner is not None:
        callbacks.append(HoldForJoiner(args.hold_for_joiner))
    strategy = UnicronMegatronStrategy(
        global_batch=args.global_batch, micro_batch=args.micro_batch, bucket_numel=args.bucket_numel, seed=1,
        snapshot_every=args.snapshot_every, grad_dtype=getattr(torch, args.grad_dtype),
        tensor_model_parallel_size=args.tensor_parallel, pipeline_model_parallel_size=args.pipeline_parallel)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", max_steps=args.steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0, callbacks=callbacks,
        gradient_clip_val=args.clip_grad)
    trainer.fit(module, DataLoader(Tokens(), batch_size=args.micro_batch))
    trained = not strategy.finished_before_join  # a rank that came back after training ended holds no result
    summary = {"trained": trained, "joined_at": strategy.joined_at, "state_from": strategy.engine.state_source,
               "pid": os.getpid(),
               "global_step": trainer.global_step, "reports": [vars(r) for r in strategy.reports],
               "losses": losses.losses, "grad_norms": norms.norms}
    (args.out / f"rank{rank}.json").write_text(json.dumps(summary))
    if trained:
        torch.save(shard_parameters(module), args.out / f"shards{rank}.pt")


if __name__ == "__main__":
    main()
