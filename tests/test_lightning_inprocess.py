"""The strategy in one process: Lightning's registry, callbacks, loggers, checkpoints, resume, bad input."""

from __future__ import annotations

import csv
import os
import signal
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader, TensorDataset

from unicron_elastic.api import ConfigError
from unicron_elastic.strategy import UnicronMegatronStrategy
from unicron_elastic.strategy.engine.microbatch import GlobalBatchPlan
from unicron_elastic.testing import toy_data


class Regression(pl.LightningModule):
    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def loader() -> DataLoader:
    xs, ys = toy_data()
    return DataLoader(TensorDataset(xs, ys), batch_size=4)


def trainer(tmp_path: Path, steps: int, strategy: object = "unicron_megatron", **kwargs) -> pl.Trainer:
    return pl.Trainer(strategy=strategy, accelerator="cpu", max_steps=steps, enable_progress_bar=False,
                      enable_model_summary=False, logger=CSVLogger(tmp_path / "logs"), log_every_n_steps=1, **kwargs)


def reference(steps: int, global_batch: int = 4, shuffle: bool = True) -> list[torch.Tensor]:
    """Plain torch: the same global batches (GlobalBatchPlan), mean loss, SGD."""
    model = Regression()
    optimizer = model.configure_optimizers()
    xs, ys = toy_data()
    plan = GlobalBatchPlan(len(xs), global_batch, 4, seed=0, shuffle=shuffle)
    for step in range(steps):
        optimizer.zero_grad()
        for j in range(plan.num_micro_batches):
            idx = plan.indices(step, j)
            (torch.nn.functional.mse_loss(model.net(xs[idx]), ys[idx]) / plan.num_micro_batches).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.timeout(120)
def test_string_strategy_with_callbacks_loggers_and_save_checkpoint(tmp_path: Path) -> None:
    model = Regression()
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    t = trainer(tmp_path, 4, callbacks=[checkpoints])
    t.fit(model, loader())
    assert isinstance(t.strategy, UnicronMegatronStrategy) and t.global_step == 4
    for ours, ref in zip(model.parameters(), reference(4)):
        torch.testing.assert_close(ours.detach(), ref)
    assert len(list((tmp_path / "ckpt").glob("*.ckpt"))) == 2  # ModelCheckpoint every 2 steps
    t.save_checkpoint(tmp_path / "final.ckpt")
    assert torch.load(tmp_path / "final.ckpt", weights_only=False)["global_step"] == 4
    rows = list(csv.DictReader(open(next((tmp_path / "logs").rglob("metrics.csv")))))
    assert len([r for r in rows if r.get("train_loss")]) == 4


@pytest.mark.timeout(120)
def test_without_shuffling_the_steps_take_the_dataset_in_its_order(tmp_path: Path) -> None:
    model = Regression()
    t = trainer(tmp_path, 3, strategy=UnicronMegatronStrategy(global_batch=8, micro_batch=4, shuffle=False))
    t.fit(model, loader())
    assert t.strategy.engine.batch_plan.indices(1, 0) == [8, 9, 10, 11]
    for ours, ref in zip(model.parameters(), reference(3, global_batch=8, shuffle=False)):
        torch.testing.assert_close(ours.detach(), ref)
    unshuffled = reference(3, global_batch=8, shuffle=False)
    assert any(not torch.equal(a, b) for a, b in zip(unshuffled, reference(3, global_batch=8)))


@pytest.mark.timeout(120)
def test_lightning_resume_from_a_checkpoint_continues_the_same_trajectory(tmp_path: Path) -> None:
    strategy = UnicronMegatronStrategy(global_batch=8, micro_batch=4)  # B = 2 micro-batches per step
    first = trainer(tmp_path, 2, strategy=strategy)
    first.fit(Regression(), loader())
    first.save_checkpoint(tmp_path / "two.ckpt")
    model = Regression()
    trainer(tmp_path, 5, strategy=UnicronMegatronStrategy(global_batch=8, micro_batch=4)).fit(
        model, loader(), ckpt_path=tmp_path / "two.ckpt")
    for ours, ref in zip(model.parameters(), reference(5, global_batch=8)):
        torch.testing.assert_close(ours.detach(), ref)


