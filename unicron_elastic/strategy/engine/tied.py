"""Weights tied across pipeline stages, and which gradients the replica's norm counts: pure, no I/O.

megatron-core ties a language model's word embedding and output layer
(``share_embeddings_and_output_weights``). With pipeline parallelism the two
live on different stages: the first stage's word embedding is marked
``shared_embedding``, the last stage holds a copy of it as its output layer's
weight, marked ``shared`` and ``shared_embedding`` (megatron-core's
``LanguageModule.setup_embeddings_and_output_layer``). Megatron-LM's training
loop keeps the copies equal by summing their gradients over the embedding group
after the data-parallel reduce (``finalize_model_grads``); the engine does the
same, exchanging the two stages' reduced sums before the step's commit
(:class:`~unicron_elastic.strategy.engine.elastic_dp.ElasticDataParallel`).

The gradient norm of a replica counts every parameter once, as megatron-core's
``get_grad_norm_fp32`` does with ``param_is_not_shared`` and
``param_is_not_tensor_parallel_duplicate``: a ``shared`` copy is not counted,
and a parameter that every tensor-parallel rank holds whole (a layer norm, a
row-parallel layer's bias) only on tensor rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unicron_elastic.api import ConfigError


@dataclass(frozen=True)
class TiedWeight:
    """This rank's copy of a weight tied across stages.

    Attributes:
        index: Its position among the parameters the engine sums.
        peer_stage: The pipeline stage holding the other copy.
        first: This copy is the first stage's (its gradient is the sum's first term on both sides).
    """

    index: int
    peer_stage: int
    first: bool


def _marked(param: torch.nn.Parameter) -> tuple[bool, bool]:
    return bool(getattr(param, "shared_embedding", False)), bool(getattr(param, "shared", False))


def find_tied(params: list[torch.nn.Parameter], names: list[str], stage: int, stages: int) -> TiedWeight | None:
    """The weight of ``params`` tied across stages (megatron-core's marks), if any.

    Args:
        params: The parameters the engine sums, in its order.
        names: Their names (for the errors).
        stage: This rank's pipeline stage.
        stages: The pipeline's stages.

    Raises:
        ConfigError: A weight tied across stages that the strategy cannot keep
            tied: a marked weight on a middle stage (e.g. multi-token
            prediction's copy of the embedding), several on one stage, or a
            ``shared`` copy on the first stage.
    """
    if stages == 1:
        return None
    marked = [(i, *_marked(p)) for i, p in enumerate(params) if any(_marked(p))]
    if not marked:
        return None
    where = ", ".join(names[i] for i, _, _ in marked)
    first, last = stage == 0, stage == stages - 1
    if len(marked) > 1 or not (first or last):
        raise ConfigError(f"pipeline stage {stage} holds weights tied to another stage ({where}) that "
                          "unicron_megatron cannot keep tied: only the word embedding shared by the first and the "
                          "last stage is (share_embeddings_and_output_weights; not multi-token prediction)")
    index, _, shared = marked[0]
    if first and shared:
        raise ConfigError(f"the first pipeline stage holds {where} as a copy of a weight of another stage: "
                          "unicron_megatron keeps only the word embedding of the first stage tied to the last")
    return TiedWeight(index, stages - 1 if first else 0, first)


def counted_in_norm(param: torch.nn.Parameter, tensor_rank: int) -> bool:
    """Whether this rank counts ``param`` in the replica's gradient norm (each parameter once)."""
    if getattr(param, "shared", False):  # a copy of another stage's weight: counted there
        return False
    return bool(getattr(param, "tensor_model_parallel", False)) or tensor_rank == 0


def norm_ranges(params: list[torch.nn.Parameter], tensor_rank: int,
                skip: frozenset[int] | set[int] = frozenset()) -> list[tuple[int, int]]:
    """``(start, end)`` in the flat gradient sum of the parameters this rank counts in the norm (merged).

    ``skip``: the positions of parameters left out (the tied weight and the gradients summed over the tensor
    group, whose sums are counted apart).
    """
    ranges: list[tuple[int, int]] = []
    offset = 0
    for i, p in enumerate(params):
        end = offset + p.numel()
        if i not in skip and counted_in_norm(p, tensor_rank):
            if ranges and ranges[-1][1] == offset:
                ranges[-1] = (ranges[-1][0], end)
            else:
                ranges.append((offset, end))
        offset = end
    return ranges


def squared_norm(flat: torch.Tensor, ranges: list[tuple[int, int]]) -> float:
    """The sum of squares of ``flat``'s elements in ``ranges``, accumulated in float64."""
    total = torch.zeros((), dtype=torch.float64, device=flat.device)
    for start, end in ranges:
        segment = flat[start:end].to(torch.float64)
        total += torch.dot(segment, segment)
    return float(total)
