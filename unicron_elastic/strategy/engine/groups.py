"""One generation's groups of a rank, built in one place and aborted together (TorchFT's configure/abort).

:class:`GenerationGroups` owns what a rank communicates over in one
generation: its shard's data-parallel group, with TP x PP > 1 the engine's
group over every rank (the step's commit, the pipeline), and the
bootstrap store they formed in. A :class:`~unicron_elastic.strategy.engine.engine_options.GroupListener`
(the Lightning strategy's world and megatron-core's groups) is built in the
same bootstrap store right after them and aborted right before them.

The bootstrap store stops waiting for a member whose liveness key is gone
(:func:`~unicron_elastic.strategy.engine.bootstrap.watch_members`), so a
group whose member died while it formed fails within a second, not at
gloo's timeout.
"""

from __future__ import annotations

import gc
import sys
from datetime import timedelta

import torch.distributed as dist

from unicron_elastic.store.keys import MeetingKeys as K
from unicron_elastic.strategy.engine.bootstrap import watch_members
from unicron_elastic.strategy.engine.engine_options import GroupListener
from unicron_elastic.strategy.engine.replicas import ModelParallel
from unicron_elastic.strategy.engine.transport import CollectiveTransport

__all__ = ["GenerationGroups"]


class GenerationGroups:
    """This rank's groups of the generation it holds.

    Args:
        store: The meeting store (the bootstrap stores wrap it).
        layout: The model's tensor x pipeline parallelism.
        rank: This launch rank.
        transport: Makes, aborts and interrupts the groups (gloo or NCCL).
        timeout: The groups' collective timeout.
        listener: Built after the groups of each generation, aborted before them.
        data_parallel: Build the engine's groups (False: only the listener's, e.g. a run that validates only).
    """

    def __init__(self, store: dist.Store, layout: ModelParallel, rank: int, transport: CollectiveTransport,
                 timeout: timedelta, listener: GroupListener | None = None, data_parallel: bool = True) -> None:
        self.store, self.layout, self.rank = store, layout, rank
        self.transport, self.timeout, self.listener = transport, timeout, listener
        self.data_parallel = data_parallel
        #: This shard's data-parallel group (None: none held).
        self.shard: dist.ProcessGroup | None = None
        #: With TP x PP > 1: the engine's group over every rank of the members (commit, pipeline).
        self.every_rank: dist.ProcessGroup | None = None
        #: Where each generation's groups bootstrapped. Gloo calls the Python store while a group lives,
        #: so each one is kept for the life of the process (one small object a generation).
        self.bootstrap_stores: list[dist.Store] = []
        #: Counts the generations built: work started under another count was started on groups gone since.
        self.built = 0
        self._started: list[dist.Work] = []  # work started on these groups that nobody waited for yet

    @property
    def held(self) -> bool:
        """Whether this rank holds a generation's groups (none aborted since they formed)."""
        return self.shard is not None or self.every_rank is not None

    def configure(self, generation: int, members: list[int]) -> None:
        """Build the groups of ``generation`` over ``members``, then the listener's.

        Args:
            generation: The generation of the membership record.
            members: The data-parallel members (replicas with TP x PP > 1).

        Raises:
            RuntimeError: A member is gone while they form (:class:`~unicron_elastic.strategy.engine.bootstrap.MemberGoneError`
                as soon as its liveness key is gone, else a gloo error or the timeout).
            LookupError: Their bootstrap keys are gone (a store outage).
        """
        store = watch_members(self.store, self.layout.ranks_of(members))
        self.bootstrap_stores.append(store)
        self.built += 1
        if self.data_parallel:
            self._build(store, generation, members)
        if self.listener is not None:
            self.listener.on_configure(store, generation, members)

    def _build(self, store: dist.Store, generation: int, members: list[int]) -> None:
        layout, replica = self.layout, self.layout.replica(self.rank)
        if layout.size == 1:
            self.shard = self.transport.new_group(dist.PrefixStore(K.group(generation), store),
                                                  members.index(replica), len(members), self.timeout)
            return
        shard = dist.PrefixStore(K.shard_group(generation, layout.shard(self.rank)), store)
        self.shard = self.transport.new_group(shard, members.index(replica), len(members), self.timeout)
        every_rank = dist.PrefixStore(K.commit_group(generation), store)
        self.every_rank = self.transport.new_group(every_rank, layout.world_rank(members, self.rank),
                                                   len(members) * layout.size, self.timeout)

    def started(self, work: dist.Work) -> dist.Work:
        """Note ``work`` started on these groups and not waited for (an overlapped bucket): it is settled,
        failed or done, before :meth:`abort` returns."""
        self._started.append(work)
        return work

    def waited(self, work: dist.Work) -> None:
        """``work`` was waited for (it is not settled at :meth:`abort` any more)."""
        self._started = [w for w in self._started if w is not work]

    def abort(self) -> None:
        """Abort the listener's groups, then this rank's groups, and release them; nothing held: nothing happens.

        Dropping them at once makes every survivor blocked on this rank see
        the failure within milliseconds instead of after a timeout. The last
        reference goes here, since gloo's destructor is what closes the sockets.
        Work started and not waited for (:meth:`started`) has ended when it
        returns: once the groups are interrupted it fails at once, and no
        operation of a group gone writes into a buffer the next generation
        reduces in.
        """
        if not self.held:
            return
        if self.listener is not None:
            self.listener.on_abort()
        held_elsewhere = False
        for name in ("shard", "every_rank"):
            pg = getattr(self, name)
            if pg is None:
                continue
            setattr(self, name, None)
            self.transport.abort(pg)
            held_elsewhere |= sys.getrefcount(pg) > 2  # This name and getrefcount's argument.
            del pg
        self._settle()
        if held_elsewhere:
            # A frame kept by a traceback still holds a group: a full collection (slow with big models) frees it.
            gc.collect()

    def _settle(self) -> None:
        """Wait for the work started and not waited for (after the abort: it fails at once, or it was done)."""
        started, self._started = self._started, []
        for work in started:
            try:
                work.wait()
            except RuntimeError:  # (the group's failure: the step's reduction saw it, or will regroup anyway)
                pass

    def interrupt(self) -> None:
        """Make this rank's operations in flight on its groups fail now (called from the group watch's thread)."""
        for pg in (self.shard, self.every_rank):
            if pg is not None:
                self.transport.interrupt(pg)
