"""The state a member hands to a joiner, and the fallback state when no replica is left.

A joiner asks to join, waits to be admitted at a step boundary (the
protocol's :meth:`~unicron_elastic.strategy.engine.protocol.Protocol.join`,
driven by :meth:`~unicron_elastic.strategy.engine.elastic_dp.ElasticDataParallel.join`)
and receives the state from a replica, tensor by tensor (:class:`StateHandout`'s
``TransferState`` effect). When no replica is left, the lowest joiner resumes
from the fallback (in-memory snapshot, then checkpoint, else step 0) and
hands that state to the others.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog
import torch

from unicron_elastic.strategy.engine import effects as E
from unicron_elastic.strategy.engine.engine_options import EngineHooks
from unicron_elastic.strategy.engine.groups import GenerationGroups
from unicron_elastic.strategy.engine.protocol import Protocol
from unicron_elastic.strategy.engine.state_transfer import broadcast_state

__all__ = ["StateHandout", "default_state", "load_default_state"]

log = structlog.get_logger(__name__)

#: No fallback state: this rank's fresh state is step 0's.
STEP0 = object()


def default_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A replica's state by default: model, optimizer, the CPU's RNG."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state()}


def load_default_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load what :func:`default_state` returned."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])


class StateHandout:
    """This replica's state at a step boundary: what it sends, loads, or resumes from.

    Args:
        protocol: The protocol (the step the state is at, the members).
        groups: The groups of the generation held (the state goes over the shard's group).
        rank: This launch rank.
        get_state: The state a replica hands to a joiner (the step is added).
        set_state: Loads what ``get_state`` returned.
        fallback: The state to resume from when no replica is left (``fallback()`` or, for the other shards
            of the resuming replica, ``fallback(step)``), or None.
    """

    def __init__(self, protocol: Protocol, groups: GenerationGroups, rank: int,
                 get_state: Callable[[], dict[str, Any]], set_state: Callable[[dict[str, Any]], None],
                 fallback: Callable[..., dict[str, Any] | None]) -> None:
        self.protocol, self.groups, self.rank = protocol, groups, rank
        self.get_state, self.set_state, self.fallback = get_state, set_state, fallback
        #: Where a joiner's state came from (``"replica"``, a snapshot's or checkpoint's source, ``"step0"``).
        self.state_source: str | None = None
        self._resume_state: Any = None
        self._resume_applied = False
        #: Called when the group starts again from this rank's fresh state (a sharded optimizer holds all of it).
        self.on_fresh: Callable[[], None] = lambda: None

    @classmethod
    def of(cls, protocol: Protocol, groups: GenerationGroups, rank: int, hooks: EngineHooks,
           owner: Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer]]) -> StateHandout:
        """The handout of ``hooks``' ``get_state``, ``set_state`` and ``fallback``; where one is None, the model's and
        the optimizer's state dicts (``owner()``: the engine's model and optimizer now), and no fallback."""
        return cls(protocol, groups, rank, hooks.get_state or (lambda: default_state(*owner())),
                   hooks.set_state or (lambda state: load_default_state(*owner(), state)),
                   hooks.fallback or (lambda step=None: None))

    def state(self) -> dict[str, Any]:
        """This replica's state at the current step boundary (what a joiner receives).

        A joiner that resumes the group from the fallback state (no replica
        was left) loads it on first use and hands out that state, its own live
        state being only partly restored until it trained a step.
        """
        if self._resume_state is STEP0:
            # Nothing was persisted: the fresh state is step 0's (a sharded optimizer's too: all of it, here).
            self.on_fresh()
            self._resume_state, self._resume_applied = {**self.get_state(), "step": 0, "source": "step0"}, True
        if self._resume_state is not None:
            if not self._resume_applied:
                self._apply(self._resume_state)
                self._resume_applied = True
            return self._resume_state
        return {**self.get_state(), "step": self.protocol.next_step}

    def _apply(self, state: dict[str, Any]) -> None:
        self.set_state(state)
        self.protocol.next_step = int(state["step"])

    def admitted(self, effect: E.Admitted) -> None:
        """This joiner was admitted: its state comes from ``effect.source``."""
        self.state_source = effect.source
        self._resume_state = None

    def resume(self, effect: E.Fallback) -> tuple[int, str]:
        """No replica is left: fetch ``fallback()``'s state (applied when it is first sent: :meth:`state`).

        Nothing is loaded into the model here: a joiner may not have built its
        model yet (:meth:`~unicron_elastic.strategy.engine.elastic_dp.ElasticDataParallel.start_join`).
        When nothing is left (no replica, no snapshot, no checkpoint) this
        rank's fresh state will be step 0's and ``dp_restart_from_step_0`` is logged.

        Raises:
            RuntimeError: Another shard of this replica resumes from a step whose state of this shard is gone.
        """
        state = self.fallback() if effect.step is None else self.fallback(effect.step)
        if state is None and effect.step:
            raise RuntimeError(f"rank {self.rank}: the replica resumes from step {effect.step}, whose snapshot or "
                               "checkpoint of this shard is gone")
        if state is None:
            log.warning("dp_restart_from_step_0", lost=self.protocol.members,
                        reason="no replica, no in-memory snapshot and no checkpoint is left")
            self._resume_state, self.state_source = STEP0, "step0"
            return 0, "step0"
        self._resume_state, self._resume_applied = state, False
        self.state_source = state.get("source", "fallback")
        return int(state["step"]), self.state_source

    def transfer(self, effect: E.TransferState) -> int | None:
        """The state (:meth:`state`) from the replica at ``root`` to every other member, tensor by tensor.

        A JSON skeleton first, then each tensor in its own broadcast, received
        into a preallocated tensor (:mod:`~unicron_elastic.strategy.engine.state_transfer`):
        no blob, and receiving never unpickles anything.

        Returns:
            With ``apply``, the step of the state this rank now holds (received and
            loaded; the root's own), else None.

        Raises:
            RuntimeError: The broadcast failed (a member left).
            StateEncodingError: (sender) The state holds a value the format cannot carry
                (the receivers are told at once and raise StateDecodingError).
            StateDecodingError: (receiver) What arrived is not a safe state.
        """
        group = self.groups.shard
        if group is None:
            raise RuntimeError("no group to send the state in")
        index = self.protocol.members.index(self.groups.layout.replica(self.rank))
        sent = self.state() if index == effect.root else None
        state = broadcast_state(group, effect.root, index, sent, device=self.groups.transport.device,
                                wait=self.groups.transport.wait)
        if not effect.apply:
            return None
        if index != effect.root:
            self._apply(state)
        return self.protocol.next_step
