"""megatron-core's ``GPTModel``, written as a Megatron-LM user writes it, trained with ``strategy="unicron_megatron"``.

The LightningModule builds ``GPTModel(config, layer_spec, vocab_size, max_sequence_length, pre_process,
post_process, ...)`` in ``configure_model`` from ``parallel_state`` (the strategy built the world by then) and
gives the strategy its step in Megatron-LM's shape, ``forward_step(data_iterator, model) -> (output_tensor,
loss_func)``, with ``pretrain_gpt.py``'s batch (``tokens``, ``labels``, ``loss_mask``, ``position_ids``,
``attention_mask``) and ``loss_func(loss_mask, output_tensor) -> (loss_sum, num_tokens, {"lm loss": ...})``.
With pipeline parallelism the strategy runs each stage through the model's ``set_input_tensor``, sums the tied
word embedding's gradients of the first and the last stage every step, and clips by the norm of the whole
replica (``--clip-grad``). Eight ranks, TP=2 x PP=2 x DP=2, killing rank 5 (replica 1, stage 0, tensor rank 1)
before its replica's first micro-batch of step 3 (replica 1 computes micro-batches 1, 3 and 5)::

    unicron-run --standalone --nproc-per-node=8 examples/megatron_gpt.py --tensor-parallel 2 \\
        --pipeline-parallel 2 --clip-grad 0.05 --steps 8 --hold-for-joiner 6 --out /tmp/megatron-gpt \\
        --kill-rank 5 --kill-step 3 --kill-micro-batch 1

``--llama`` turns on, at toy size, what Megatron-LM's Llama 3 8B recipe uses: RMSNorm, SwiGLU, rotary position
embeddings, grouped-query attention, untied embeddings, no biases, sequence parallelism (TP > 1), per-token
loss, gradient-accumulation fusion, AdamW without weight decay on norms and biases, clipping at 1.0 (and, on a
GPU, ``bf16-mixed``); ``--qk-layernorm`` adds Qwen3/OLMo 2-style q/k layer norms. ``--mask-fraction`` masks
about that fraction of the tokens (``loss_mask``) and ``--masked-micro-batch STEP J`` every token of micro-batch
``J`` of step ``STEP``::

    unicron-run --standalone --nproc-per-node=8 examples/megatron_gpt.py --llama --qk-layernorm \\
        --tensor-parallel 2 --pipeline-parallel 2 --dropout 0.1 --mask-fraction 0.33 --out /tmp/llama

``--distributed-optimizer`` shards the optimizer's state over the data-parallel ranks of each model-parallel
position (``--optimizer-instances I`` instances, each holding the whole state: a lost rank's share comes from
another one); the summary then also holds ``optimizer_state_bytes`` (this rank's, from the tensors) and
``parameters`` (those of its shard of the model).

What runs only on a GPU gets a CPU stand-in here, the rest is megatron-core's own code:

* the layer spec's core attention is :class:`SdpaCoreAttention` (the stock ``DotProductAttention`` takes its
  buffer from megatron-core's global memory buffer on the CUDA device);
* the model is built with a process group collection without the embedding group (megatron-core's constructor
  moves the tied weight to CUDA for its initial all-reduce; the strategy makes the two copies equal itself);
* with sequence parallelism the norms are torch's, with their parameters marked ``sequence_parallel`` as
  Transformer Engine's and Apex's fused norms mark them (:class:`SequenceParallelNorm`; megatron-core's
  ``WrappedTorchNorm`` refuses sequence parallelism), and megatron-core's sequence-parallel collectives, which
  allocate their buffers on ``torch.cuda.current_device()``, get the CPU as that device
  (:func:`cpu_as_current_device`);
* megatron-core's RNG tracker is :class:`CpuRNGStatesTracker`, the same streams on the CPU generator;
* gradient-accumulation fusion needs Apex's ``fused_weight_gradient_mlp_cuda`` kernel: on a CPU a module of that
  name must be importable (the tests put a stand-in that does the same arithmetic on ``PYTHONPATH``).

On a GPU the stock local spec, norms, tracker and megatron-core's own groups are used unchanged.

Each rank writes ``OUT/rank<R>.json`` (what each step did, the norm the gradients were clipped by, the logged
``train_loss`` and ``lm loss`` and its own micro-batches' ``(loss_sum, num_tokens)``; ``"trained": false`` for a
rank that came back after training ended; ``"error"`` when training stopped with one) and, if it trained,
``OUT/shards<R>.pt``: its parameters by their name in the whole model (layers numbered globally), with their
tensor-parallel partition, so a test assembles the whole model from the shards.
"""

