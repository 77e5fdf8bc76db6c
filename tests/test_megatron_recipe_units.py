"""What a Megatron-LM recipe asks of a step, in one process: totals, tensor-group sums, fusion, RNG, the NaN stop.

The multi-process runs of the same are in ``tests/test_megatron_recipe.py``.
"""

from __future__ import annotations

import queue
import sys
import threading
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from conftest import EXAMPLES
from unicron_elastic.api import ConfigError, NonFiniteError
from unicron_elastic.strategy.engine.elastic_dp import ElasticDataParallel, EngineOptions
from unicron_elastic.strategy.engine.engine_options import ModelReductions, TensorReduced
from unicron_elastic.strategy.engine.microbatch import GlobalBatchPlan
from unicron_elastic.strategy.engine.replicas import ModelParallel
from unicron_elastic.strategy.engine.stage_sums import ReplicaSums
from unicron_elastic.strategy.engine.step_totals import TotalsLayout
from unicron_elastic.strategy.lightning.megatron_reductions import (MegatronSwitches, check_sequence_parallel_norms,
                                                                   tensor_reduced)
from unicron_elastic.strategy.lightning.rng import megatron_tracker, micro_batch_rng, seed_tracker
from unicron_elastic.strategy.lightning.stages import MicroBatchLoss, micro_batch_loss

sys.path.insert(0, EXAMPLES)
sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent / "stand_ins"))
import fused_weight_gradient_mlp_cuda as fused  # noqa: E402 - the CPU stand-in of Apex's kernel


# -- the step's totals ------------------------------------------------------------------------------------------
def test_totals_carry_megatrons_report_and_give_the_token_weighted_loss() -> None:
    layout = TotalsLayout(("lm loss",))
    a = layout.encode(torch.tensor(10, dtype=torch.int32), torch.tensor(25.0),
                      {"lm loss": torch.tensor([25.0, 10.0])})
    b = layout.encode(torch.tensor(30, dtype=torch.int32), torch.tensor(45.0), {"lm loss": torch.tensor([45.0, 30.0])})
    totals = layout.decode(a + b)
    assert (totals.count, totals.loss_sum) == (40.0, 70.0)
    assert totals.loss == pytest.approx(70 / 40) and totals.reported() == {"lm loss": pytest.approx(70 / 40)}


def test_a_micro_batch_whose_tokens_are_all_masked_adds_zero_not_nan() -> None:
    masked = MicroBatchLoss(torch.tensor(0.0), torch.tensor(0, dtype=torch.int32), {"lm loss": torch.zeros(2)})
    assert float(masked.mean) == 0.0  # megatron-core's schedule clamps the count at 1
    assert float(masked.to_backward(per_token=True)) == 0.0 and int(masked.count(per_token=True)) == 0
    layout = TotalsLayout(("lm loss",))
    totals = layout.decode(layout.encode(masked.count(True), masked.to_backward(True), masked.report))
    assert totals.loss == 0.0 and totals.reported() == {"lm loss": 0.0}


def test_a_report_of_other_keys_and_per_token_loss_without_a_count_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"report has keys \['other'\].*report_keys="):
        TotalsLayout(("lm loss",)).encode(1.0, torch.tensor(1.0), {"other": torch.tensor(1.0)})
    with pytest.raises(ConfigError, match="calculate_per_token_loss=True: loss_func must return"):
        MicroBatchLoss(torch.tensor(1.0)).to_backward(per_token=True)
    parts = micro_batch_loss({"loss": torch.tensor(0.5), "loss_sum": torch.tensor(2.0), "num_tokens": torch.tensor(4)})
    assert float(parts.to_backward(per_token=True)) == 2.0 and float(parts.mean) == 0.5


# -- which gradients the tensor group reduces ------------------------------------------------------------------
def _param(**marks: Any) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(2))
    for name, value in marks.items():
        setattr(p, name, value)
    return p


