"""The engine's local gradient sum, in one process: autograd sums into it where the dtypes match.

With float32 sums of float32 parameters (the default) ``.grad`` is bound to the
sum during a step's computation, so autograd adds each micro-batch in place;
with float64 sums each micro-batch's ``.grad`` is added afterwards. Both must
give the sum the engine had before binding existed, bit for bit: ((0 + g0) + g1) + g2.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from unicron_elastic.strategy.engine import effects as E
from unicron_elastic.strategy.engine.elastic_dp import ElasticDataParallel, EngineOptions
from unicron_elastic.strategy.engine.microbatch import GlobalBatchPlan

MICRO = 3
DATA = torch.randn(MICRO * 2, 5, generator=torch.Generator().manual_seed(7))


class Tied(torch.nn.Module):
    """A parameter used twice in one forward (tied), one never used, one plain layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = torch.nn.Parameter(torch.randn(5, 5))
        self.head = torch.nn.Linear(5, 1)
        self.unused = torch.nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(x @ self.shared) @ self.shared.t()).pow(2).mean()


def engine(grad_dtype: torch.dtype, loss_fn=None, bucket_numel: int | None = None) -> ElasticDataParallel:
    model = Tied()
    return ElasticDataParallel(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               batch_plan=GlobalBatchPlan(len(DATA), 2 * MICRO, 2, seed=0), batch=lambda idx: DATA[idx],
                               loss_fn=loss_fn or (lambda m, b: m(b)), store=dist.HashStore(), rank=0, world_size=1,
                               options=EngineOptions(timeout=timedelta(seconds=30), grad_dtype=grad_dtype,
                                                     bucket_numel=bucket_numel))


def reference_sum(e: ElasticDataParallel, step: int, dtype: torch.dtype) -> torch.Tensor:
    """The sum as the engine computed it before binding: a fresh .grad per micro-batch, added to a zeroed sum
    (laid out as the engine's flat sum: in ``gradients.params``' order, the model's reversed)."""
    parts = [torch.zeros(p.numel(), dtype=dtype) for p in e.gradients.params]
    for j in range(MICRO):
        for p in e.params:
            p.grad = None
        e.computation.loss_fn(e.model, e.computation.batch(e.batch_plan.indices(step, j))).backward()
        for part, p in zip(parts, e.gradients.params):
            if p.grad is not None:
                part.add_(p.grad.reshape(-1))
    for p in e.params:
        p.grad = None
    return torch.cat(parts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["bound", "added"])
def test_the_sum_of_a_step_is_the_one_added_micro_batch_by_micro_batch_and_grads_are_cleared(dtype) -> None:
    e = engine(dtype)
    try:
        assert e.gradients.bind(e.gradients.zeros(reuse=False)[1]) is (dtype == torch.float32)
        for p in e.params:
            p.grad = None
        for step in (0, 1):  # the second step reuses (and zeroes) the engine's buffer
            total = e._compute(E.Compute(step, tuple(range(MICRO)))).clone()
            assert all(p.grad is None for p in e.params)  # nothing points into the sum after the computation
            assert torch.equal(total, reference_sum(e, step, dtype))
            offset = 0
            for p in e.gradients.params:
                if p is e.model.unused:  # never in a graph: zeros
                    assert torch.equal(total[offset:offset + 3], torch.zeros(3, dtype=dtype))
                offset += p.numel()
    finally:
        e.close()


def test_a_training_step_that_clears_grads_loses_nothing() -> None:
    """A hook that sets ``.grad`` to None between micro-batches: autograd makes a fresh one, added at the end."""
    calls = []

    def clearing(model, batch):
        calls.append(1)
        if len(calls) == 2:  # micro-batch 1, before its backward: micro-batch 0 is in the sum already
            model.zero_grad(set_to_none=True)
        return model(batch)

    e = engine(torch.float32, clearing)
    try:
        total = e._compute(E.Compute(0, tuple(range(MICRO)))).clone()
        assert len(calls) == MICRO and all(p.grad is None for p in e.params)
        e.computation.loss_fn = lambda m, b: m(b)
        torch.testing.assert_close(total, reference_sum(e, 0, torch.float32))  # g0 + (g1 + g2): not bit for bit
    finally:
        e.close()


def test_a_failed_computation_leaves_no_grad_pointing_into_the_sum() -> None:
    def loss_fn(model, batch):
        if any(p.grad is not None for p in model.parameters()):
            raise RuntimeError("a peer was lost")  # (the second micro-batch)
        return model(batch)

    e = engine(torch.float32, loss_fn)
    try:
        with pytest.raises(RuntimeError, match="a peer was lost"):
            e._compute(E.Compute(0, tuple(range(MICRO))))
        assert all(p.grad is None for p in e.params)
    finally:
        e.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["views", "copies"])
@pytest.mark.parametrize("bucket_numel", [None, 7], ids=["one-bucket", "buckets"])
def test_the_buckets_are_reduced_in_one_buffer_kept_between_steps_and_grads_are_the_mean(dtype, bucket_numel) -> None:
    e = engine(dtype, bucket_numel=bucket_numel)
    try:
        buffers = set()
        for step in range(3):
            expected = reference_sum(e, step, dtype) / e.batch_plan.num_micro_batches  # (one rank: the reduction is the sum)
            e.train_step(step)
            assert torch.equal(torch.cat([p.grad.reshape(-1) for p in e.gradients.params]), expected.to(torch.float32))
            buffers.add(e.gradients.reduced.data_ptr())
            if dtype == torch.float32:  # p.grad are views of that buffer: no concatenation or copy per step
                assert all(p.grad.untyped_storage().data_ptr() == e.gradients.reduced.untyped_storage().data_ptr()
                           for p in e.params)
        assert len(buffers) == 1, "a fresh reduce buffer was allocated in a later step"
    finally:
        e.close()