from __future__ import annotations

import argparse
import json
import os
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_gpt import HoldForJoiner, LossRecord, SlowDown, Tokens, add_kill_arguments, plan_kill
from unicron_elastic.api import NonFiniteError
from unicron_elastic.strategy import UnicronMegatronStrategy, run_forward_step  # also registers the strategy
from unicron_elastic.strategy.engine.microbatch import GlobalBatchPlan

SEED = 1  # the strategy's seed (the global-batch shuffle and each micro-batch's random streams)


def sdpa_core_attention() -> type:
    """megatron-core's ``DotProductAttention`` computed by ``scaled_dot_product_attention`` (causal, on any device).

    Attention dropout is drawn inside megatron-core's RNG tracker (``model-parallel-rng``), as the stock one draws it.
    """
    from megatron.core import tensor_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SdpaCoreAttention(DotProductAttention):
        def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                    attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> Any:
            # [s, b, heads, head_dim] -> [b, heads, s, head_dim] and back to [s, b, heads * head_dim]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            if k.shape[1] != q.shape[1]:  # grouped-query attention: each key/value head serves a group of queries
                k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
            dropout = self.config.attention_dropout if self.training else 0.0
            with tensor_parallel.get_cuda_rng_tracker().fork() if dropout else _nothing():
                out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                                                 dropout_p=dropout)
            return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    return SdpaCoreAttention


@contextmanager
def _nothing() -> Iterator[None]:
    yield


class SequenceParallelNorm:
    """torch's ``LayerNorm``/``RMSNorm`` (as ``config.normalization`` says) with its parameters marked
    ``sequence_parallel`` as Transformer Engine's and Apex's norms mark them (CPU stand-in of those norms; a
    class, as megatron-core's specs take, like its ``WrappedTorchNorm``)."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> nn.Module:  # type: ignore[misc]
        norm_cls = nn.RMSNorm if config.normalization == "RMSNorm" else nn.LayerNorm
        norm = norm_cls(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


def layer_spec(cpu: bool, qk_layernorm: bool = False, normalization: str = "LayerNorm",
               sequence_parallel: bool = False) -> Any:
    """megatron-core's local GPT layer spec; on a CPU with the core attention above (and, with sequence
    parallelism, the norms above)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization=normalization)
    if cpu:
        attention = spec.submodules.self_attention.submodules
        attention.core_attention = sdpa_core_attention()
        if sequence_parallel:
            spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = SequenceParallelNorm
            if qk_layernorm:
                attention.q_layernorm = attention.k_layernorm = SequenceParallelNorm
    return spec


def block_spec(cpu: bool, layers: int, **layer: Any) -> Any:
    """This stage's ``layers`` layers and, on a CPU with sequence parallelism, the final norm above."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    spec = layer_spec(cpu, **layer)
    if cpu and layer.get("sequence_parallel"):
        return TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=SequenceParallelNorm)
    return spec


@contextmanager
def cpu_as_current_device() -> Iterator[None]:
    """Inside, ``torch.cuda.current_device()`` is the CPU (megatron-core's sequence-parallel collectives allocate
    their buffers there). Only for a CPU run: on a GPU nothing changes."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")
    try:
        yield
    finally:
        torch.cuda.current_device = original


