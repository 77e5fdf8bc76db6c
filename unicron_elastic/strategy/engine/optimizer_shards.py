"""A sharded optimizer that survives lost ranks: Megatron-LM's distributed optimizer with instances.

:class:`OptimizerShards` turns the user's element-wise torch optimizer
(:data:`ELEMENT_WISE`: SGD, Adam, AdamW, RMSprop, Adamax) into a
sharded one: each parameter group's parameters are seen as one flat range,
this rank keeps its share of it (:class:`~unicron_elastic.strategy.engine.shard_layout.ShardLayout`)
as an fp32 *main parameter*, and the optimizer's ``param_groups`` are pointed
at those main parameters, so its per-element state (Adam's two moments) exists
for the share only: 12 bytes per element of the share with Adam, against 8
per parameter kept by every rank without sharding. Learning-rate schedulers
keep working: they change the same ``param_groups``.

One step of the engine with it:

* the gradients are reduced as without sharding (every rank then holds the
  whole reduced sum, which keeps the engine's recovery of a step unchanged:
  any rank can take any share);
* ``optimizer.step()`` (a step pre-hook loads this share's gradients into the
  main parameters' ``grad``) updates this rank's share only, without a collective;
* the next collective of the group, before the next step computes (or when
  training ends), is the protocol's :class:`~unicron_elastic.strategy.engine.effects.Refresh`:
  :meth:`OptimizerShards.refresh` first *reshards* when the members changed
  (every rank's new share copied from the ranks holding it: another instance
  for a lost rank's share), then *gathers* the updated main parameters into
  every rank's model.

An element-wise optimizer's step on a share equals the same elements of its
step on the whole parameters, to the bit: with ``grad_dtype=float64`` the
parameters equal the unsharded engine's.

Half-precision model parameters (``bf16-true``; Megatron-LM's mixed precision):
the main parameters are float32 all the same; the gather rounds them into the
model. Their gradients are loaded from the reduced sum itself (``main_grad``:
:func:`~unicron_elastic.strategy.engine.gradients.optimizer_gradient`), not
rounded to the parameters' dtype, and a whole state (checkpoints, snapshots)
holds each such parameter's float32 main parameter under :data:`MAIN_PARAM`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any

import structlog
import torch
import torch.distributed as dist

from unicron_elastic.api import ConfigError, ShardLostError
from unicron_elastic.strategy.engine.flat_group import FlatGroup, ParamBuffer
from unicron_elastic.strategy.engine.param_gather import GatherPiece, OverlappedGather
from unicron_elastic.strategy.engine.shard_layout import Piece, ShardLayout, plan_pieces

__all__ = ["ELEMENT_WISE", "MAIN_PARAM", "SHARED_ELSEWHERE", "OptimizerShards", "check_element_wise", "main_of",
           "same_step", "scalar_dtype", "share_format", "share_of", "states_per_group"]

#: Marks an optimizer state dict that holds no per-element state because each rank holds its own share (what a
#: replica hands a joiner: the joiner gets its share from the members when its group forms).
SHARED_ELSEWHERE = "unicron_optimizer_state_shared_elsewhere"

#: The per-parameter key of a whole state that holds a half-precision parameter's float32 main parameter (where the
#: optimizer has state: the model's own values are the main parameters' before the first step).
MAIN_PARAM = "main_param"

log = structlog.get_logger(__name__)

#: The optimizers whose step is element-wise (a share's step equals those elements of the whole step):
#: their per-element state keys and their scalar state keys.
ELEMENT_WISE: dict[type, tuple[tuple[str, ...], tuple[str, ...]]] = {
    torch.optim.SGD: (("momentum_buffer",), ()),
    torch.optim.Adam: (("exp_avg", "exp_avg_sq", "max_exp_avg_sq"), ("step",)),
    torch.optim.AdamW: (("exp_avg", "exp_avg_sq", "max_exp_avg_sq"), ("step",)),
    torch.optim.RMSprop: (("square_avg", "momentum_buffer", "grad_avg"), ("step",)),
    torch.optim.Adamax: (("exp_avg", "exp_inf"), ("step",)),
}


def check_element_wise(optimizer: torch.optim.Optimizer) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The optimizer's per-element and scalar state keys, if it can be sharded.

    Raises:
        ConfigError: Its step is not known to be element-wise (a subclass may change the step, so only these
            classes themselves are accepted).
    """
    keys = ELEMENT_WISE.get(type(optimizer))
    if keys is None:
        names = ", ".join(f"torch.optim.{cls.__name__}" for cls in ELEMENT_WISE)
        raise ConfigError(f"{type(optimizer).__module__}.{type(optimizer).__qualname__} cannot be sharded: the "
                          f"distributed optimizer needs an element-wise optimizer ({names}), whose step on a share "
                          "of the parameters equals the same elements of its step on all of them")
    return keys


