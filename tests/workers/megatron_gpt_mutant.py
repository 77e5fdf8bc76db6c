"""``examples/megatron_gpt.py`` with one of the strategy's duties undone, to show the tests' tolerance catches it.

``python megatron_gpt_mutant.py MUTATION ARGS...`` with MUTATION one of:

* ``untied-sum``: the tied word embedding's gradients are not summed across the first and the last stage;
* ``shard-norm``: each shard is clipped by its own gradient norm (Lightning's clipping, left in place).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "examples"))

import megatron_gpt  # noqa: E402

from unicron_elastic.strategy import stage_sums  # noqa: E402
from unicron_elastic.strategy.lightning import UnicronMegatronStrategy  # noqa: E402


def main() -> None:
    mutation = sys.argv.pop(1)
    if mutation == "untied-sum":
        stage_sums.ReplicaSums.exchange = lambda self, reduced, *args: setattr(self, "_tied_sum", None)
    elif mutation == "shard-norm":
        bind = UnicronMegatronStrategy._bind_stages

        def keep_lightnings_clipping(self, module):  # type: ignore[no-untyped-def]
            plugin = self.precision_plugin
            own = plugin.clip_grad_by_norm
            bind(self, module)
            plugin.clip_grad_by_norm = own

        UnicronMegatronStrategy._bind_stages = keep_lightnings_clipping
    else:
        raise SystemExit(f"unknown mutation {mutation!r}")
    megatron_gpt.main()


if __name__ == "__main__":
    main()