class SigtermDuring(pl.Callback):
    """SIGTERM to this process at the start of step ``step``'s batch (what unicron-run's stop sends)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.timeout(120)
def test_sigterm_stops_fit_after_the_step_whose_exchange_carried_it(tmp_path: Path) -> None:
    """The signal marks the rank; the step's gradient exchange carries the mark; fit ends after that step."""
    model = Regression()
    t = trainer(tmp_path, 10, callbacks=[SigtermDuring(2)])
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SIGTERMException):
        t.fit(model, loader())
    assert t.global_step == 3  # step 2 completed (its optimizer step too), then Lightning stopped
    assert t.strategy.engine.reduction.stop_requested and t.strategy.engine.reduction.stop_agreed
    for ours, ref in zip(model.parameters(), reference(3)):
        torch.testing.assert_close(ours.detach(), ref)
    assert signal.getsignal(signal.SIGTERM) == before  # Lightning put the handler back


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["accumulate", "manual"])
def test_unsupported_lightning_settings_are_clear_errors(tmp_path: Path, case: str) -> None:
    kwargs = {"accumulate_grad_batches": 2} if case == "accumulate" else {}
    with pytest.raises(ConfigError, match="accumulate" if case == "accumulate" else "automatic optimization"):
        trainer(tmp_path, 2, **kwargs).fit(Regression(manual=case == "manual"), loader())


@pytest.mark.timeout(120)
def test_members_outside_the_world_are_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="subset of ranks 0..0"):
        trainer(tmp_path, 2, strategy=UnicronMegatronStrategy(member_schedule={1: [0, 3]})).fit(Regression(), loader())


def test_bad_strategy_arguments_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match="global_batch"):
        UnicronMegatronStrategy(global_batch=0)
    with pytest.raises(ConfigError, match="snapshot_every"):
        UnicronMegatronStrategy(snapshot_every=-1)
    with pytest.raises(ConfigError, match="tensor-parallel size"):
        UnicronMegatronStrategy(tensor_model_parallel_size=0)
    with pytest.raises(ConfigError, match="pipeline_schedule"):
        UnicronMegatronStrategy(pipeline_model_parallel_size=2, pipeline_schedule="zigzag")