def scalar_dtype() -> torch.dtype:
    """The dtype torch's optimizers give their ``step`` counter."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class OptimizerShards:
    """This rank's shares of a sharded optimizer's state, and the moves that keep them right.

    Args:
        instances: Optimizer instances (copies of the whole state; Megatron-LM's
            ``num_distributed_optimizer_instances``).
        device: Where collectives take their tensors (gloo: the CPU; NCCL: the GPU).
        waiting: ``waiting(what)``: a context that reports this rank's wait on its group.
        point: ``point(kind)``: a fault-injection point (``"optimizer_step"``: its gradients loaded, before the
            optimizer's step; ``"gather"``: the parameters' gather begun).
        updated: Called after each optimizer step (the parameters are stale until the next refresh).
        holds: This rank holds its share from the start (False: a joiner, which gets it when admitted).
        wait: ``wait(pg, work)``: waits for a collective's result and raises when it failed
            (:meth:`~unicron_elastic.strategy.engine.transport.CollectiveTransport.wait`; NCCL's ``wait()``
            alone orders the streams and raises nothing).

    Raises:
        ConfigError: ``instances`` is below 1.
    """

    def __init__(self, instances: int, device: torch.device, waiting: Callable[[str], Any],
                 point: Callable[[str], None], updated: Callable[[], None], holds: bool = True,
                 wait: Callable[[dist.ProcessGroup, Any], None] = lambda pg, work: work.wait()) -> None:
        if instances < 1:
            raise ConfigError(f"optimizer_instances must be >= 1, got {instances}")
        self.instances, self.device, self.waiting, self.point = instances, device, waiting, point
        self.wait = wait
        self.updated, self.holds = updated, holds
        self._hooks: list[Any] = []
        #: ``(generation, layout)`` of the last refresh that completed here (its members held their shares).
        self._refreshed: tuple[int, ShardLayout] | None = None
        #: Set by the engine: the whole state, a collective of the members, on the rank that writes checkpoints
        #: (None on the others).
        self.collector: Callable[[], dict[str, Any] | None] | None = None
        #: A whole state collected for the dump in progress (a checkpoint, the snapshot tiers): what the
        #: optimizer's ``state_dict()`` returns; None: its share marked :data:`SHARED_ELSEWHERE`.
        self.whole: dict[str, Any] | None = None
        #: Set by a trainer that keeps snapshots: where a lost share sends the run back (for the warning at
        #: :meth:`bind` and the error when a share is lost).
        self.returns_to: Callable[[], str] = lambda: "the newest snapshot or checkpoint"
        #: Set by the engine with ``reduce_scatter``: the model's parameters as views of one flat buffer (float32
        #: parameters: the main parameters are views of them, and the gather lands in them); None: none.
        self.param_buffer: ParamBuffer | None = None
        #: Set by the engine with ``reduce_scatter``: this rank's reduced share of the flat gradient sum and its
        #: ``(start, end)`` in it (None before a step reduced one); None without reduce-scatter.
        self.reduced_share: Callable[[], tuple[torch.Tensor, tuple[int, int]] | None] = lambda: None
        #: Set by the engine with ``overlap_param_gather``: the gather an overlapped refresh starts.
        self.overlapped: OverlappedGather | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.groups: list[FlatGroup] = []
        #: Elements of the flat gradient sum (the shares are its parts).
        self.flat_numel = 0
        self._shares: dict[ShardLayout, dict[int, list[tuple[int, int]]]] = {}  # the last layout's, per member
        #: Per parameter group: the ``(start, end)`` this rank holds.
        self.held: list[tuple[int, int]] = []
        #: Per parameter group: the fp32 main parameter of what this rank holds (the optimizer steps these).
        self.main: list[torch.nn.Parameter] = []
        self._keys: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())

    # -- set-up ------------------------------------------------------------------------------------------
    def layout(self, members: Sequence[int]) -> ShardLayout:
        """How ``members`` (the data-parallel members, in order) hold the state."""
        return ShardLayout(tuple(members), self.instances)

    def shares(self, layout: ShardLayout, member: int) -> list[tuple[int, int]]:
        """Per group, the range ``member`` holds in ``layout``: the group's part of its share of the flat
        gradient sum (``(0, 0)``: none). Kept per layout (each refresh asks it of every member)."""
        if layout not in self._shares:
            self._shares = {layout: {m: [g.project(*layout.range_of(m, self.flat_numel)) for g in self.groups]
                                     for m in layout.members}}
        return self._shares[layout].get(member, [(0, 0)] * len(self.groups))

    def bind(self, optimizer: torch.optim.Optimizer, reduced: Sequence[torch.nn.Parameter],
             members: Sequence[int], member: int) -> None:
        """Point ``optimizer`` at this rank's shares of ``members``' layout (none for a joiner); hook its step.

        Raises:
            ConfigError: The optimizer is not element-wise, already has state, or steps a parameter whose
                gradient the engine does not reduce.
        """
        self._keys = check_element_wise(optimizer)
        if any(optimizer.state.values()):
            raise ConfigError("the optimizer already has state: give the distributed optimizer a fresh one (a "
                              "checkpoint's optimizer state is loaded after set-up)")
        flat_start, at = {}, 0
        for p in reduced:  # (the flat gradient sum's order)
            flat_start[id(p)], at = at, at + p.numel()
        self.optimizer, self.groups, self.flat_numel, self._shares = optimizer, [], at, {}
        for group in optimizer.param_groups:
            params = [p for p in group["params"] if p.requires_grad]
            if any(id(p) not in flat_start for p in params):
                raise ConfigError("the optimizer steps a parameter the engine does not reduce (not in the model)")
            self.groups.append(FlatGroup(params, flat_start))
        layout = self.layout(members)
        self.whole = None
        self._hold_own(self.shares(layout, member) if self.holds else [(0, 0)] * len(self.groups))
        for handle in self._hooks:
            handle.remove()
        self._hooks = [optimizer.register_step_pre_hook(self._before_step),
                       optimizer.register_step_post_hook(lambda *args: self.updated()),
                       optimizer.register_state_dict_post_hook(self._state_dict),
                       optimizer.register_load_state_dict_pre_hook(lambda opt, state: share_format(self, state))]
        if layout.copies == 1 and len(layout.members) > 1:
            log.warning("optimizer_state_without_copy", instances=self.instances,
                        consequence=f"a lost rank costs every rank a return to {self.returns_to()}")

    def _before_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Load this share's gradients before the optimizer's step computes: after its closure, when it has one
        (Lightning's: the closure runs the step's backward, whose reduction sets the gradients)."""
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # (args[0] is the optimizer)
        if closure is None:
            self._load_and_point()
            return None

        def then_load() -> Any:
            loss = closure()
            self._load_and_point()
            return loss

        return args[:1], {**{k: v for k, v in kwargs.items() if k != "closure"}, "closure": then_load}

    def _load_and_point(self) -> None:
        self.load_gradients()
        self.point("optimizer_step")

    @contextmanager
    def collected(self) -> Iterator[None]:
        """Inside: the optimizer's ``state_dict()`` is the whole state (:attr:`collector`: a collective)."""
        self.whole = self.collector()
        try:
            yield
        finally:
            self.whole = None

    def _state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        """What the optimizer's ``state_dict()`` returns: :attr:`whole` when collected, else its share marked
        :data:`SHARED_ELSEWHERE` without the per-element state (what a replica hands a joiner)."""
        if self.whole is not None:
            return self.whole
        return {**state_dict, "state": {}, SHARED_ELSEWHERE: True}

    @property
    def scalar_keys(self) -> tuple[str, ...]:
        """The optimizer's scalar state keys (``step``), the same for every element of a group."""
        return self._keys[1]

    def main_device(self, g: int) -> torch.device:
        """Where group ``g``'s main parameter lives (its parameters' device)."""
        return self.main[g].device

    def hold(self, held: list[tuple[int, int]], main: list[torch.Tensor], states: list[dict[str, Any]]) -> None:
        """Hold ``main`` (fp32, per group) over ``held`` and its optimizer state; the optimizer's groups point at
        them."""
        optimizer = self.optimizer
        self._refreshed = None  # (what this rank holds changed)
        for old in self.main:
            optimizer.state.pop(old, None)
        buffer = self._backing()
        main = [self._in_buffer(buffer, g, r, m) for g, (r, m) in enumerate(zip(held, main))]
        self.held, self.main = list(held), [torch.nn.Parameter(m, requires_grad=True) for m in main]
        for group, param, state in zip(optimizer.param_groups, self.main, states):
            group["params"] = [param]
            if state:
                optimizer.state[param] = state

    def _in_buffer(self, buffer: ParamBuffer | None, g: int, held: tuple[int, int],
                   main: torch.Tensor) -> torch.Tensor:
        """``main`` as the view of the model's parameters it equals, where ``buffer`` (:meth:`_backing`) backs
        them and group ``g``'s ``held`` is one run of it (its values copied into the parameters); else ``main``."""
        view = self._view(buffer, g, *held)
        if view is None or main.numel() != view.numel():
            return main
        with torch.no_grad():
            view.copy_(main)
        return view

    def _backing(self) -> ParamBuffer | None:
        """:attr:`param_buffer` while it backs every parameter (checked once per hold or gather); None from the
        first time it does not."""
        buffer = self.param_buffer
        if buffer is not None and not buffer.backs():
            log.warning("param_buffer_replaced", consequence="the shares copy the parameters from now on")
            self.param_buffer = buffer = None
        return buffer

    def _view(self, buffer: ParamBuffer | None, g: int, start: int, end: int) -> torch.Tensor | None:
        """``buffer``'s view of group ``g``'s ``[start, end)`` (None: no buffer, or the range is empty or not one
        run of it)."""
        if buffer is None or end <= start:
            return None
        return buffer.view(self.groups[g].flat_span(start, end))

    # -- one step ----------------------------------------------------------------------------------------
    def load_gradients(self) -> None:
        """(Before the optimizer's step) this rank's share of the reduced gradients into the main parameters:
        from the model's gradients, or (reduce-scattered: :attr:`reduced_share`) from the reduced share itself,
        a view of it where a group's part is one float32 run of it.

        Raises:
            RuntimeError: (Reduce-scattered) the share received is not the one this rank holds.
        """
        scattered = self.reduced_share()
        for group, main, (start, end) in zip(self.groups, self.main, self.held):
            if scattered is None:
                main.grad = group.read(start, end, grad=True)
                continue
            share, (first, last) = scattered
            if group.project(first, last) != (start, end):
                raise RuntimeError(f"the reduced share {first}..{last} of the flat sum is not the share this rank "
                                   f"holds ({start}..{end} of a group): its layout changed without a reshard")
            main.grad = group.read_share(start, end, share, first)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: its fp32 main parameters and their optimizer state."""
        total = sum(m.numel() * m.element_size() for m in self.main)
        for main in self.main:
            total += sum(v.numel() * v.element_size() for v in self.optimizer.state.get(main, {}).values()
                         if isinstance(v, torch.Tensor))
        return total

    # -- the moves ---------------------------------------------------------------------------------------
    def refresh(self, pg: dist.ProcessGroup | None, members: Sequence[int], member: int, generation: int,
                every_rank: dist.ProcessGroup | None = None, overlap: bool = False) -> None:
        """Reshard when what the ranks hold is not their share of ``members``' layout, then gather the parameters.

        A collective over ``pg`` (the shard's data-parallel group of
        ``members``, in their order): every rank calls it. First the ranks
        tell each other what they hold (unless a refresh of this generation
        completed here: then each holds its share of the layout); the plan of
        the moves is then the same on every rank.

        With TP x PP > 1 (``every_rank``: the group of every rank) each shard
        of the model refreshes in its own data-parallel group, and a lost rank
        fails only its shard's: the ranks then agree over ``every_rank`` whether
        every shard's refresh completed, so that no replica computes with a
        shard whose parameters are stale (its model's collectives would not
        match).

        With ``overlap`` (:attr:`overlapped`; not with ``every_rank``) the gather is only started: the next
        computation waits for it. A refresh without ``overlap`` first finishes a gather started in the same
        groups (and then gathers nothing again); one started in groups gone since is dropped.

        Raises:
            RuntimeError: The group failed (a member was lost), or was gone already; with ``every_rank``, also
                another shard's refresh failed.
            ShardLostError: Part of the state is held by no member any more.
        """
        try:
            self._refresh_shard(pg, members, member, generation, overlap)
            failed = 0.0
        except RuntimeError as exc:
            if every_rank is None:
                raise
            self._refreshed, failed = None, 1.0
            log.warning("dp_refresh_failed_in_shard", error=str(exc)[:200])
        except (ShardLostError, ValueError) as exc:  # (the other shards are told before this rank stops)
            if isinstance(exc, ShardLostError):
                log.error("optimizer_state_lost", elements=[exc.start, exc.end], returns_to=self.returns_to())
            if every_rank is not None:
                with suppress(RuntimeError):  # (this error, not the collective's, is what stops it)
                    self._agree(every_rank, 2.0)
            raise
        if every_rank is not None and self._agree(every_rank, failed):
            self._refreshed = None
            raise RuntimeError("a shard of the model failed to gather its parameters")

    def _agree(self, every_rank: dist.ProcessGroup, failed: float) -> bool:
        """(TP x PP > 1) whether any rank's refresh failed (``failed``: this rank's, 0 or more), over every rank.

        Raises:
            RuntimeError: The collective failed (a rank was lost).
        """
        flag = torch.tensor([failed], device=self.device)
        with self.waiting("shards"):
            self.wait(every_rank, every_rank.allreduce([flag]))
        return bool(flag.item())

    def _refresh_shard(self, pg: dist.ProcessGroup | None, members: Sequence[int], member: int,
                       generation: int, overlap: bool = False) -> None:
        """:meth:`refresh` in this shard's data-parallel group ``pg``.

        Raises:
            RuntimeError: The group failed (a member was lost), or was gone already.
            ShardLostError: Part of the state is held by no member any more.
        """
        if pg is None:
            raise RuntimeError("the group failed before the parameters were gathered")
        gather = self.overlapped
        if gather is not None and gather.pending is not None:
            if not overlap and gather.pending == gather.groups.built:
                gather.finish()  # (raises GatherFailed, a RuntimeError)
                return
            gather.discard()
        layout = self.layout(members)
        if self._refreshed == (generation, layout):  # (every member's holdings are its share: nothing moved since)
            self._gather(pg, [[(*share_, 0) for share_ in self.shares(layout, m)] for m in layout.members], overlap)
            return
        self._refreshed = None
        held = self.exchange(pg)
        same_step(held)
        shares = [self.shares(layout, m) for m in layout.members]
        if [[_empty_as_zero(h[:2]) for h in rank] for rank in held] != shares:
            self._reshard(pg, held, shares[layout.members.index(member)])
            held = [[(*share_, 0) for share_ in rank] for rank in shares]
        self._gather(pg, held, overlap, lambda: setattr(self, "_refreshed", (generation, layout)))

    def exchange(self, pg: dist.ProcessGroup) -> list[list[tuple[int, int, int]]]:
        """What every rank of ``pg`` holds: per rank, per group ``(start, end, stepped)``.

        ``stepped`` is 0 without optimizer state, else 1 + the optimizer's step
        count where it keeps one (Adam's ``step``): holders at different steps
        are refused, never mixed.
        """
        mine = torch.tensor([v for g, (start, end) in enumerate(self.held) for v in (start, end, self._stepped(g))],
                            dtype=torch.int64).to(self.device)
        outs = [torch.empty_like(mine) for _ in range(pg.size())]
        with self.waiting("shards"):
            self.wait(pg, pg.allgather([outs], [mine]))
        return [[tuple(int(x) for x in out[3 * g:3 * g + 3].tolist()) for g in range(len(self.groups))]
                for out in outs]

    def _reshard(self, pg: dist.ProcessGroup, held: list[list[tuple[int, int, int]]],
                 wanted: list[tuple[int, int]]) -> None:
        """Make this rank hold ``wanted`` (per group) with its optimizer state, copied from the holders."""
        main, states = [], []
        for g, group in enumerate(self.groups):
            ranks = [h[g] for h in held]
            pieces = plan_pieces([(start, end) for start, end, _ in ranks], group.numel)
            stepped = {ranks[p.source][2] for p in pieces if p.end > p.start}
            if len(stepped) > 1:  # (the protocol never mixes them: a rank behind is left out, a joiner holds none)
                raise ValueError(f"the holders of the optimizer state are at different steps: {sorted(stepped)}")
            keys = self.present(g) if stepped and stepped != {0} else None
            new_main, new_state = self._receive_group(pg, g, pieces, wanted[g], keys)
            main.append(new_main)
            states.append(new_state)
        log.info("optimizer_state_resharded", held=[h[0][:2] for h in held], wanted=wanted)
        self.hold(wanted, main, states)

    def _stepped(self, g: int) -> int:
        state = self.optimizer.state.get(self.main[g])
        if not state:
            return 0
        return 1 + (int(float(state["step"])) if self.scalar_keys else 0)

    def hold_fresh(self) -> None:
        """Hold all of the state, from this rank's own parameters, with no optimizer state yet (the group starts
        again from step 0: nothing was saved)."""
        self._hold_own([(0, g.numel) for g in self.groups])

    def drop(self) -> None:
        """Hold nothing (a rank that rejoins: what it held is stale); its share comes when its group forms."""
        self._hold_own([(0, 0)] * len(self.groups))

    def _hold_own(self, ranges: list[tuple[int, int]]) -> None:
        """Hold ``ranges`` (per group) from this rank's own parameters, with no optimizer state."""
        self.hold(ranges, [g.read(*r) for g, r in zip(self.groups, ranges)], [{} for _ in self.groups])

    def present(self, g: int) -> tuple[str, ...]:
        """The per-element state keys the optimizer keeps for group ``g`` (from its hyperparameters)."""
        group = self.optimizer.param_groups[g]
        per_element, _ = self._keys
        present = []
        for key in per_element:
            if key == "max_exp_avg_sq" and not group.get("amsgrad", False):
                continue
            if key == "momentum_buffer" and not group.get("momentum", 0):
                continue
            if key == "grad_avg" and not group.get("centered", False):
                continue
            present.append(key)
        return tuple(present)

    def _receive_group(self, pg: dist.ProcessGroup, g: int, pieces: list[Piece], wanted: tuple[int, int],
                       keys: tuple[str, ...] | None) -> tuple[torch.Tensor, dict[str, Any]]:
        """Group ``g``'s new main parameter and state over ``wanted``, from the pieces' broadcasts."""
        index, (start, end) = pg.rank(), wanted
        rows = 1 + (len(keys) if keys is not None else 0)
        out = torch.zeros(rows, end - start, dtype=torch.float32, device=self.main[g].device)
        step = torch.zeros(1, dtype=torch.float64)
        for n, piece in enumerate(pieces):
            buf = self.rows(g, piece, keys) if piece.source == index else \
                torch.empty(rows, piece.end - piece.start, dtype=torch.float32, device=self.main[g].device)
            self._broadcast(pg, buf, piece.source)
            a, b = max(start, piece.start), min(end, piece.end)
            if a < b:
                out[:, a - start:b - start].copy_(buf[:, a - piece.start:b - piece.start])
            if n == 0 and keys is not None and self.scalar_keys:
                step = self.step_of(g) if piece.source == index else step
                self._broadcast(pg, step, piece.source)
        state: dict[str, Any] = {}
        if keys is not None:
            state = {key: out[1 + k].clone() for k, key in enumerate(keys)}
            if self.scalar_keys:
                state["step"] = torch.tensor(float(step), dtype=scalar_dtype())
        return out[0].clone(), state

    def rows(self, g: int, piece: Piece, keys: tuple[str, ...] | None) -> torch.Tensor:
        """(The source) its main parameter and state over ``piece``, one row each."""
        first = self.held[g][0]
        a, b = piece.start - first, piece.end - first
        state = self.optimizer.state.get(self.main[g], {})
        rows = [self.main[g].detach()[a:b]] + [state[key][a:b] for key in (keys or ())]
        return torch.stack(rows).to(torch.float32)

    def step_of(self, g: int) -> torch.Tensor:
        return torch.tensor([float(self.optimizer.state[self.main[g]]["step"])], dtype=torch.float64)

    def _gather(self, pg: dist.ProcessGroup, held: list[list[tuple[int, int, int]]], overlap: bool = False,
                done: Callable[[], None] = lambda: None) -> None:
        """Every parameter of the model set from the main parameter of the rank that holds it, then ``done()``
        (``overlap``: the pieces' broadcasts started; :attr:`overlapped` writes them and calls ``done()`` once all
        are written)."""
        index, started, buffer = pg.rank(), [], self._backing()
        for g, group in enumerate(self.groups):
            pieces = plan_pieces([h[g][:2] for h in held], group.numel)
            for n, piece in enumerate(pieces):
                buf = in_place = self._view(buffer, g, piece.start, piece.end)  # (the parameters themselves)
                if buf is None and piece.source == index:
                    first = self.held[g][0]
                    buf = self.main[g].detach()[piece.start - first:piece.end - first].clone()
                elif buf is None:
                    buf = torch.empty(piece.end - piece.start, dtype=torch.float32, device=self.main[g].device)
                if overlap:
                    started += [self._start_piece(pg, group, part, buf[part.start - piece.start:part.end - piece.start],
                                                  in_place is not None) for part in self.overlapped.parts(piece)]
                else:
                    self._broadcast(pg, buf, piece.source)
                    if in_place is None:
                        group.write(piece.start, buf)
                if n == 0 and g == 0:
                    self.point("gather")
        if overlap:
            self.overlapped.start(self.overlapped.groups.built, started, done)
        else:
            done()

    def _start_piece(self, pg: dist.ProcessGroup, group: FlatGroup, piece: Piece, buf: torch.Tensor,
                     in_place: bool = False) -> GatherPiece:
        """Start ``piece``'s broadcast without waiting; what writes it into the model once it arrived (nothing
        when ``buf`` is the parameters' own memory and the collectives take it as it is)."""
        staged = buf.to(self.device)
        work = _start_broadcast(pg, staged, piece.source)
        params = frozenset(id(p) for p, *_ in group.parts(piece.start, piece.end))
        if in_place and staged is buf:
            return GatherPiece(params, staged, work, lambda values: None)
        return GatherPiece(params, staged, work, lambda values, start=piece.start: group.write(start, values))

    def _broadcast(self, pg: dist.ProcessGroup, tensor: torch.Tensor, root: int) -> None:
        staged = tensor.to(self.device)
        with self.waiting("shards"):
            self.wait(pg, _start_broadcast(pg, staged, root))
        if staged is not tensor:
            tensor.copy_(staged)