def test_the_tensor_group_reduces_what_megatron_cores_finalize_model_grads_reduces() -> None:
    named = [("decoder.layers.0.input_layernorm.weight", _param(sequence_parallel=True)),
             ("decoder.layers.0.self_attention.q_layernorm.weight", _param()),
             ("decoder.layers.0.self_attention.k_layernorm.weight", _param(sequence_parallel=True)),
             ("decoder.layers.0.mlp.linear_fc1.weight", _param(tensor_model_parallel=True)),
             ("router.weight", _param(average_gradients_across_tp_domain=True, sequence_parallel=True))]
    assert tensor_reduced(named, MegatronSwitches()) == TensorReduced((), (4,))
    assert tensor_reduced(named, MegatronSwitches(sequence_parallel=True)) == TensorReduced((0, 2), (4,))
    assert tensor_reduced(named, MegatronSwitches(qk_layernorm=True)) == TensorReduced((1, 2), (4,))
    assert tensor_reduced(named, MegatronSwitches(True, True)) == TensorReduced((0, 1, 2), (4,))


def test_with_sequence_parallelism_a_norm_nothing_would_sum_is_refused() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    check_sequence_parallel_norms(model, MegatronSwitches())  # without sequence parallelism: whole on each rank
    with pytest.raises(ConfigError, match=r"1\.weight \(LayerNorm\) is not marked sequence_parallel.*partial"):
        check_sequence_parallel_norms(model, MegatronSwitches(sequence_parallel=True))
    for p in model[1].parameters():
        p.sequence_parallel = True
    check_sequence_parallel_norms(model, MegatronSwitches(sequence_parallel=True))


class _Mailbox:
    """Point-to-point messages between threads that stand for ranks (a gloo group's ``send``/``recv``)."""

    def __init__(self) -> None:
        self.boxes: dict[tuple[int, int, int], queue.Queue] = {}
        self.lock = threading.Lock()

    def box(self, src: int, dst: int, tag: int) -> queue.Queue:
        with self.lock:
            return self.boxes.setdefault((src, dst, tag), queue.Queue())

    def group(self, rank: int) -> Any:
        mailbox = self

        class Group:
            def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
                mailbox.box(rank, dst, tag).put(tensors[0].clone())
                return SimpleNamespace(wait=lambda: None)

            def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
                return SimpleNamespace(wait=lambda: tensors[0].copy_(mailbox.box(src, rank, tag).get(timeout=10)))

        return Group()


def test_tensor_partial_gradients_are_summed_in_order_on_every_tensor_rank_and_counted_once_in_the_norm() -> None:
    layout, mailbox = ModelParallel(tensor=2), _Mailbox()
    names = ["norm.weight", "fc.weight", "avg.weight"]
    reduced = {0: torch.tensor([1.0, 2.0, 10.0, 20.0, 4.0]), 1: torch.tensor([3.0, 5.0, 30.0, 40.0, 8.0])}
    sums, threads = {}, []
    for t in (0, 1):
        params = [_param(), _param(tensor_model_parallel=True), nn.Parameter(torch.zeros(1))]
        sums[t] = ReplicaSums(params, names, layout, t, TensorReduced(summed=(0,), averaged=(2,)))
        threads.append(threading.Thread(target=sums[t].exchange_tensor,
                                        args=(reduced[t], mailbox.group(t), [0, 1], lambda what: _nothing())))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    norms = {t: sums[t].squared_norm(reduced[t]) for t in (0, 1)}
    for t in (0, 1):
        sums[t].apply(reduced[t])
        assert reduced[t][:2].tolist() == [4.0, 7.0] and reduced[t][4].item() == 6.0  # summed; averaged
    assert reduced[0][2:4].tolist() == [10.0, 20.0] and reduced[1][2:4].tolist() == [30.0, 40.0]  # split: untouched
    # the whole norms of the summed and averaged parameters on tensor rank 0 only; each rank its split part
    assert norms[0] == 4 ** 2 + 7 ** 2 + 6 ** 2 + 10 ** 2 + 20 ** 2 and norms[1] == 30 ** 2 + 40 ** 2