class Probe(Regression):
    """Records, inside ``training_step``, whether CPU autocast is on and the dtype a matmul gives; and, in each
    micro-batch's backward (a hook on its loss), whether autocast is on there."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bool, torch.dtype, torch.dtype]] = []
        self.backward_autocast: list[bool] = []

    def training_step(self, batch, batch_idx):
        x, _ = batch
        self.seen.append((torch.is_autocast_enabled("cpu"), (x @ x.T).dtype, x.dtype))
        loss = super().training_step(batch, batch_idx)
        loss.register_hook(lambda grad: self.backward_autocast.append(torch.is_autocast_enabled("cpu")) or grad)
        return loss


class ReduceProbe(pl.Callback):
    """Records whether CPU autocast is on while the engine reduces the gradients."""

    def __init__(self) -> None:
        self.autocast: list[bool] = []

    def on_train_start(self, trainer: pl.Trainer, *args: object) -> None:
        engine = trainer.strategy.engine
        reduce = engine.finish_gradients

        def spy(*a: object, **k: object) -> object:
            self.autocast.append(torch.is_autocast_enabled("cpu"))
            return reduce(*a, **k)

        engine.finish_gradients = spy


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("precision", "matmul", "inputs", "params"), [
    ("32-true", torch.float32, torch.float32, torch.float32),
    ("bf16-mixed", torch.bfloat16, torch.float32, torch.float32),
    ("bf16-true", torch.bfloat16, torch.bfloat16, torch.bfloat16),
    ("16-true", torch.float16, torch.float16, torch.float16),
    ("64-true", torch.float64, torch.float64, torch.float64),
])
def test_the_precision_is_honoured_in_each_micro_batchs_forward_and_not_in_the_reduce(
        tmp_path: Path, precision: str, matmul: torch.dtype, inputs: torch.dtype, params: torch.dtype) -> None:
    model, probe = Probe(), ReduceProbe()
    t = trainer(tmp_path, 3, strategy=UnicronMegatronStrategy(global_batch=8, micro_batch=4), precision=precision,
                callbacks=[probe])
    t.fit(model, loader())
    assert t.global_step == 3  # every optimizer step was taken
    assert len(model.seen) == 6  # 3 steps x 2 micro-batches
    assert {autocast for autocast, _, _ in model.seen} == {precision == "bf16-mixed"}
    assert {(m, i) for _, m, i in model.seen} == {(matmul, inputs)}
    # each micro-batch's backward runs outside the forward's autocast: the strategy's own choice (it runs the
    # micro-batches inside its training_step and enters the plugin's context around each forward only)
    assert model.backward_autocast == [False] * 6
    # the reduce too; that one is Lightning's doing (it calls the strategy's backward outside the training step's
    # context), which the strategy relies on: this guards against a Lightning that changes it
    assert probe.autocast == [False] * 3
    assert {p.dtype for p in model.parameters()} == {params}
    assert all(torch.isfinite(p).all() for p in model.parameters())


class InfAt(Regression):
    """Regression whose loss is infinite in micro-batch 0 of ``step``; records autocast and matmul dtypes."""

    def __init__(self, step: int | None) -> None:
        super().__init__()
        self.inf_step = step
        self.seen: list[tuple[bool, torch.dtype]] = []

    def training_step(self, batch, batch_idx):
        x, _ = batch
        self.seen.append((torch.is_autocast_enabled("cpu"), (x @ x.T).dtype))
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if (self.trainer.global_step, batch_idx) == (self.inf_step, 0) else loss


class ScalerRecord(pl.Callback):
    """Per step: the scale after it, the parameters after it, and the unscaled gradients it stepped with."""

    def __init__(self) -> None:
        self.scales: list[float] = []
        self.params: list[list[torch.Tensor]] = []
        self.grads: list[list[torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, optimizer: object) -> None:
        self.grads.append([p.grad.clone() for p in module.parameters()])

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: object) -> None:
        self.scales.append(trainer.precision_plugin.scaler.get_scale())
        self.params.append([p.detach().clone() for p in module.parameters()])


def fit_16_mixed(tmp_path: Path, inf_step: int | None, init_scale: float) -> tuple[pl.Trainer, InfAt, ScalerRecord]:
    from lightning.pytorch.plugins import MixedPrecision

    model, record = InfAt(inf_step), ScalerRecord()
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    t = trainer(tmp_path, 4, strategy=UnicronMegatronStrategy(global_batch=8, micro_batch=4), callbacks=[record],
                plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    t.fit(model, loader())
    return t, model, record


@pytest.mark.timeout(120)
def test_16_mixed_scales_each_micro_batch_unscales_once_and_skips_a_step_whose_gradients_are_not_finite(
        tmp_path: Path) -> None:
    t, model, record = fit_16_mixed(tmp_path / "inf", inf_step=2, init_scale=2.0**10)
    assert t.global_step == 4
    assert set(model.seen) == {(True, torch.float16)}  # each micro-batch's forward under float16 autocast
    assert record.scales == [2.0**10, 2.0**10, 2.0**9, 2.0**9]  # the inf step lowered the scale, once
    for before, after in zip(record.params[1], record.params[2]):
        assert torch.equal(before, after)  # step 2 was skipped
    assert not all(torch.equal(a, b) for a, b in zip(record.params[0], record.params[1]))  # the others stepped
    # the gradients the optimizer sees are unscaled exactly once: the same under another scale
    _, _, plain = fit_16_mixed(tmp_path / "plain", inf_step=None, init_scale=1.0)
    for ours, theirs in zip(record.grads[0], plain.grads[0]):
        torch.testing.assert_close(ours, theirs, rtol=2e-3, atol=1e-5)


def test_a_loss_scaler_of_another_strategy_is_refused_at_trainer_construction(tmp_path: Path) -> None:
    from lightning.pytorch.plugins import MixedPrecision
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    with pytest.raises(ConfigError, match="ShardedGradScaler"):
        trainer(tmp_path, 2, plugins=[MixedPrecision("16-mixed", "cpu", scaler=ShardedGradScaler("cpu"))])


def test_autocast_on_the_cpu_around_megatron_cores_layers_is_refused_before_it_fails_in_their_backward() -> None:
    from lightning.pytorch.plugins import MixedPrecision

    from unicron_elastic.strategy.lightning.precision import check_module

    megatron_layer = type("ColumnParallelLinear", (torch.nn.Linear,), {"__module__": "megatron.core.tensor_parallel.layers"})
    module = torch.nn.Sequential(megatron_layer(2, 2))
    with pytest.raises(ConfigError, match="bf16-mixed.*ColumnParallelLinear.*32-true"):
        check_module(MixedPrecision("bf16-mixed", "cpu"), module, torch.device("cpu"))
    check_module(MixedPrecision("bf16-mixed", "cuda"), module, torch.device("cuda", 0))  # on a GPU they autocast
    check_module(MixedPrecision("bf16-mixed", "cpu"), torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.device("cpu"))