def cpu_rng_tracker() -> None:
    """Put :class:`CpuRNGStatesTracker` in place of megatron-core's CUDA tracker (a CPU run only)."""
    from megatron.core.tensor_parallel import random as megatron_random

    class CpuRNGStatesTracker(megatron_random.CudaRNGStatesTracker):
        """megatron-core's tracker on the CPU generator: the same interface (``add``, ``fork``, ``get_states``...)."""

        def add(self, name: str, seed: int) -> None:
            if seed in self.seeds_ or name in self.states_:
                raise Exception(f"rng state {name} or seed {seed} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextmanager
        def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outside = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outside)

    megatron_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def full_name(name: str, layer_offset: int) -> str:
    """A stage's parameter name in the whole model: its layers numbered from ``layer_offset``."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + layer_offset)
    return ".".join(parts)


def init_as_full_model(model: nn.Module, layer_offset: int, tied: bool, gated: bool = False, seed: int = 0) -> None:
    """Every matrix of this shard becomes its part of one whole model, drawn from a seed per name.

    So a stage, a tensor-parallel shard and the model on one rank start from the same weights, whatever the
    layout; the other parameters (norms, biases) are megatron-core's deterministic ones. With tied
    embeddings the last stage's output weight is drawn as the word embedding. With SwiGLU (``gated``) the
    fused ``linear_fc1`` holds the gate and the up projection: each tensor rank holds its part of each, as
    megatron-core splits it (``linear_qkv`` is grouped by query group, so a plain split is right).
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
            full = torch.empty(shape, device="cpu").normal_(0.0, 0.02, generator=generator)  # (Lightning's context
            # makes the GPU the default device on a GPU run: the draw stays on the CPU generator)
            if dim is None:
                p.copy_(full)  # (copied to the parameter's device)
                continue
            # SwiGLU's linear_fc1 is [gate; up]: each tensor rank holds its part of each half
            parts = full.chunk(2, dim) if whole.endswith("mlp.linear_fc1.weight") and gated else [full]
            size = p.shape[dim] // len(parts)
            p.copy_(torch.cat([part.narrow(dim, tp_rank * size, size) for part in parts], dim))


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``pretrain_gpt.py``'s: the micro-batch's summed token loss, its token count and what to report."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    return loss, num_tokens, report


class MegatronTokens(Dataset):
    """:class:`Tokens` as Megatron-LM's GPT dataset gives them: ``tokens``, ``labels``, ``loss_mask``,
    ``position_ids``, ``attention_mask`` (causal, ``True`` where masked).

    ``mask_fraction`` of the tokens are masked out of the loss (a fixed pattern); ``masked`` samples entirely.
    """

    def __init__(self, mask_fraction: float = 0.0, masked: frozenset[int] = frozenset(), **tokens: Any) -> None:
        self.tokens = Tokens(**tokens)
        self.mask_fraction, self.masked = mask_fraction, masked

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, y = self.tokens[i]
        length = x.shape[0]
        if i in self.masked:
            loss_mask = torch.zeros(length)
        else:
            pattern = (torch.arange(length) * 7 + i * 3) % 100
            loss_mask = (pattern >= 100 * self.mask_fraction).float()
        causal = torch.triu(torch.ones(1, length, length, dtype=torch.bool), diagonal=1)
        return {"tokens": x, "labels": y, "loss_mask": loss_mask, "position_ids": torch.arange(length),
                "attention_mask": causal}


