"""Buckets started from backward (Megatron-LM's ``--overlap-grad-reduce``), in one process on gloo.

The engine lays its flat sum out in the reverse of the parameters' order, so the
last layer's gradients, computed first, fill bucket 0; in the backward of the
rank's last micro-batch each bucket's all-reduce starts once its gradients are
summed, in bucket order. The parameters must be those of an engine that starts
every bucket when the reduction begins, bit for bit.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from typing_extensions import override

from unicron_elastic.strategy.engine.elastic_dp import ElasticDataParallel, EngineOptions
from unicron_elastic.strategy.engine.microbatch import GlobalBatchPlan
from unicron_elastic.strategy.engine.transport import GlooTransport, nccl_error_handling

DATA = torch.randn(12, 6, generator=torch.Generator().manual_seed(3))


class Mlp(torch.nn.Module):
    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8),
                                          torch.nn.Tanh(), torch.nn.Linear(8, 1))
        self.unused = torch.nn.Linear(2, 2) if unused else None  # (after the layers: laid out first, in bucket 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).pow(2).mean()


def engine(grad_dtype: torch.dtype, overlap: bool, unused: bool = False) -> ElasticDataParallel:
    model = Mlp(unused)
    return ElasticDataParallel(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               batch_plan=GlobalBatchPlan(len(DATA), 6, 2, seed=0), batch=lambda idx: DATA[idx],
                               loss_fn=lambda m, b: m(b), store=dist.HashStore(), rank=0, world_size=1,
                               options=EngineOptions(timeout=timedelta(seconds=30), grad_dtype=grad_dtype,
                                                     bucket_numel=20, overlap_grad_reduce=overlap))


def trained(e: ElasticDataParallel, steps: int = 3) -> list[torch.Tensor]:
    try:
        for step in range(steps):
            e.train_step(step)
        return [p.detach().clone() for p in e.model.parameters()]
    finally:
        e.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["bound", "added"])
def test_buckets_start_in_their_order_while_backward_still_runs(dtype: torch.dtype) -> None:
    e = engine(dtype, overlap=True)
    params = list(e.model.parameters())
    summed, started = [], []
    for p in params:  # (registered after the engine's hooks: runs after them, for the same parameter)
        p.register_post_accumulate_grad_hook(lambda p: summed.append(p))
    start = e.reduction.start

    def recording(step: int, bucket: int, local: torch.Tensor) -> None:
        if bucket not in e.reduction._in_flight:
            started.append((bucket, len(summed)))
        start(step, bucket, local)

    e.reduction.start = recording
    e.launcher._start = recording
    try:
        e.train_step(0)
    finally:
        e.close()
    launchable = e.reduction.launchable
    assert launchable == len(e.gradients.bounds) - 1 >= 2  # the slots' bucket starts with the reduction
    assert [k for k, _ in started] == list(range(launchable))
    last_backward = len(summed) - len(params)  # the hooks of the rank's last micro-batch
    from_backward = [k for k, fired in started if fired - last_backward < len(params)]
    assert from_backward and from_backward == list(range(len(from_backward)))  # bucket 0 first, during backward
    assert e.launcher.started == len(from_backward)


@pytest.mark.parametrize("unused", [False, True], ids=["every-gradient", "an-unused-parameter"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["bound", "added"])
def test_overlapped_buckets_train_the_same_parameters_to_the_bit(dtype: torch.dtype, unused: bool) -> None:
    overlapped, plain = engine(dtype, True, unused), engine(dtype, False, unused)
    assert overlapped.launcher is not None and plain.launcher is None
    for a, b in zip(trained(overlapped), trained(plain)):
        assert torch.equal(a, b)
    # An unused parameter (laid out first: bucket 0) never reports its gradient: nothing starts from backward.
    assert overlapped.launcher.started == (0 if unused else overlapped.launcher.started)
    assert unused or overlapped.launcher.started > 0


class FailsOnce(GlooTransport):
    """gloo, except that one wait of a step fails as NCCL's does: ``wait()`` returned, the failure is found when
    the host reads the result (:meth:`NcclTransport.wait`); the engine must take it for a lost collective."""

    def __init__(self, failing: int) -> None:
        super().__init__()
        self.failing, self.waits = failing, 0

    @override
    def wait(self, pg: dist.ProcessGroup, work: dist.Work) -> None:
        super().wait(pg, work)
        self.waits += 1
        if self.waits == self.failing:
            raise RuntimeError("NCCL communicator was aborted: a collective on it failed (ErrorType.REMOTE_ERROR)")


def test_a_failure_found_when_the_result_is_read_regroups_and_keeps_the_buckets_before() -> None:
    failing = FailsOnce(failing=0)
    model = Mlp()
    failed = ElasticDataParallel(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                 batch_plan=GlobalBatchPlan(len(DATA), 6, 2, seed=0), batch=lambda idx: DATA[idx],
                                 loss_fn=lambda m, b: m(b), store=dist.HashStore(), rank=0, world_size=1,
                                 options=EngineOptions(timeout=timedelta(seconds=30), grad_dtype=torch.float64,
                                                       bucket_numel=20, transport=failing, checkin_timeout=1.0))
    reports = []
    try:
        for step in range(3):
            failing.failing = failing.failing or (failing.waits + 2 if step == 1 else 0)  # step 1's bucket 1
            reports.append(failed.train_step(step))
        params = [p.detach().clone() for p in failed.model.parameters()]
    finally:
        failed.close()
    assert [(r.step, r.recoveries, r.kept_buckets) for r in reports if r.recoveries] == [(1, 1, 1)]
    for a, b in zip(params, trained(engine(torch.float64, True))):
        assert torch.equal(a, b)


def test_nccl_errors_handled_by_the_engine_without_a_blocking_wait(monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture) -> None:
    """torchelastic's TearDown (1) would kill every survivor; BLOCKING_WAIT would hold the host on every wait."""
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    nccl_error_handling()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # CleanUpOnly: abort the communicators, live on
    assert "TORCH_NCCL_BLOCKING_WAIT" not in os.environ
    assert "nccl_blocking_wait_unset" in capsys.readouterr().out