def _start_broadcast(pg: dist.ProcessGroup, tensor: torch.Tensor, root: int) -> dist.Work:
    """``tensor`` broadcast from the rank at index ``root`` of ``pg``, started (its work not waited for)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    return pg.broadcast([tensor], opts)


def _empty_as_zero(held: tuple[int, int]) -> tuple[int, int]:
    """``(start, end)``, with every empty range written ``(0, 0)``."""
    return held if held[1] > held[0] else (0, 0)


def share_of(shards: OptimizerShards, g: int, per_param: list[dict[str, Any]], start: int,
              end: int) -> dict[str, Any]:
    """Group ``g``'s optimizer state over ``[start, end)`` from its parameters' states (empty: none yet)."""
    if not any(per_param):
        return {}
    state: dict[str, Any] = {}
    for key in shards.present(g):
        flat = torch.cat([s[key].reshape(-1).to(torch.float32) for s in per_param])
        state[key] = flat[start:end].clone().to(shards.main_device(g))
    if shards.scalar_keys:
        state["step"] = torch.tensor(float(per_param[0]["step"]), dtype=scalar_dtype())
    return state



def main_of(per_param: list[dict[str, Any]], start: int, end: int) -> torch.Tensor | None:
    """A whole state's float32 main parameters (:data:`MAIN_PARAM`) of one group over ``[start, end)``; None when it
    holds none (float32 parameters, whose values are the main parameters, or no optimizer state yet)."""
    if not per_param or any(MAIN_PARAM not in s for s in per_param):
        return None
    return torch.cat([s[MAIN_PARAM].reshape(-1).to(torch.float32) for s in per_param])[start:end].clone()


def states_per_group(shards: OptimizerShards, state_dict: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """A whole state dict's per-parameter states, group by group (``{}`` for a parameter without state), each
    group's in the flat sum's order (:class:`~unicron_elastic.strategy.engine.flat_group.FlatGroup`).

    Raises:
        ValueError: ``state_dict`` does not match the optimizer's parameter groups.
    """
    groups = state_dict["param_groups"]
    if [len(g["params"]) for g in groups] != [len(g.params) for g in shards.groups]:
        raise ValueError(f"the optimizer state has groups of {[len(g['params']) for g in groups]} parameters, the "
                         f"optimizer {[len(g.params) for g in shards.groups]}")
    saved = state_dict["state"]
    return [flat.in_flat_order([saved.get(i, saved.get(str(i), {})) for i in group["params"]])
            for flat, group in zip(shards.groups, groups)]


def share_format(shards: OptimizerShards, state_dict: dict[str, Any]) -> dict[str, Any]:
    """A whole state dict (or one marked :data:`SHARED_ELSEWHERE`) as the sharded optimizer's own ``state_dict``:
    one main parameter per group, the state of this rank's share (what torch's ``load_state_dict`` loads).

    Where the whole state holds float32 main parameters (:data:`MAIN_PARAM`: half-precision parameters) this
    rank's main parameters are set from them (the model's own were rounded to its dtype).

    Raises:
        ValueError: ``state_dict`` does not match the optimizer's parameter groups.
    """
    groups = state_dict["param_groups"]
    if state_dict.get(SHARED_ELSEWHERE):  # its hyperparameters only: this rank keeps the share it holds
        state = {g: shards.optimizer.state[main] for g, main in enumerate(shards.main) if shards.optimizer.state.get(main)}
        return {"state": state, "param_groups": [{**g, "params": [i]} for i, g in enumerate(groups)]}
    state = {}
    for g, per_param in enumerate(states_per_group(shards, state_dict)):
        share = share_of(shards, g, per_param, *shards.held[g])
        if share:
            state[g] = share
        main = main_of(per_param, *shards.held[g])
        if main is not None:
            shards.main[g].detach().copy_(main)
    return {"state": state, "param_groups": [{**g, "params": [i]} for i, g in enumerate(groups)]}


def same_step(held: list[list[tuple[int, int, int]]]) -> None:
    """Refuse holdings (what :meth:`OptimizerShards.exchange` returns) whose optimizer states are at different steps.

    Raises:
        ValueError: Two ranks hold optimizer state of one group at different steps (never mixed silently).
    """
    for g in range(len(held[0]) if held else 0):
        stepped = {rank[g][2] for rank in held if rank[g][1] > rank[g][0] and rank[g][2]}
        if len(stepped) > 1:
            raise ValueError(f"the holders of the optimizer state are at different steps: {sorted(stepped)}")
