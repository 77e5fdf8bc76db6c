"""Progress within a step, in-process: the modules marked, a mark at each forward and backward, gradients unchanged."""

from __future__ import annotations

import torch
from torch import nn

from unicron_elastic.strategy.lightning.progress import marked_modules, watch_progress


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)])
        self.head = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randint(0, 8, (2, 5))
    model.zero_grad()
    model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_the_top_level_modules_and_each_layer_of_a_module_list_are_marked() -> None:
    model = Tiny()
    assert marked_modules(model) == [model.embed, model.blocks, model.head, *model.blocks]


def test_each_marked_forward_and_backward_marks_progress_and_gradients_are_unchanged() -> None:
    torch.manual_seed(1)
    model = Tiny()
    before = _grads(model)
    marks: list[int] = []
    handles = watch_progress(model, lambda: marks.append(1))
    after = _grads(model)
    # forward: embed, 3 blocks, head (the ModuleList itself is never called); backward reaches each of their
    # 5 outputs (the embedding's needs a gradient too, for its weight): 5 + 5
    assert len(marks) == 10
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    for handle in handles:
        handle.remove()
    marks.clear()
    _grads(model)
    assert marks == []
    with torch.no_grad():
        watch_progress(model, lambda: marks.append(1))
        model(torch.randint(0, 8, (2, 5)))
    assert len(marks) == 5  # forward only: nothing to reach backwards