def test_a_parameter_split_over_the_tensor_group_cannot_also_be_summed_over_it() -> None:
    with pytest.raises(ConfigError, match="split over the tensor-parallel group and also marked"):
        ReplicaSums([_param(tensor_model_parallel=True)], ["w"], ModelParallel(tensor=2), 0, TensorReduced((0,)))


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# -- the engine: per-token division, the NaN stop, main_grad -----------------------------------------------------
DATA = torch.randn(12, 4, generator=torch.Generator().manual_seed(3))
TOKENS = [3, 0, 5, 2, 7, 1]  # a micro-batch's token count (the second one is all masked)


class _FusedLinear(torch.autograd.Function):
    """A linear layer's weight gradient as megatron-core's fused path computes it: into ``weight.main_grad``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        x, weight = ctx.saved_tensors
        fused.wgrad_gemm_accum_fp32(x, grad_output, weight.main_grad)
        return grad_output @ weight, None


class _Model(nn.Module):
    def __init__(self, fused_path: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 3, bias=False)
        self.norm = nn.LayerNorm(3)
        self.fused_path = fused_path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _FusedLinear.apply(x, self.fc.weight) if self.fused_path else self.fc(x)
        return self.norm(torch.tanh(h))


def _engine(grad_dtype: torch.dtype, reductions: ModelReductions, fused_path: bool = False,
            nan_at: tuple[int, int] | None = None) -> ElasticDataParallel:
    model = _Model(fused_path)
    layout = reductions.totals

    def loss_fn(m: nn.Module, batch: tuple[int, torch.Tensor]) -> torch.Tensor:
        j, x = batch
        loss_sum = m(x).pow(2).sum() * TOKENS[j] / 10
        if nan_at == e.computation.current_micro_batch:
            loss_sum = loss_sum * float("nan")
        parts = MicroBatchLoss(loss_sum, torch.tensor(TOKENS[j]), None)
        if layout is not None:
            e.computation.record(layout.encode(parts.count(reductions.per_token), parts.to_backward(reductions.per_token), None))
        return parts.to_backward(reductions.per_token)

    plan = GlobalBatchPlan(len(DATA), 12, 2, seed=0)  # six micro-batches a step
    e = ElasticDataParallel(None, None, batch_plan=plan, loss_fn=loss_fn, store=dist.HashStore(), rank=0,
                            world_size=1, batch=lambda idx: (plan_index(plan, idx), DATA[idx]),
                            options=EngineOptions(timeout=timedelta(seconds=30), grad_dtype=grad_dtype))
    e.bind(model, torch.optim.SGD(model.parameters(), lr=0.1), reductions)
    return e


def plan_index(plan: GlobalBatchPlan, indices: list[int]) -> int:
    """Which micro-batch of step 0 ``indices`` are (the tests' loss weighs each by its token count)."""
    return next(j for j in range(plan.num_micro_batches) if plan.indices(0, j) == list(indices))


def _step(e: ElasticDataParallel) -> list[torch.Tensor]:
    e.begin_step(0)
    e.finish_gradients()
    return [p.grad.clone() for p in e.params]


def test_per_token_loss_divides_the_summed_gradients_by_the_steps_tokens() -> None:
    reductions = ModelReductions(totals=TotalsLayout(), per_token=True)
    e = _engine(torch.float64, reductions)
    try:
        grads = _step(e)
        assert e.reduction.totals.count == sum(TOKENS)
        model, expected = _Model(False), None
        for j in range(6):
            x = DATA[e.batch_plan.indices(0, j)]
            (model(x).pow(2).sum() * TOKENS[j] / 10).backward()
        expected = [p.grad.double() / sum(TOKENS) for p in model.parameters()]
        for got, want in zip(grads, expected):
            assert torch.allclose(got, want.to(got.dtype), rtol=1e-6, atol=1e-9)
    finally:
        e.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32-sums", "float64-sums"])
def test_the_fused_kernel_accumulates_into_main_grad_and_gives_the_unfused_gradients_bit_for_bit(dtype) -> None:
    plain = _engine(dtype, ModelReductions())
    fused_engine = _engine(dtype, ModelReductions(main_grad=True), fused_path=True)
    try:
        expected, got = _step(plain), _step(fused_engine)
        assert all(torch.equal(a, b) for a, b in zip(expected, got))
        assert not any(hasattr(p, "main_grad") for p in fused_engine.params)  # nothing points into a sum after
    finally:
        plain.close()
        fused_engine.close()


def test_a_nan_stops_the_step_before_the_optimizer_naming_the_step_and_the_rank() -> None:
    e = _engine(torch.float32, ModelReductions(totals=TotalsLayout(), per_token=True, check_finite=True),
                nan_at=(0, 3))
    before = [p.detach().clone() for p in e.params]
    try:
        e.begin_step(0)
        with pytest.raises(NonFiniteError, match="step 0, first produced by rank 0") as error:
            e.finish_gradients()
        assert error.value.step == 0 and error.value.ranks == [0]
        assert all(torch.equal(a, p) for a, p in zip(before, e.params))
    finally:
        e.close()


# -- megatron-core's RNG tracker -----------------------------------------------------------------------------
@pytest.fixture
def cpu_tracker() -> Any:
    """The example's CPU tracker in megatron-core's place (restored afterwards)."""
    from megatron.core.tensor_parallel import random as megatron_random

    import megatron_gpt

    saved = megatron_random._CUDA_RNG_STATE_TRACKER, megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED
    assert megatron_tracker(torch.device("cpu")) is None  # the stock CUDA tracker cannot run on a CPU
    megatron_gpt.cpu_rng_tracker()
    yield megatron_tracker(torch.device("cpu"))
    megatron_random._CUDA_RNG_STATE_TRACKER, megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = saved


def _draws(tracker: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """What the default generator and the tracker's model-parallel stream give."""
    outside = torch.rand(3)
    with tracker.fork():
        inside = torch.rand(3)
    return outside, inside


def test_each_micro_batch_reseeds_the_tracker_from_its_own_seed_and_restores_it(cpu_tracker: Any) -> None:
    seed_tracker(cpu_tracker, 1, tensor_rank=0)
    before = {k: v.clone() for k, v in cpu_tracker.get_states().items()}
    with micro_batch_rng(42, torch.device("cpu"), cpu_tracker, tensor_rank=0):
        first = _draws(cpu_tracker)
    assert all(torch.equal(before[k], v) for k, v in cpu_tracker.get_states().items())  # restored
    with cpu_tracker.fork():
        torch.rand(100)  # the stream moved on (another micro-batch, validation...)
    with micro_batch_rng(42, torch.device("cpu"), cpu_tracker, tensor_rank=0):
        again = _draws(cpu_tracker)
    with micro_batch_rng(42, torch.device("cpu"), cpu_tracker, tensor_rank=1):
        other_rank = _draws(cpu_tracker)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])  # who computes it does not matter
    assert torch.equal(first[0], other_rank[0]) and not torch.equal(first[1], other_rank[1])  # tensor ranks differ
    assert set(cpu_tracker.get_states()) == {"data-parallel-rng", "model-parallel-rng", "expert-parallel-rng"}


