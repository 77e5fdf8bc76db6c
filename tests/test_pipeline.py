"""Our micro-batch pipeline schedule over gloo point-to-point (issue 12, item 1's building block)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unicron_elastic.api import ConfigError
from unicron_elastic.strategy.engine.pipeline import Op, PipelineDeadlock, gpipe, one_f_one_b, simulate
from unicron_elastic.testing import run_workers

WORKER = str(Path(__file__).parent / "workers" / "pipeline_worker.py")


@settings(max_examples=200, deadline=None)
@given(stages=st.integers(1, 8), micro_batches=st.integers(1, 16))
def test_each_schedule_runs_every_micro_batch_once_each_way_in_order_without_deadlock(stages, micro_batches):
    for schedule in (gpipe, one_f_one_b):
        plans = [schedule(s, stages, micro_batches) for s in range(stages)]
        for stage, ops in enumerate(plans):
            forwards = [op.j for op in ops if op.kind == "F"]
            backwards = [op.j for op in ops if op.kind == "B"]
            assert forwards == backwards == list(range(micro_batches))  # megatron-core's micro-batch order
            assert all(ops.index(Op("F", j)) < ops.index(Op("B", j)) for j in range(micro_batches))
        assert simulate(plans) >= 2 * micro_batches


@settings(max_examples=100, deadline=None)
@given(stages=st.integers(1, 8), micro_batches=st.integers(1, 16))
def test_1f1b_holds_at_most_the_stages_after_it_in_flight(stages, micro_batches):
    for stage in range(stages):
        held, most = 0, 0
        for op in one_f_one_b(stage, stages, micro_batches):
            held += 1 if op.kind == "F" else -1
            most = max(most, held)
        assert most <= min(stages - stage, micro_batches)  # GPipe holds all micro-batches


def test_a_schedule_whose_stages_wait_on_each_other_is_found() -> None:
    first = [Op("F", 0), Op("B", 0), Op("F", 1), Op("B", 1)]  # B0 before F1 on the first stage ...
    last = [Op("F", 0), Op("F", 1), Op("B", 0), Op("B", 1)]  # ... while the last wants F1 before B0's gradient
    with pytest.raises(PipelineDeadlock):
        simulate([first, last])


@pytest.mark.parametrize("args", [(0, 0, 1), (0, 1, 0), (2, 2, 1), (-1, 2, 1)])
def test_bad_sizes_are_refused(args) -> None:
    for schedule in (gpipe, one_f_one_b):
        with pytest.raises(ConfigError):
            schedule(*args)


def _reference() -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    sys.path.insert(0, str(Path(WORKER).parent))
    try:
        import pipeline_worker as w
    finally:
        sys.path.pop(0)
    layers = w.layers()
    xs, ys = w.data()
    model = torch.nn.Sequential(*layers)
    losses = []
    for j in range(w.MICRO_BATCHES):
        loss = torch.nn.functional.mse_loss(model(xs[j]), ys[j]) / w.MICRO_BATCHES
        loss.backward()
        losses.append(loss.detach())
    return [[p.grad for p in layer.parameters()] for layer in layers], losses


@pytest.mark.e2e
@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_three_stages_over_gloo_compute_the_gradients_of_the_whole_model(tmp_path: Path, schedule: str) -> None:
    results = run_workers(WORKER, 3, [str(tmp_path), schedule], timeout=100)
    assert [r.returncode for r in results] == [0, 0, 0], results[0].stderr[-2000:] + results[2].stderr[-2000:]
    grads, losses = _reference()
    for rank in range(3):
        saved = torch.load(tmp_path / f"grads{rank}.pt")
        for ours, theirs in zip(saved["grads"], grads[rank], strict=True):
            torch.testing.assert_close(ours, theirs)  # float32 tolerance (sums in another order)
    torch.testing.assert_close(torch.stack(torch.load(tmp_path / "grads2.pt")["losses"]), torch.stack(losses))
    assert torch.load(tmp_path / "grads0.pt")["losses"] == []
