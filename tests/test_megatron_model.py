"""In-process: what the strategy does around a megatron-core model, piece by piece.

* tied weights across stages found from megatron-core's marks, and refused where they cannot be kept tied;
* the replica's gradient norm counts each parameter once (megatron-core's rules);
* the two ends of the pipeline exchange the tied weight's reduced gradient and take the same sum, again
  when a commit is retried, and start from the first stage's values (two endpoints in threads);
* ``forward_step`` in Megatron-LM's shape: the stage model, ``set_input_tensor``, ``loss_func``'s two shapes;
* megatron-core's DDP wrappers, optimizers and configs the strategy would train wrongly are refused;
* every group a ``GPTModel`` holds (its ``pg_collection`` and the copies its modules keep) is the new world's
  after the world is rebuilt, and a group the model made itself is refused.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from conftest import EXAMPLES
from unicron_elastic.api import ConfigError
from unicron_elastic.strategy.lightning.megatron_checks import check_configs, check_wrappers
from unicron_elastic.strategy.lightning.model_groups import (ReleasedGroup, check_groups, current_groups, rebind_groups,
                                                   release_groups)
from unicron_elastic.strategy.lightning.parallel import destroy_world, rebuild_world
from unicron_elastic.strategy.engine.replicas import ModelParallel
from unicron_elastic.strategy.engine.stage_sums import ReplicaSums
from unicron_elastic.strategy.lightning.stages import MegatronStage, loss_of, run_forward_step, stage_model
from unicron_elastic.strategy.engine.tied import counted_in_norm, find_tied, norm_ranges, squared_norm


def param(*shape: int, **marks: Any) -> nn.Parameter:
    p = nn.Parameter(torch.ones(*shape))
    for name, value in marks.items():
        setattr(p, name, value)
    return p


# -- tied weights -------------------------------------------------------------------------------------------
def test_the_first_stages_embedding_and_the_last_stages_copy_are_found_from_megatrons_marks() -> None:
    embedding = param(4, 2, shared_embedding=True, tensor_model_parallel=True)
    copy = param(4, 2, shared=True, shared_embedding=True, tensor_model_parallel=True)
    first = find_tied([param(3), embedding], ["a", "w"], stage=0, stages=3)
    last = find_tied([copy, param(3)], ["w", "b"], stage=2, stages=3)
    assert (first.index, first.peer_stage, first.first) == (1, 2, True)
    assert (last.index, last.peer_stage, last.first) == (0, 0, False)
    assert find_tied([param(3)], ["a"], stage=0, stages=2) is None
    assert find_tied([embedding], ["w"], stage=0, stages=1) is None  # one stage: one parameter, nothing to keep


@pytest.mark.parametrize("params, stage, why", [
    ([param(2, shared_embedding=True)], 1, "middle stage"),  # (multi-token prediction's copy)
    ([param(2, shared_embedding=True), param(2, shared=True)], 0, "two on one stage"),
    ([param(2, shared=True, shared_embedding=True)], 0, "a copy on the first stage"),
])
def test_a_weight_tied_across_stages_that_cannot_be_kept_tied_is_refused(params: list, stage: int, why: str) -> None:
    with pytest.raises(ConfigError, match="tied|copy"):
        find_tied(params, [f"p{i}" for i in range(len(params))], stage=stage, stages=3)


def test_the_norm_counts_each_parameter_once_as_megatron_core_does() -> None:
    split = param(2, tensor_model_parallel=True)  # this tensor rank's part: counted on every rank
    whole = param(3)  # every tensor rank holds it (a layer norm): counted on tensor rank 0
    copy = param(2, shared=True, shared_embedding=True, tensor_model_parallel=True)  # counted on the first stage
    assert [counted_in_norm(p, 0) for p in (split, whole, copy)] == [True, True, False]
    assert [counted_in_norm(p, 1) for p in (split, whole, copy)] == [True, False, False]
    assert norm_ranges([split, whole, copy, split], 0) == [(0, 5), (7, 9)]
    assert norm_ranges([split, whole, copy, split], 1) == [(0, 2), (7, 9)]
    assert norm_ranges([split, whole], 0, skip={0}) == [(2, 5)]
    flat = torch.arange(9, dtype=torch.float32)
    assert squared_norm(flat, [(0, 2), (7, 9)]) == 0 + 1 + 49 + 64


# -- the ends of the pipeline, with two endpoints -----------------------------------------------------------
class Pair:
    """Point-to-point between two endpoints in threads (``send``/``recv`` as a gloo group's)."""

    class Work:
        def __init__(self, done: threading.Event | None = None) -> None:
            self.done = done

        def wait(self) -> None:
            if self.done is not None:
                assert self.done.wait(10), "no message came"

    def __init__(self) -> None:
        self.boxes = {0: queue.Queue(), 1: queue.Queue()}

    def end(self, me: int) -> Any:
        pair = self

        class End:
            def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> Pair.Work:
                pair.boxes[peer].put(tensors[0].clone())
                return Pair.Work()

            def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> Pair.Work:
                tensors[0].copy_(pair.boxes[me].get(timeout=10))
                return Pair.Work()

        return End()


def both(first: Any, last: Any) -> list:
    """Run ``first()`` and ``last()`` at once; their results (or exceptions)."""
    results: list = [None, None]

    def run(i: int, fn: Any) -> None:
        try:
            results[i] = fn()
        except Exception as exc:  # noqa: BLE001 - returned to the test
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate((first, last))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return results


def two_stages(first_weight: torch.Tensor, last_weight: torch.Tensor | None) -> tuple[ReplicaSums, ReplicaSums]:
    layout = ModelParallel(1, 2)
    emb = nn.Parameter(first_weight.clone())
    emb.shared_embedding, emb.tensor_model_parallel = True, True
    first = ReplicaSums([param(3), emb], ["b", "emb"], layout, rank=0)
    params = [param(2)]
    if last_weight is not None:
        copy = nn.Parameter(last_weight.clone())
        copy.shared = copy.shared_embedding = copy.tensor_model_parallel = True
        params.insert(0, copy)
    return first, ReplicaSums(params, [f"p{i}" for i in range(len(params))], layout, rank=1)


def waiting(what: str) -> Any:
    return nullcontext()


def test_the_two_stages_take_the_same_sum_of_their_reduced_gradients_and_again_when_the_commit_is_retried() -> None:
    first, last = two_stages(torch.zeros(4), torch.zeros(4))
    pair = Pair()
    reduced_first = torch.tensor([9.0, 9, 9, 0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    reduced_last = torch.tensor([1e-17, 2.0, 3.0, 4.0, 7.0, 7.0], dtype=torch.float64)
    for _ in range(2):  # (a commit retried after a failure sums the same reduced values again)
        both(lambda: first.exchange(reduced_first, pair.end(0), 1, waiting),
             lambda: last.exchange(reduced_last, pair.end(1), 0, waiting))
    assert first.squared_norm(reduced_first) == pytest.approx(3 * 81 + ((0.1 + 1e-17) ** 2 + 2.2**2 + 3.3**2 + 4.4**2))
    assert last.squared_norm(reduced_last) == pytest.approx(7**2 + 7**2)  # (the copy is counted on the first stage)
    first.apply(reduced_first)
    last.apply(reduced_last)
    assert torch.equal(reduced_first[3:], reduced_last[:4])  # the same bytes on both ends
    assert reduced_first[3:].tolist() == [0.1 + 1e-17, 2.2, 3.3, 4.4]
    assert reduced_last[4:].tolist() == [7.0, 7.0] and reduced_first[:3].tolist() == [9.0, 9.0, 9.0]


def test_the_last_stage_starts_from_the_first_stages_values() -> None:
    first, last = two_stages(torch.arange(4.0), torch.zeros(4))  # (megatron-core's CPU constructor leaves zeros)
    pair = Pair()
    assert both(lambda: first.tie(pair.end(0), 1, waiting), lambda: last.tie(pair.end(1), 0, waiting)) == [None, None]
    assert torch.equal(last.params[0].detach(), torch.arange(4.0))


def test_a_model_tied_on_one_end_only_is_refused_on_both_ends_instead_of_waiting() -> None:
    first, last = two_stages(torch.arange(4.0), None)
    pair = Pair()
    results = both(lambda: first.tie(pair.end(0), 1, waiting), lambda: last.tie(pair.end(1), 0, waiting))
    assert all(isinstance(r, ConfigError) and "matching copies" in str(r) for r in results), results


# -- forward_step ----------------------------------------------------------------------------------------------
class StageModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.inputs: list = []

    def set_input_tensor(self, input_tensor: Any) -> None:
        self.inputs.append(input_tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x if self.inputs[-1] is None else self.inputs[-1])


class Module(nn.Module):
    def __init__(self, two_tuple: bool = False) -> None:
        super().__init__()
        self.model, self.two_tuple = StageModel(), two_tuple

    def forward_step(self, data_iterator: Any, model: nn.Module) -> tuple[torch.Tensor, Any]:
        (x,) = next(data_iterator)
        output = model(x)

        def loss_func(output_tensor: torch.Tensor) -> tuple:
            loss = output_tensor.sum()
            return (loss, {"lm loss": loss}) if self.two_tuple else (loss, torch.tensor(4), {"lm loss": loss})
        return output, loss_func


def test_forward_step_runs_each_stage_through_set_input_tensor_and_takes_the_loss_as_megatron_does() -> None:
    module = Module()
    x, received = torch.ones(2, 2), torch.full((2, 2), 2.0)
    output = MegatronStage(module, last=False)(((x,)), received)
    assert module.model.inputs == [received] and torch.equal(output, module.model.linear(received))
    loss = MegatronStage(module, last=True)((x,), None)  # (first stage: set_input_tensor(None), as megatron's)
    assert module.model.inputs[-1] is None
    assert torch.allclose(loss.mean, module.model.linear(x).sum() / 4)  # (loss_sum, num_tokens, report)
    assert torch.allclose(loss.to_backward(per_token=True), module.model.linear(x).sum())  # per-token: the sum
    assert int(loss.count(per_token=True)) == 4 and loss.count(per_token=False) == 1.0
    assert torch.allclose(run_forward_step(Module(two_tuple=True).forward_step, (x,), module.model)["loss"],
                          module.model.linear(x).sum())  # (loss, report): as it is
    with pytest.raises(ConfigError, match="loss_func must return"):
        loss_of(torch.ones(()))


def test_the_stage_model_is_the_outermost_with_set_input_tensor_and_ambiguity_is_refused() -> None:
    module = Module()
    assert stage_model(module) is module.model
    with pytest.raises(ConfigError, match="set_input_tensor"):
        stage_model(nn.Linear(2, 2))
    module.other = StageModel()
    with pytest.raises(ConfigError, match="several submodules"):
        stage_model(module)


# -- refusals -------------------------------------------------------------------------------------------------
def test_megatron_cores_ddp_wrapper_and_optimizers_are_refused() -> None:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import DistributedOptimizer

    wrapped = nn.Module()
    ddp = object.__new__(DistributedDataParallel)
    nn.Module.__init__(ddp)
    wrapped.module = ddp
    with pytest.raises(ConfigError, match="DistributedDataParallel.*strategy reduces"):
        check_wrappers(wrapped, [])
    from megatron.core.distributed import FullyShardedDataParallel

    fsdp = object.__new__(FullyShardedDataParallel)
    nn.Module.__init__(fsdp)
    wrapped.module = fsdp
    with pytest.raises(ConfigError, match="FullyShardedDataParallel.*strategy reduces"):
        check_wrappers(wrapped, [])
    with pytest.raises(ConfigError, match="DistributedOptimizer"):
        check_wrappers(nn.Linear(2, 2), [object.__new__(DistributedOptimizer)])
    check_wrappers(nn.Linear(2, 2), [torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)])


@pytest.mark.parametrize("change, match", [
    ({"pipeline_model_parallel_size": 1}, "pipeline_model_parallel_size is 1 but the strategy's is 2"),
    ({"tensor_model_parallel_size": 2}, "tensor_model_parallel_size is 2"),
    ({"virtual_pipeline_model_parallel_size": 2}, "interleaved"),
    ({"context_parallel_size": 2}, "context parallelism is not supported"),
    ({"expert_model_parallel_size": 2}, "expert parallelism is not supported"),
    ({"defer_embedding_wgrad_compute": True}, "defer_embedding_wgrad_compute=True is not supported.*DDP buffers"),
    ({"fp8": "hybrid"}, "fp8=hybrid is not supported.*amax"),
    ({"tp_comm_overlap": True}, "tp_comm_overlap=True is not supported.*userbuffer"),
    ({"num_moe_experts": 2}, "mixture-of-experts"),
    ({"mtp_num_layers": 1}, "multi-token prediction"),
])
def test_megatron_configs_the_strategy_would_train_wrongly_are_refused(change: dict, match: str) -> None:
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, pipeline_model_parallel_size=2,
                               pipeline_dtype=torch.float32, gradient_accumulation_fusion=False)
    module = nn.Linear(2, 2)
    module.config = config
    check_configs(module, 1, 2)
    for name, value in change.items():
        setattr(config, name, value)
    with pytest.raises(ConfigError, match=match):
        check_configs(module, 1, 2)


# -- the groups a GPTModel holds ------------------------------------------------------------------------------
@pytest.fixture
def world() -> Any:
    """A world of one rank with megatron-core's groups (TP = PP = 1), destroyed afterwards."""
    store = dist.HashStore()
    yield lambda generation: rebuild_world(store, generation, ModelParallel(), [0], 0, module=None)
    destroy_world()


def gpt_model() -> nn.Module:
    sys.path.insert(0, EXAMPLES)
    try:
        from megatron_gpt import GPTModule
    finally:
        sys.path.remove(EXAMPLES)
    module = GPTModule(layers=2)
    module.configure_model()
    return module


def held(module: nn.Module) -> list[Any]:
    from megatron.core.process_groups_config import ProcessGroupCollection

    found, collections = [], {}
    for sub in module.modules():
        for value in vars(sub).values():
            if isinstance(value, (dist.ProcessGroup, ReleasedGroup)):
                found.append(value)
            elif isinstance(value, ProcessGroupCollection):
                collections[id(value)] = value  # (modules share one collection)
    for collection in collections.values():
        found += [v for v in vars(collection).values() if isinstance(v, (dist.ProcessGroup, ReleasedGroup))]
    return found


@pytest.mark.compat
def test_every_group_a_gptmodel_holds_is_the_new_worlds_after_the_world_is_rebuilt(world: Any) -> None:
    world(0)
    module = gpt_model()
    check_groups(module)
    old = current_groups()
    before = held(module)
    assert before and {id(g) for g in before} <= {id(g) for g in old.values()}
    assert release_groups(module) == len(before)
    assert all(isinstance(g, ReleasedGroup) for g in held(module))  # (nothing refers to the old world's groups)
    store = dist.HashStore()
    rebuild_world(store, 1, ModelParallel(), [0], 0, module=module)
    new = current_groups()
    after = held(module)
    assert len(after) == len(before) and {id(g) for g in after} <= {id(g) for g in new.values()}
    assert not {id(g) for g in after} & {id(g) for g in old.values()}
    assert module.model.pg_collection.tp is new["tp"] and module.model.decoder.layers[0].mlp.linear_fc1.tp_group \
        is new["tp"]
    assert rebind_groups(module) == 0  # (nothing left to rebind)
    check_groups(module)


def test_a_group_the_model_made_itself_is_refused_at_fit(world: Any) -> None:
    world(0)
    module = nn.Linear(2, 2)
    module.group = dist.new_group([0])
    with pytest.raises(ConfigError, match="not one of megatron-core's parallel_state groups"):
        check_groups(module)