def test_a_joiner_receives_the_trackers_states(cpu_tracker: Any) -> None:
    from unicron_elastic.strategy.lightning.random_streams import RandomStreams
    from unicron_elastic.strategy.lightning.replica_state import ReplicaState

    seed_tracker(cpu_tracker, 7, tensor_rank=1)
    with cpu_tracker.fork():
        torch.rand(5)
    streams = RandomStreams(seed=0)
    streams.tracker = cpu_tracker
    connector = SimpleNamespace(dump_checkpoint=lambda: {})
    module = SimpleNamespace(trainer=SimpleNamespace(_checkpoint_connector=connector))
    replica = ReplicaState(lambda: module, streams, memory=None, disk=None)  # type: ignore[arg-type]
    sent = replica.get()["rng"]["megatron"]
    assert all(torch.equal(sent[k], v) for k, v in cpu_tracker.get_states().items())
    expected = _draws(cpu_tracker)[1]
    seed_tracker(cpu_tracker, 99, tensor_rank=0)  # the joiner's own, before it receives the state
    joiner = RandomStreams(seed=0)
    joiner.tracker = cpu_tracker
    joiner.hold({**replica.get()["rng"], "megatron": sent})
    joiner.restore()
    assert torch.equal(_draws(cpu_tracker)[1], expected)
