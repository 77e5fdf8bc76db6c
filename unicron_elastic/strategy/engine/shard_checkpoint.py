"""A sharded optimizer's state as one whole state dict, and back: what checkpoints hold.

:func:`collect` gathers every share of an
:class:`~unicron_elastic.strategy.engine.optimizer_shards.OptimizerShards` into
one rank as the state dict the unsharded optimizer would have
(``{"state": {i: {...}}, "param_groups": [...]}`` over the model's
parameters, in torch's format), like Megatron-LM's checkpoints gathered on
data-parallel rank 0: a checkpoint written at one data-parallel size and
instance count loads at any other, and into an unsharded optimizer too.
:func:`load` takes this rank's share out of such a dict (or, for the rank
that resumes a group from a checkpoint, all of it).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from unicron_elastic.strategy.engine.optimizer_shards import (MAIN_PARAM, OptimizerShards, main_of, same_step,
                                                              scalar_dtype, share_of, states_per_group)
from unicron_elastic.strategy.engine.shard_layout import plan_pieces

__all__ = ["collect", "load"]

#: Point-to-point tags per parameter group (pieces of a group, then its step counter).
_TAGS = 1 << 20


def collect(shards: OptimizerShards, pg: dist.ProcessGroup, root: int) -> dict[str, Any] | None:
    """The whole optimizer state, on the rank at index ``root`` of ``pg``; None on the others.

    A collective over ``pg`` (every rank calls it): each piece goes from the
    rank that holds it to ``root`` (point to point), so only ``root`` holds the
    whole state, for as long as the caller keeps it.

    Raises:
        RuntimeError: The group failed (a member was lost).
        ShardLostError: Part of the state is held by no member any more.
    """
    held = shards.exchange(pg)
    same_step(held)
    index = pg.rank()
    flats: list[dict[str, torch.Tensor]] = []
    steps: list[float | None] = []
    for g, group in enumerate(shards.groups):
        pieces = plan_pieces([h[g][:2] for h in held], group.numel)
        stateful = any(held[p.source][g][2] for p in pieces)
        keys = shards.present(g) if stateful else ()
        saved = ((MAIN_PARAM, 0),) if stateful and group.half else ()  # (row 0: the main parameter)
        saved += tuple((key, 1 + k) for k, key in enumerate(keys))
        flat = {key: torch.zeros(group.numel, dtype=torch.float32) for key, _ in saved} if index == root else {}
        for tag, piece in enumerate(pieces):
            rows = _moved(shards, pg, g, piece, keys, root, _TAGS * g + tag)
            if rows is not None and index == root:
                for key, row in saved:
                    flat[key][piece.start:piece.end].copy_(rows[row])
        step = torch.zeros(1, dtype=torch.float64)
        if stateful and shards.scalar_keys:
            source = pieces[0].source
            if source == index:
                step = shards.step_of(g)
            if source != root and index in (source, root):
                _point_to_point(pg, step, source, root, _TAGS * g + len(pieces))
        flats.append(flat)
        steps.append(float(step) if stateful and shards.scalar_keys else None)
    return _as_state_dict(shards, flats, steps) if index == root else None


def _moved(shards: OptimizerShards, pg: dist.ProcessGroup, g: int, piece: Any, keys: tuple[str, ...], root: int,
           tag: int) -> torch.Tensor | None:
    """``piece``'s rows (main parameter, then each key) as ``root`` receives them; None on a rank not involved."""
    index = pg.rank()
    if index not in (piece.source, root):
        return None
    if piece.source == index:
        rows = shards.rows(g, piece, keys).cpu()
    else:
        rows = torch.empty(1 + len(keys), piece.end - piece.start, dtype=torch.float32)
    if piece.source != root and index in (piece.source, root):
        _point_to_point(pg, rows, piece.source, root, tag)
    return rows


def _point_to_point(pg: dist.ProcessGroup, tensor: torch.Tensor, source: int, root: int, tag: int) -> None:
    """``tensor`` from ``source`` to ``root`` (each of them calls it)."""
    work = pg.send([tensor], root, tag) if pg.rank() == source else pg.recv([tensor], source, tag)
    work.wait()


def _as_state_dict(shards: OptimizerShards, flats: list[dict[str, torch.Tensor]],
                   steps: list[float | None]) -> dict[str, Any]:
    """torch's state dict of the unsharded optimizer over the model's parameters, from flat per-group state."""
    state: dict[int, dict[str, Any]] = {}
    param_groups = []
    base = 0
    for group, options, flat, step in zip(shards.groups, shards.optimizer.param_groups, flats, steps):
        for p, lo, hi, position in zip(group.params, group.offsets, group.offsets[1:], group.order):
            if flat:  # (ids follow the optimizer's order of the parameters, the group the flat sum's)
                state[base + position] = {key: values[lo:hi].view_as(p).clone() for key, values in flat.items()}
                if step is not None:
                    state[base + position]["step"] = torch.tensor(step, dtype=scalar_dtype())
        ids = list(range(base, base + len(group.params)))
        base += len(group.params)
        param_groups.append({**{k: copy.deepcopy(v) for k, v in options.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": param_groups}


def load(shards: OptimizerShards, state_dict: dict[str, Any], everything: bool = False) -> None:
    """Take this rank's share (``everything``: all of it) of a whole state dict (what :func:`collect` returns).

    The main parameters are ``state_dict``'s :data:`MAIN_PARAM` where it holds them (half-precision
    parameters), else read from the model's parameters (loaded from the same checkpoint); the optimizer's
    hyperparameters from ``state_dict``.

    Raises:
        ValueError: ``state_dict`` does not match the optimizer's parameter groups.
    """
    per_group = states_per_group(shards, state_dict)
    held = [(0, g.numel) for g in shards.groups] if everything else list(shards.held)
    main = [_main(group, per_param, start, end) for group, per_param, (start, end) in zip(shards.groups, per_group, held)]
    states = [share_of(shards, g, per_param, *held[g]) for g, per_param in enumerate(per_group)]
    for options, saved in zip(shards.optimizer.param_groups, state_dict["param_groups"]):
        options.update({k: v for k, v in saved.items() if k != "params"})
    shards.hold(held, main, states)



def _main(group: Any, per_param: list[dict[str, Any]], start: int, end: int) -> torch.Tensor:
    """A group's main parameter over ``[start, end)``: the state's float32 one, else the model's values."""
    main = main_of(per_param, start, end)
    return group.read(start, end) if main is None else main.to(group.params[0].device)
