"""The protocol's part for a sharded optimizer: the parameters are fresh before a step computes.

After an optimizer step a sharded optimizer's shares are updated and the
model's parameters are *stale* until a :class:`~unicron_elastic.strategy.engine.effects.Refresh`
gathers them (:mod:`~unicron_elastic.strategy.engine.optimizer_shards`). :class:`ShardedRefresh`
holds when that refresh is yielded: before the next step computes, after a
regroup in a step's reduction, before validation and when training ends. It is
a part of :class:`~unicron_elastic.strategy.engine.protocol.Protocol` (which
inherits it), kept apart as one responsibility; pure, as the protocol.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from unicron_elastic.strategy.engine.effects import AgreeMembers, DropGroup, Pause, Refresh, Regrouped

__all__ = ["Effects", "ShardedRefresh"]

Effects = Generator[Any, Any, Any]


class ShardedRefresh:
    """(Sharded) when the parameters are gathered: the protocol's generators of :class:`Refresh`.

    Uses the protocol's state (``sharded``, ``overlap_gather``, ``stale``,
    ``gathering``, its members and timeouts) and its regroups
    (``_regroup``, ``_follow_between_steps``).
    """

    def _refresh(self, step: int, overlap: bool = False) -> Effects:
        """(Sharded) every rank holds its share of the members' optimizer state and the updated parameters (with
        ``overlap``: their gather started)."""
        if self.sharded:
            yield Refresh(step, overlap)
            self.stale, self.gathering = False, overlap

    def _refreshed(self, step: int, outcome: Regrouped) -> Effects:
        """After a regroup in a step's reduction: :meth:`_refresh` (sharded), regrouping again while it fails.

        Returns:
            What each regroup changed, in order (each redistributed on its own, as on members whose refresh
            completed and who regroup in the reduction).
        """
        outcomes = [outcome]
        while True:
            try:
                yield from self._refresh(step)
                return outcomes
            except RuntimeError as exc:
                self.log.warning("dp_refresh_failed", step=step, error=str(exc)[:200])
                outcomes.append((yield from self._regroup(step, outcomes[-1].done)))

    def refresh(self, step: int, last: bool = False, settle: bool = False) -> Effects:
        """(Sharded, parameters stale) gather them before ``step`` computes, or when training ends (``last``).

        A failure drops the group: the parameters stay stale and the step's reduction regroups (every member
        then refreshes first); after the last step (``last``) the members regroup at once. With
        ``overlap_gather`` the gather is only started, unless ``last`` or ``settle``: then a gather in flight is
        waited for, as a refresh.

        Raises:
            Retired: (``last``) the record followed is a resize that leaves this rank out.
            Excluded: (``last``) a failure's record left this rank out.
        """
        if self.gathering and (last or settle):  # its Refresh waits for the gather in flight (failed: stale)
            self.stale, self.gathering = True, False
        if not self.stale:
            return
        try:
            yield from self._refresh(step, self.overlap_gather and not (last or settle))
        except RuntimeError as exc:
            self.log.warning("dp_refresh_failed", step=step, error=str(exc)[:200])
            if not last:
                yield DropGroup()  # peers blocked on us fail now; this step's reduction regroups
                return
            yield Pause(True, self.checkin_timeout + self.collective_timeout)  # regrouping: no hang
            yield from self._follow_between_steps(step, list(self.members))

    def before_validation(self, step: int) -> Effects:
        """(Sharded, between steps) make sure every member's parameters are gathered before it validates.

        Every member calls it at the same point (Lightning validates them all after the same step): a small
        collective of the members. A member whose gather failed dropped its group and a lost one is gone, so
        it then fails on every member, and they regroup and gather together now, as after a failed membership
        sync with ``compute_needs_group``; ``step`` is then dealt over the record followed. A one-sided
        regroup (the stale rank alone) would leave the others' agreed members and deal behind.

        Raises:
            Retired: The record followed is a resize that leaves this rank out.
            Excluded: A failure's record left this rank out.
        """
        if not self.sharded or step == self.synced_step:
            return
        yield from self.refresh(step, settle=True)  # (a gather in flight: waited for first)
        try:
            yield AgreeMembers(step, tuple(self.members) if self.is_primary else None)  # (a probe: no change)
        except RuntimeError as exc:
            yield Pause(True, self.checkin_timeout + self.collective_timeout)  # regrouping: no hang
            self.log.warning("dp_validation_sync_failed", step=step, error=str(exc)[:200])
            self.agreed.clear()  # (agreed in the last bucket, before the loss)
            self.synced_step = step
            self.early = Regrouped(None, (yield from self._follow_between_steps(step, list(self.members))), 0)

