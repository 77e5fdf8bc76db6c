"""``examples/megatron_gpt.py`` with one of the strategy's duties undone (or a fault), to show the tests catch it.

``python megatron_gpt_mutant.py MUTATION ARGS...`` with MUTATION one of:

* ``untied-sum``: the tied word embedding's gradients are not summed across the first and the last stage;
* ``shard-norm``: each shard is clipped by its own gradient norm (Lightning's clipping, left in place);
* ``tensor-unsummed``: the gradients megatron-core sums over the tensor group (sequence-parallel layer norms,
  q/k layer norms) are left as each tensor rank computed them;
* ``tokens-twice``: a micro-batch recomputed after a failure counts its tokens (and loss) twice in the step's
  totals, so the step divides by too many tokens;
* ``nan-loss:STEP:RANK``: not a mistake but a fault: rank RANK's loss of its first micro-batch of step STEP is NaN.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "examples"))

import megatron_gpt  # noqa: E402

from unicron_elastic.strategy.engine import stage_sums  # noqa: E402
from unicron_elastic.strategy.engine.elastic_dp import ElasticDataParallel  # noqa: E402
from unicron_elastic.strategy.lightning.megatron_strategy import UnicronMegatronStrategy  # noqa: E402


def _keep_lightnings_clipping() -> None:
    bind = UnicronMegatronStrategy._bind_model

    def keep(self, module):  # type: ignore[no-untyped-def]
        plugin = self.precision_plugin
        own = plugin.clip_grad_by_norm
        bind(self, module)
        plugin.clip_grad_by_norm = own

    UnicronMegatronStrategy._bind_model = keep


def _count_recomputed_twice() -> None:
    compute = ElasticDataParallel._compute

    def twice(self, effect):  # type: ignore[no-untyped-def]
        total = compute(self, effect)
        if effect.redo and self.gradients.extras:
            self.gradients.extras_of(total).mul_(2)
        return total

    ElasticDataParallel._compute = twice


def _nan_loss(step: int, rank: int) -> None:
    loss_func = megatron_gpt.GPTModule._loss_func
    poisoned: set[int] = set()

    def nan_once(self, loss_mask, output_tensor):  # type: ignore[no-untyped-def]
        loss, num_tokens, report = loss_func(self, loss_mask, output_tensor)
        if int(os.environ["RANK"]) == rank and self.trainer.global_step == step and step not in poisoned:
            poisoned.add(step)
            loss = loss * float("nan")
        return loss, num_tokens, report

    megatron_gpt.GPTModule._loss_func = nan_once


def main() -> None:
    mutation = sys.argv.pop(1)
    if mutation == "untied-sum":
        stage_sums.ReplicaSums.exchange = lambda self, reduced, *args: setattr(self, "_tied_sum", None)
    elif mutation == "shard-norm":
        _keep_lightnings_clipping()
    elif mutation == "tensor-unsummed":
        stage_sums.ReplicaSums.exchange_tensor = lambda self, *args: setattr(self, "_tensor_sum", None)
    elif mutation == "tokens-twice":
        _count_recomputed_twice()
    elif mutation.startswith("nan-loss:"):
        _, step, rank = mutation.split(":")
        _nan_loss(int(step), int(rank))
    else:
        raise SystemExit(f"unknown mutation {mutation!r}")
    megatron_gpt.main()


if __name__ == "__main__":
    main()
