"""A joiner's way into the data-parallel group, and the state a member hands out.

:class:`JoiningPath` is the part of
:class:`~unicron_elastic.strategy.engine.elastic_dp.ElasticDataParallel` a rank
runs to become a member: it asks to join, waits to be admitted at a step
boundary (the protocol's :meth:`~unicron_elastic.strategy.engine.protocol.Protocol.join`),
and receives the state from a replica, tensor by tensor; when no replica is
left, the lowest joiner resumes from the fallback (in-memory snapshot, then
checkpoint, else step 0) and hands that state to the others.
"""

from __future__ import annotations

import json
from typing import Any

import structlog
import torch

from unicron_elastic.store.keys import MeetingKeys as K
from unicron_elastic.strategy.engine import effects as E
from unicron_elastic.strategy.engine.state_transfer import broadcast_state

log = structlog.get_logger(__name__)

#: The interpreter stopped before an effect that needs the model (a joiner without one yet: :meth:`start_join`).
PAUSED = object()
#: No fallback state: this rank's fresh state is step 0's.
STEP0 = object()


class JoiningPath:
    """The joiner's methods of :class:`~unicron_elastic.strategy.engine.elastic_dp.ElasticDataParallel` (a mixin of it)."""

    def start_join(self, timeout: float = 120.0) -> bool:
        """Wait until the group admits this rank and its groups are built (``on_group`` ran), without a model.

        The join stops once its group formed, before it says it is ready for
        the state (from a replica, or the fallback state when no replica is
        left): :meth:`bind` the model, then :meth:`finish_join`; the members
        wait for that (``ready_timeout``), a declared pause. A megatron-core model can only
        be built once its world exists: the Lightning strategy admits a joiner
        before Lightning calls ``configure_model()``.

        Returns:
            False if training finished first (nothing to join), else True.

        Raises:
            TimeoutError: Not admitted within ``timeout`` seconds.
        """
        effects = self.protocol.join(timeout)
        outcome = self._run(effects, until=(E.MarkReady,))
        paused = isinstance(outcome, tuple) and bool(outcome) and outcome[0] is PAUSED
        self._joining = (effects, outcome[1]) if paused else (None, outcome)
        return paused or outcome is not None

    def finish_join(self) -> int | None:
        """Go on with the join :meth:`start_join` began, now that the model is bound.

        Returns:
            The step to continue from; None if training finished first.

        Raises:
            RuntimeError: No join was started, or no model is bound.
            TimeoutError: Not admitted within the join's timeout (after a failed admission).
        """
        if not self.params:
            raise RuntimeError("finish_join() before bind(): the join needs the model")
        if self._joining is None:
            raise RuntimeError("finish_join() without start_join()")
        (effects, pending), self._joining = self._joining, None
        return pending if effects is None else self._run(effects, pending=pending)

    def join(self, timeout: float = 120.0) -> int | None:
        """Wait until the group admits this rank, then load its state from a replica.

        With TP/PP, a replica is admitted once every rank of it waits; each
        rank receives the state of its shard from the same shard of a replica.
        When no replica is left (every member of the group that is still alive
        is itself waiting to join), the lowest waiting replica resumes from
        ``fallback()`` (in-memory snapshot, else persisted checkpoint), else
        from step 0 with its fresh state and a warning, and hands that state to
        the others. :attr:`state_source` says which it was.

        Returns:
            The step to continue from; None if training finished first.

        Raises:
            TimeoutError: Not admitted within ``timeout`` seconds.
        """
        self.start_join(timeout)
        return self.finish_join()

    def waiting(self) -> list[int]:
        """Members-to-be waiting in :meth:`join` to be admitted (replicas every rank of which waits, with TP/PP)."""
        return self.membership.waiting()

    def _read_members(self, effect: E.ReadMembers) -> tuple[int, list[int]] | None:
        if not self.store.check([K.MEMBERS]):
            return None
        last = json.loads(self.store.get(K.MEMBERS))
        return int(last["generation"]), list(last["members"])

    def _request_join(self, effect: E.RequestJoin) -> None:
        # The counter first: whoever sees the key (``waiting()``, e.g. a hold for joiners) must find the
        # counter raised, or the primary's next read misses the request for a step (seen under the CPU hog:
        # the joiner came one step too late, after the last step).
        self.store.add(K.JOIN_REQUESTS, 1)
        self.store.set(K.join(self.rank), "1")

    def _admitted(self, effect: E.Admitted) -> None:
        self.state_source = effect.source
        self._resume_state = None
        self.store.delete_key(K.join(self.rank))
        self.store.add(K.JOIN_REQUESTS, -1)

    def _fallback(self, effect: E.Fallback) -> tuple[int, str]:
        """No replica is left: fetch ``fallback()``'s state (applied when it is first sent: :meth:`state`).

        Nothing is loaded into the model here: a joiner may not have built its
        model yet (:meth:`start_join`). When nothing is left (no replica, no
        snapshot, no checkpoint) this rank's fresh state will be step 0's and
        ``dp_restart_from_step_0`` is logged.
        """
        state = self.fallback() if effect.step is None else self.fallback(effect.step)
        if state is None and effect.step:
            raise RuntimeError(f"rank {self.rank}: the replica resumes from step {effect.step}, whose snapshot or "
                               "checkpoint of this shard is gone")
        if state is None:  # nothing persisted: this joiner's fresh state is step 0's
            log.warning("dp_restart_from_step_0", lost=self.members,
                        reason="no replica, no in-memory snapshot and no checkpoint is left")
            self._resume_state, self.state_source = STEP0, "step0"
            return 0, "step0"
        self._resume_state, self._resume_applied = state, False
        self.state_source = state.get("source", "fallback")
        return int(state["step"]), self.state_source

    # -- state --------------------------------------------------------------------
    def _default_state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "rng": torch.get_rng_state()}

    def _load_default_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])

    def state(self) -> dict[str, Any]:
        """This replica's state at the current step boundary (what a joiner receives).

        A joiner that resumes the group from the fallback state (no replica
        was left) loads it on first use and hands out that state, its own live
        state being only partly restored until it trained a step.
        """
        if self._resume_state is STEP0:  # nothing was persisted: the fresh state is step 0's
            self._resume_state, self._resume_applied = {**self.get_state(), "step": 0, "source": "step0"}, True
        if self._resume_state is not None:
            if not self._resume_applied:
                self._apply_state(self._resume_state)
                self._resume_applied = True
            return self._resume_state
        return {**self.get_state(), "step": self.next_step}

    def _apply_state(self, state: dict[str, Any]) -> None:
        self.set_state(state)
        self.next_step = int(state["step"])

    def _transfer(self, effect: E.TransferState) -> int | None:
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
        if self.pg is None:
            raise RuntimeError("no group to send the state in")
        index = self.members.index(self.replica)
        state = broadcast_state(self.pg, effect.root, index, self.state() if index == effect.root else None,
                                device=self.transport.device)
        if not effect.apply:
            return None
        if index != effect.root:
            self._apply_state(state)
        return self.next_step