class GPTModule(pl.LightningModule):
    """A Lightning wrapper of megatron-core's ``GPTModel``: built in ``configure_model``, run by ``forward_step``."""

    def __init__(self, vocab: int = 32, width: int = 32, layers: int = 4, heads: int = 4, length: int = 16,
                 lr: float = 0.1, optimizer: str = "sgd", tied: bool = True, llama: bool = False,
                 qk_layernorm: bool = False, sequence_parallel: bool = False, per_token: bool = False,
                 fusion: bool = False, dropout: float = 0.0, weight_decay: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: nn.Module | None = None
        self.layer_offset = 0
        self.micro_batch_losses: dict[int, list[list[float]]] = {}  # this rank's (loss_sum, num_tokens) per step

    def configure_model(self) -> None:
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.transformer_config import TransformerConfig

        if self.model is not None:
            return
        h = self.hparams
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        llama = dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=nn.functional.silu,
                     add_bias_linear=False, num_query_groups=max(h.heads // 2, tp)) if h.llama else {}
        config = TransformerConfig(
            num_layers=h.layers, hidden_size=h.width, num_attention_heads=h.heads, tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32, use_cpu_initialization=True,
            hidden_dropout=h.dropout, attention_dropout=h.dropout, gradient_accumulation_fusion=h.fusion,
            sequence_parallel=h.sequence_parallel and tp > 1, qk_layernorm=h.qk_layernorm,
            calculate_per_token_loss=h.per_token, **llama)
        cpu = not torch.cuda.is_available()
        groups = None
        if cpu and h.tied:  # megatron-core's initial all-reduce of the tied weight runs on CUDA: the strategy ties
            groups = ProcessGroupCollection.use_mpu_process_groups()  # them itself
            groups.embd = None
        self.layer_offset = parallel_state.get_pipeline_model_parallel_rank() * (h.layers // pp)
        spec = block_spec(cpu, h.layers // pp, qk_layernorm=h.qk_layernorm, normalization=config.normalization,
                          sequence_parallel=config.sequence_parallel)
        self.model = GPTModel(config, spec, h.vocab, h.length,
                              pre_process=parallel_state.is_pipeline_first_stage(),
                              post_process=parallel_state.is_pipeline_last_stage(),
                              share_embeddings_and_output_weights=h.tied, pg_collection=groups,
                              position_embedding_type="rope" if h.llama else "learned_absolute")
        init_as_full_model(self.model, self.layer_offset, h.tied, gated=h.llama)

    def forward_step(self, data_iterator: Any, model: nn.Module) -> tuple[torch.Tensor, Any]:
        """Megatron-LM's stage step (``pretrain_gpt.py``): this micro-batch through this stage, and its loss."""
        batch = next(data_iterator)
        tokens, labels, loss_mask = batch["tokens"], batch["labels"], batch["loss_mask"]
        output_tensor = model(tokens, batch["position_ids"], batch["attention_mask"], labels=labels)
        return output_tensor, partial(self._loss_func, loss_mask)

    def _loss_func(self, loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """:func:`loss_func`, recording this rank's ``(loss_sum, num_tokens)`` of the step (read by the tests)."""
        loss, num_tokens, report = loss_func(loss_mask, output_tensor)
        record = self.micro_batch_losses.setdefault(self.trainer.global_step, [])
        record.append([float(loss.detach()), int(num_tokens)])
        return loss, num_tokens, report

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        """PP = 1 (and other strategies): the same ``forward_step``, its loss as the strategy takes it."""
        return run_forward_step(self.forward_step, batch, self.model)

    def model_numel(self) -> int:
        """The number of parameters this rank holds (its tensor-parallel and pipeline shard of the model)."""
        return sum(p.numel() for p in self.model.parameters())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """SGD with momentum, or AdamW without weight decay on norms and biases (Megatron-LM's rule: 1-D
        parameters are not decayed)."""
        if self.hparams.optimizer == "adamw":
            decayed = [p for p in self.parameters() if p.dim() > 1]
            kept = [p for p in self.parameters() if p.dim() <= 1]
            return torch.optim.AdamW([{"params": decayed, "weight_decay": self.hparams.weight_decay},
                                      {"params": kept, "weight_decay": 0.0}], lr=self.hparams.lr)
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class LoggedLoss(pl.Callback):
    """What the strategy logged for each step (``train_loss``, ``lm loss``), for ``OUT/rank<R>.json``."""

    def __init__(self) -> None:
        self.logged: dict[int, dict[str, float]] = {}
        self.device: str | None = None  # where the parameters were while training (Lightning moves them back after)

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: object) -> None:
        self.device = str(next(module.parameters()).device)
        metrics = trainer.callback_metrics
        self.logged[trainer.global_step - 1] = {k: float(metrics[k]) for k in ("train_loss", "lm loss") if k in metrics}


class NormRecord(pl.Callback):
    """The gradient norm each step is clipped by (``OUT/rank<R>.json``'s ``"grad_norms"``), before clipping."""

    def __init__(self) -> None:
        self.norms: dict[int, float] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, *args: object) -> None:
        norm = trainer.strategy.grad_norm  # (None where one rank holds the whole model: Lightning's own norm)
        if norm is None:
            norm = torch.nn.utils.get_total_norm([p.grad for p in module.parameters() if p.grad is not None])
        self.norms[trainer.global_step] = float(norm)


def optimizer_state_bytes(strategy: UnicronMegatronStrategy, trainer: pl.Trainer) -> int:
    """Bytes of optimizer state this rank holds, from the tensors (sharded: its shares' fp32 main parameters and
    their state; else the optimizer's state of the whole model's parameters)."""
    shards = strategy.engine.optimizer_shards
    if shards is not None:
        return shards.state_bytes()
    return sum(v.numel() * v.element_size() for state in trainer.optimizers[0].state.values()
               for v in state.values() if isinstance(v, torch.Tensor))


def shard_parameters(module: GPTModule) -> dict[str, dict[str, Any]]:
    """This rank's parameters by their name in the whole model, with their tensor-parallel partition (-1: none)
    and the number of parts each rank holds a piece of (2: SwiGLU's ``linear_fc1``, gate and up)."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank() if parallel_state.model_parallel_is_initialized() else 0
    gated = module.hparams.llama
    return {full_name(name, module.layer_offset): {
                "tensor": p.detach().clone(), "tp_rank": tp_rank, "name": name,
                "partition_dim": int(p.partition_dim) if getattr(p, "tensor_model_parallel", False) else -1,
                "chunks": 2 if gated and name.endswith("mlp.linear_fc1.weight") else 1}
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
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default=None, help="default: sgd (adamw: --llama)")
    parser.add_argument("--lr", type=float, default=None, help="default: 0.1 (0.01: --llama)")
    parser.add_argument("--untied", action="store_true", help="share_embeddings_and_output_weights=False")
    llama = parser.add_argument_group("Megatron-LM's Llama 3 recipe at toy size")
    llama.add_argument("--llama", action="store_true", help="RMSNorm, SwiGLU, RoPE, GQA, untied, no biases, sequence "
                       "parallelism (TP > 1), per-token loss, gradient-accumulation fusion, AdamW (weight decay 0.1, "
                       "none on norms and biases), clip 1.0, bf16-mixed on a GPU")
    llama.add_argument("--qk-layernorm", action="store_true", help="layer norms on queries and keys")
    for flag in ("sequence-parallel", "per-token-loss", "gradient-accumulation-fusion"):
        llama.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, default=None, help="default: --llama")
    llama.add_argument("--dropout", type=float, default=0.0, help="hidden and attention dropout")
    llama.add_argument("--mask-fraction", type=float, default=0.0, help="mask about this fraction of the tokens")
    llama.add_argument("--masked-micro-batch", type=int, nargs=2, default=None, metavar=("STEP", "J"),
                       help="mask every token of micro-batch J of STEP")
    parser.add_argument("--distributed-optimizer", action="store_true",
                        help="shard the optimizer's state over the data-parallel ranks (--use-distributed-optimizer)")
    parser.add_argument("--optimizer-instances", type=int, default=1,
                        help="--distributed-optimizer: instances that each hold the whole state")
    parser.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--precision", default=None, help="Lightning's precision (default: 32-true; bf16-mixed on a "
                        "GPU with --llama)")
    parser.add_argument("--grad-dtype", choices=["float32", "float64"], default="float64")
    parser.add_argument("--grad-reduce-in-bf16", action="store_true",
                        help="all-reduce every gradient bucket but the last in bfloat16")
    parser.add_argument("--snapshot-every", type=int, default=50)
    parser.add_argument("--checkin-timeout", type=float, default=10.0,
                        help="after a failure, how long survivors wait for a member that is alive but has not "
                             "checked in (the strategy's checkin_timeout)")
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (slow demo)")
    parser.add_argument("--hold-for-joiner", type=int, default=None, metavar="STEP",
                        help="before STEP, wait (at most 120 s) until every rank is a member or asks to join")
    parser.add_argument("--out", type=Path, required=True)
    add_kill_arguments(parser)
    return parser


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """The ``--llama`` preset's values where a flag was not given."""
    llama = args.llama
    for name in ("sequence_parallel", "per_token_loss", "gradient_accumulation_fusion"):
        if getattr(args, name) is None:
            setattr(args, name, llama)
    args.sequence_parallel = args.sequence_parallel and args.tensor_parallel > 1
    args.optimizer = args.optimizer or ("adamw" if llama else "sgd")
    args.lr = args.lr if args.lr is not None else (0.01 if llama else 0.1)
    if args.clip_grad is None and llama:
        args.clip_grad = 1.0
    if args.precision is None:
        args.precision = "bf16-mixed" if llama and args.accelerator == "gpu" else "32-true"
    args.untied = args.untied or llama
    return args


def dataset(args: argparse.Namespace) -> MegatronTokens:
    """The tokens, with ``--mask-fraction`` masked and every sample of ``--masked-micro-batch`` masked."""
    data = MegatronTokens(args.mask_fraction)
    if args.masked_micro_batch is not None:
        step, j = args.masked_micro_batch
        plan = GlobalBatchPlan(len(data), args.global_batch, args.micro_batch, SEED)
        data.masked = frozenset(plan.indices(step, j))
    return data


def main() -> None:
    parser = build_parser()
    args = resolve(parser.parse_args())
    plan_kill(parser, args)
    pl.seed_everything(0, verbose=False)
    rank = int(os.environ.get("RANK", "0"))
    args.out.mkdir(parents=True, exist_ok=True)
    if args.accelerator == "cpu":
        cpu_rng_tracker()
    module = GPTModule(layers=args.layers, lr=args.lr, optimizer=args.optimizer, tied=not args.untied,
                       llama=args.llama, qk_layernorm=args.qk_layernorm, sequence_parallel=args.sequence_parallel,
                       per_token=args.per_token_loss, fusion=args.gradient_accumulation_fusion, dropout=args.dropout,
                       weight_decay=0.1 if args.llama else 0.0)
    losses, norms, logged = LossRecord(), NormRecord(), LoggedLoss()
    callbacks: list[pl.Callback] = [losses, norms, logged]
    if args.step_time:
        callbacks.append(SlowDown(args.step_time))
    if args.hold_for_joiner is not None:
        callbacks.append(HoldForJoiner(args.hold_for_joiner))
    strategy = UnicronMegatronStrategy(
        global_batch=args.global_batch, micro_batch=args.micro_batch, bucket_numel=args.bucket_numel, seed=SEED,
        snapshot_every=args.snapshot_every, grad_dtype=getattr(torch, args.grad_dtype),
        grad_reduce_in_bf16=args.grad_reduce_in_bf16,
        checkin_timeout=args.checkin_timeout,
        tensor_model_parallel_size=args.tensor_parallel, pipeline_model_parallel_size=args.pipeline_parallel,
        distributed_optimizer=args.distributed_optimizer, optimizer_instances=args.optimizer_instances)
    trainer = pl.Trainer(
        strategy=strategy, accelerator=args.accelerator, devices=1, max_steps=args.steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
        callbacks=callbacks, gradient_clip_val=args.clip_grad, precision=args.precision)
    error = None
    try:
        with cpu_as_current_device():
            trainer.fit(module, DataLoader(dataset(args), batch_size=args.micro_batch))
    except NonFiniteError as exc:  # the parameters held are those of the steps before: written below, then raised
        error = exc
    trained = not strategy.finished_before_join  # a rank that came back after training ended holds no result
    summary = {"trained": trained, "joined_at": strategy.joined_at, "state_from": strategy.engine.handout.state_source,
               "pid": os.getpid(), "error": None if error is None else str(error),
               "global_step": trainer.global_step, "reports": [vars(r) for r in strategy.reports],
               "losses": losses.losses, "grad_norms": norms.norms, "logged": logged.logged, "device": logged.device,
               "micro_batch_losses": module.micro_batch_losses, "parameters": module.model_numel(),
               "optimizer_state_bytes": optimizer_state_bytes(strategy, trainer) if trained else None}
    (args.out / f"rank{rank}.json").write_text(json.dumps(summary))
    if trained:
        torch.save(shard_parameters(module), args.out / f"shards{rank}.pt")
    if error is not None:
        raise error


if __name__ == "__main__":
    main()
